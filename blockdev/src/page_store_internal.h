// The page store's internal types, shared by its files (see page_store.h for what it does):
//   page_store.cc          setup, the BlockBackend entry points, splitting requests into pieces
//   page_store_extents.cc  the extent map: mapping (also degraded), unmapping
//   page_store_round.{h,cc} the I/O round: a worker, Round, RunPieces
//   page_store_rebuild.cc  failures, rebuild and re-protection, the capacity check
//   page_store_move.cc     member copies (shared by rebuild and moves), eviction moves
// Nothing here is part of the page store's interface.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "farmem/client/cluster.h"
#include "farmem/common/log_every.h"
#include "farmem/common/mutex.h"
#include "farmem/common/status.h"

namespace farmem::blockdev::pagestore {

inline constexpr uint64_t kPage = 4096;
// A piece moves at most this much export data (also the size of the shared zero buffer):
// large enough that one op of a batch is a handful of pieces, small enough that a round of
// several pieces fits the staging memory below.
inline constexpr uint64_t kMaxPiece = 1 << 20;
// A round of ec:k+r moves at most this much export data: each worker's ec staging memory is sized
// for it (kRoundBytes / 4096 pages x (k + r) fragments), allocated once at start and locked in
// swap-safe mode (384 KiB a worker for ec:4+2; 5 workers by default). With ec:k+r a piece is at
// most kRoundBytes, so larger requests go in several rounds. The kernel's swap I/O is mostly
// single pages and page clusters of a few tens of KiB: one round each.
inline constexpr uint64_t kRoundBytes = 256 << 10;
static_assert(kRoundBytes % kPage == 0 && kRoundBytes <= kMaxPiece);
// Attempts of a piece whose members failed (each after a rebuild) before the op fails.
inline constexpr int kMaxRetries = 3;
// A round holds at most this many pieces (a fixed array, no allocation on the request path)...
inline constexpr size_t kMaxRoundPieces = 64;
// ...posts at most this many ops to one daemon (below a channel's window, max_outstanding in
// transport.h, 64 by default, so that a Post never finds the window full)...
inline constexpr uint32_t kMaxOpsPerNode = 48;
// ...and locks at most this many extents (the worker's lock vectors are reserved for 32).
inline constexpr size_t kMaxRoundExtents = 16;
// Members of a group are kept as 32-bit masks (bit j: member j).
inline constexpr int kMaxMembers = 32;

const std::vector<uint8_t>& ZeroBuffer();  // kMaxPiece zero bytes

// A member of a group mapped degraded that never had a lease (no daemon could take it): lease
// id 0 (daemons never grant it), on no node. It is marked failed, so nothing is ever posted to it.
inline constexpr client::NodeId kNoNode = ~client::NodeId{0};
inline bool IsVacant(const client::Lease& l) { return l.grant.lease_id == 0; }

// The page store's rate-limited kinds of log lines (farmem/common/log_every.h).
using farmem::LogEvery;
using farmem::Suppressed;
LogEvery& DegradedMapLog();
LogEvery& RebuildFailLog();
LogEvery& StillDegradedLog();
// A request that fails (a lost page read, every copy gone, too many failed daemons), in the page
// store and in the NBD connection that replies with the error: a client that reads a lost range
// sector by sector would otherwise log two lines per request (66,000 lines in a second in the
// chaos scenario none-subpage-kill). The LOST range lines say what is lost, once per range.
LogEvery& RequestErrorLog();

struct Extent {
  // One member copy (rebuild of a lost member, or move of a leaving one) at a time; taken before
  // mu, never while holding it.
  Mutex copy_mu ACQUIRED_BEFORE(mu);
  // I/O holds it shared for a round; unmap holds it exclusively, and a member copy holds it
  // shared while it copies and exclusively only to redo what was written meanwhile and swap the
  // member in (page_store_move.cc).
  SharedMutex mu;
  std::atomic<bool> mapped{false};
  // Written before `mapped` is published (MapExtent, under the store's map lock, which nothing
  // reads before `mapped` is true), and afterwards only under mu exclusive (rebuild, unmap); read
  // under mu shared. Not GUARDED_BY(mu): the first mapping is published by `mapped`, not by mu.
  std::vector<client::Lease> members;
  std::atomic<uint32_t> failed{0};  // bit j: member j's copy is gone
  // Bit j: member j's daemon sent EVICT_NOTICE for it. It is still live (read and written as
  // any other) until it is moved to another daemon or its deadline passes.
  std::atomic<uint32_t> leaving{0};
  uint64_t pages = 0;
  std::unique_ptr<std::atomic<uint64_t>[]> written;  // page has data
  std::unique_ptr<std::atomic<uint64_t>[]> lost;     // page's data is gone for good
  // While a member copy runs (`tracking`, switched on under mu exclusive, so every write round
  // that starts afterwards sees it), write pieces mark their pages here before they are posted:
  // the copy redoes them before it swaps the member in.
  std::atomic<bool> tracking{false};
  // Bit j: a write went to the other members (or the backup file) but not to member j while it
  // was failed. Such a member must be rebuilt, never used again as it is, even if its daemon
  // answers again with the lease intact (kLeasesReturned). Cleared when member j is replaced.
  std::atomic<uint32_t> stale{0};
  std::unique_ptr<std::atomic<uint64_t>[]> dirty;

  size_t words() const { return static_cast<size_t>((pages + 63) / 64); }
  bool Test(const std::unique_ptr<std::atomic<uint64_t>[]>& bits, uint64_t p) const {
    return (bits[p / 64].load(std::memory_order_acquire) >> (p % 64)) & 1;
  }
  void Set(std::unique_ptr<std::atomic<uint64_t>[]>& bits, uint64_t p, bool v) {
    const uint64_t m = uint64_t{1} << (p % 64);
    if (v) {
      bits[p / 64].fetch_or(m, std::memory_order_acq_rel);
    } else {
      bits[p / 64].fetch_and(~m, std::memory_order_acq_rel);
    }
  }
  bool Any() const {
    for (size_t i = 0; i < words(); ++i) {
      if (written[i].load(std::memory_order_acquire) != 0) return true;
    }
    return false;
  }
  uint32_t all_mask() const { return members.size() >= 32 ? ~0u : ((1u << members.size()) - 1); }
  uint32_t live_mask() const { return all_mask() & ~failed.load(std::memory_order_acquire); }
};

inline bool SameLease(const client::Lease& a, const client::Lease& b) {
  return a.node == b.node && a.id() == b.id();
}
// Whether member j of `e` is still the lease `l` (mu held): not unmapped, trimmed or replaced.
inline bool StillMember(const Extent& e, size_t j, const client::Lease& l) {
  return e.mapped.load(std::memory_order_acquire) && j < e.members.size() &&
         SameLease(e.members[j], l);
}

// One piece: whole pages of one extent.
struct Piece {
  Extent* extent = nullptr;
  uint64_t index = 0;       // extent index
  uint64_t first_page = 0;  // within the extent
  uint64_t npages = 0;
  bool write = false;
  size_t op = 0;             // index of the BlockOp it came from
  uint8_t* buf = nullptr;    // export bytes: destination (read) or source (write)
  uint8_t* stage = nullptr;  // ec: (k+r) fragment arrays of npages*frag bytes
  uint32_t ok_mask = 0;      // members whose op completed OK
  uint32_t fail_mask = 0;    // members whose op failed
  uint32_t posted_mask = 0;
  int8_t order[kMaxMembers] = {};  // ec read: members in arrival order
  int arrived = 0;
  bool settled = false;   // its success was handled while the round still waited (early)
  bool finished = false;  // a read's FinishRead ran (it opens pages in place: only once)
  uint32_t bad = 0;       // pages that failed authentication (RunPieces recovers them)
  Status first_error;

  // Forgets what one attempt found (masks, arrivals, errors), before the piece runs again.
  void ResetForRetry() {
    ok_mask = fail_mask = posted_mask = 0;
    arrived = 0;
    finished = false;
    bad = 0;
    first_error = Status();
  }
  // A write is about to go out (its round holds the extent shared): a member copy running now
  // must redo these pages.
  void MarkDirty() {
    if (!extent->tracking.load(std::memory_order_acquire)) return;
    for (uint64_t pg = 0; pg < npages; ++pg) extent->Set(extent->dirty, first_page + pg, true);
  }
  // Its pages hold data now (a write succeeded): set written, clear lost.
  void MarkWritten() {
    for (uint64_t pg = 0; pg < npages; ++pg) {
      extent->Set(extent->written, first_page + pg, true);
      extent->Set(extent->lost, first_page + pg, false);
    }
  }
};

}  // namespace farmem::blockdev::pagestore
