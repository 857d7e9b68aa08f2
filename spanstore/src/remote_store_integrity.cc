// RemoteStore and encryption: a cell whose objects failed authentication is treated like a
// failed member (see span_crypto.h, docs/farptr.md "Encryption").
#include <bit>

#include "farmem/spanstore/remote_store.h"

namespace farmem::spanstore {

bool RemoteStore::ReportCorrupt(SpanSet* set, int member, const Status& why) {
  bool marked = false;
  {
    // One critical section from the look to the mark: the recovery thread may re-protect the
    // member as soon as it is marked (a rebuild of a few ms), and a look at the mask after that
    // would find it whole and answer false — losing a cell that the re-read (from the rebuilt
    // member) would have given back (CI: farptr-ec21-flip lost a span that way at load ~4).
    MutexLock lock(&mu_);
    if (res_.mode == client::Resilience::Mode::kNone) return false;
    Group* g = set->group;
    const uint32_t bit = 1u << member;
    const uint32_t bad = g->failed_mask | g->lost_mask;
    const int tolerance = res_.group_size() - MinMembers();
    // Failed already (by another cell of this member): this cell was read before that — a span
    // swapped in keeps its objects sealed until their first deref, and the compactor reads
    // several cells before it checks them. A read now rebuilds it from the other members (or
    // reads the member re-protected). If this cell was itself rebuilt, the read gives the same
    // bytes, they fail again, and the caller loses them then.
    if ((bad & bit) != 0) {
      return (g->lost_mask & bit) == 0 && std::popcount(bad) <= tolerance;
    }
    if (std::popcount(bad | bit) > tolerance) return false;
    // Its bytes cannot be trusted any more: it is rebuilt, never used again as it is (the
    // recovery loop would otherwise revalidate a failed member whose lease is still held).
    g->stale_mask |= bit;
    // From here a read of the cell is degraded (rebuilt from the others) until the member is
    // re-protected, and then reads the member rebuilt from them: true either way.
    marked = MarkFailedLocked(g, member, g->members[static_cast<size_t>(member)].id(), why);
  }
  if (marked) recovery_cv_.SignalAll();
  return marked;
}

std::vector<std::pair<client::Lease, uint64_t>> RemoteStore::CellPlaces(const SpanSet* set,
                                                                        int member) const {
  MutexLock lock(&mu_);
  std::vector<std::pair<client::Lease, uint64_t>> out;
  const Group* g = set->group;
  const uint64_t off = static_cast<uint64_t>(set->row) * span_size_;
  for (int m = 0; m < res_.group_size(); ++m) {
    if (m != member && res_.mode != client::Resilience::Mode::kReplicate) continue;
    const client::Lease& l = g->members[static_cast<size_t>(m)];
    if (!Vacant(l)) out.emplace_back(l, off);
  }
  return out;
}

}  // namespace farmem::spanstore
