// Remote compaction, done by the client: span sets with holes, sparse remote spans and the sets
// of a group that could be emptied are read back (one read per span, no local frame), their live
// objects are packed densely into new span images per size class, and the images go out as new
// full span sets. The old cells become holes, so their rows and then their slab groups go back
// to the daemons. Remote usage then tracks live data instead of growing with every swap-in and
// free.
//
// Objects that move keep their entries (far_ptrs never change): entry->span / slot are updated
// while both the old and the new span are locked, and a mutator that waited on the old span's
// lock sees that its entry moved and retries on the new one.
//
// Offload (RuntimeOptions::parity_offload, remote_store_offload.cc): the plan — which object
// goes to which slot of which new span — needs only the owner tables, not the bytes. So the
// daemons that will hold the new data cells assemble them from the old cells themselves
// (GATHER_CELL, one request per cell naming the pieces) and the parity daemons compute parity
// from them (PARITY_ENCODE): no span crosses the client, which sends a few KiB of requests per
// set. If that fails (a degraded source, a daemon without these opcodes), the pass undoes what
// it wrote and moves the bytes itself: every live byte crosses the client twice (read back,
// written out), and with offload on the r parity cells are still computed by the daemons.
// Counters: compaction_client_bytes_* and compaction_cpu_ns (this thread's CPU clock).
//
// Corruption (a bit flip in a lender's memory) must not ride along: an object moved unopened
// into a new set gets new parity computed over its corrupted bytes, and the old set — the copy
// that could have rebuilt it — is freed. So every source cell is checked against the CRC-32C it
// was written with (Span::cell_crc; a checksum needs no key, so the daemons check what they
// gather and report it in GATHER_CELL's reply; here the client checks what it read). A cell that
// fails is reported like a failed tag (RemoteStore::ReportCorrupt: the member is re-protected)
// and read again, rebuilt from the other members, before anything moves; with no redundancy to
// rebuild it, it moves as it is and its objects fail authentication when dereferenced, as they
// would have where they were.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "farmem/common/cpu_time.h"
#include "farmem/ec/crc32c.h"
#include "heap.h"

namespace farmem::farptr_internal {

namespace {
// Remote spans fuller than this are left alone unless their set has holes. 85% keeps span-set
// bytes within ~1.25x of (k + r) / k x live bytes; lower values compact less often.
constexpr double kSparseFill = 0.85;
}  // namespace

bool Heap::CompactionWanted() const {
  const RemoteStoreStats rs = store_->stats();
  const double expansion = static_cast<double>(res_.width()) / res_.k;
  const double live = static_cast<double>(remote_object_bytes_.load(std::memory_order_relaxed));
  const double slack = 2.0 * res_.width() * span_size_;
  if (static_cast<double>(rs.set_bytes) > expansion * live * options_.compact_trigger + slack) {
    return true;
  }
  // Slabs held beyond the rows in use: at least one whole group could go back. An empty group
  // (leased ahead of need) holds no row to move: it does not count.
  if (rs.groups <= rs.empty_groups) return false;
  const uint64_t group_bytes = rs.leased_bytes / rs.groups;
  return rs.leased_bytes - rs.empty_groups * group_bytes - rs.set_bytes >= group_bytes;
}

Status Heap::Compact() {
  if (InScope()) return InvalidArgument("Compact inside a DerefScope");
  MutexLock round(&evict_round_mu_);
  size_t moved = 0;
  Status st;
  for (int i = 0; i < 64; ++i) {
    st = CompactOnce(&moved);
    if (!st.ok() || moved == 0 || !CompactionWanted()) break;
  }
  return st;
}

// NO_THREAD_SAFETY_ANALYSIS: holds a vector of try-locked span locks for the whole round; the
// analysis cannot follow span locks held that way.
Status Heap::CompactOnce(size_t* moved) NO_THREAD_SAFETY_ANALYSIS {
  *moved = 0;
  // Client CPU for compaction, whichever thread runs it (Compact, or the evictor).
  ThreadCpuMeter cpu(compaction_cpu_ns_);
  const size_t k = static_cast<size_t>(res_.k);
  // Every victim stays locked for the whole pass: keep the batch modest (ThreadSanitizer also
  // tracks at most 64 locks held by one thread).
  const size_t batch = std::min<size_t>(std::max<size_t>(4 * k, 16), 32);
  std::vector<Span*> cands = SpansOf(store_->CompactionCandidates(batch));
  const std::set<Span*> from_sets(cands.begin(), cands.end());
  if (cands.size() < batch) {
    // Sparse remote spans, emptiest first.
    std::vector<std::pair<double, Span*>> sparse;
    {
      MutexLock lock(&spans_mu_);
      for (auto& s : spans_) {
        if (from_sets.count(s.get()) != 0) continue;
        const uint32_t live = s->live.load(std::memory_order_relaxed);
        if (live == 0) continue;
        const double fill = static_cast<double>(live) / s->cls->slots;
        if (fill < kSparseFill) sparse.emplace_back(fill, s.get());
      }
    }
    std::sort(sparse.begin(), sparse.end());
    for (auto& [fill, s] : sparse) {
      if (cands.size() >= batch) break;
      cands.push_back(s);
    }
  }
  std::sort(cands.begin(), cands.end());
  cands.erase(std::unique(cands.begin(), cands.end()), cands.end());

  // Lock what is still remote (in address order; skip spans someone is using).
  std::vector<SpanLock> locks;
  std::vector<Span*> victims;
  for (Span* s : cands) {
    SpanLock l(&s->mu, std::try_to_lock);
    if (!l.owns_lock() || s->state != SpanState::kRemote || s->set == nullptr) continue;
    victims.push_back(s);
    locks.push_back(std::move(l));
  }
  // Per size class: is rewriting worth it?
  std::map<SizeClass*, std::vector<Span*>> by_class;
  for (Span* s : victims) by_class[s->cls].push_back(s);
  std::vector<Span*> work;
  size_t new_total = 0;
  std::set<SpanSet*> sets_touched;
  for (auto& [cls, spans] : by_class) {
    uint64_t live = 0;
    bool holed = false;
    for (Span* s : spans) {
      live += s->live.load(std::memory_order_relaxed);
      holed = holed || from_sets.count(s) != 0;
    }
    const size_t out = static_cast<size_t>((live + cls->slots - 1) / cls->slots);
    if (out >= spans.size() && !holed) continue;
    new_total += out;
    for (Span* s : spans) {
      work.push_back(s);
      sets_touched.insert(s->set);
    }
  }
  if (work.empty() ||
      (new_total >= work.size() && (new_total + k - 1) / k >= sets_touched.size())) {
    return Status::Ok();  // nothing to gain
  }

  // Plan: live objects packed densely into new images, class by class. The new spans reuse the
  // victims' structs (same class, already locked): image i of a class goes to that class's i-th
  // victim. The plan needs only the owner tables, not the bytes.
  struct Move {
    ObjectEntry* e;
    size_t target;  // index into `targets`
    uint32_t slot;
    size_t from;  // index into `work`
    uint32_t from_slot;
  };
  std::vector<Move> moves;
  std::vector<Span*> targets;  // victims that receive an image, in image order
  {
    size_t wi = 0;
    while (wi < work.size()) {
      SizeClass* cls = work[wi]->cls;
      const size_t first_victim = wi;
      size_t class_images = 0;
      uint32_t next_slot = cls->slots;  // forces a new image at the first object
      for (; wi < work.size() && work[wi]->cls == cls; ++wi) {
        Span* s = work[wi];
        for (uint32_t i = 0; i < s->owner.size(); ++i) {
          ObjectEntry* e = s->owner[i];
          if (e == nullptr) continue;
          if (next_slot == cls->slots) {
            targets.push_back(work[first_victim + class_images++]);
            next_slot = 0;
          }
          moves.push_back({e, targets.size() - 1, next_slot, wi, i});
          ++next_slot;
        }
      }
    }
  }

  IoContext* io = CheckoutIo();
  // What this pass moves over the client's links, counted where it happens (RunOps and the
  // offload requests), before ReturnIo folds the I/O counters into the heap's.
  const uint64_t read0 = io->bytes_read + io->offload_bytes_received;
  const uint64_t sent0 = io->bytes_written + io->offload_bytes_sent;
  auto account = [&] {
    const uint64_t got = io->bytes_read + io->offload_bytes_received - read0;
    const uint64_t sent = io->bytes_written + io->offload_bytes_sent - sent0;
    compaction_bytes_received_.fetch_add(got, std::memory_order_relaxed);
    compaction_bytes_sent_.fetch_add(sent, std::memory_order_relaxed);
    compaction_client_bytes_.fetch_add(got + sent, std::memory_order_relaxed);
  };
  Status st;
  std::vector<std::pair<SpanSet*, size_t>> written;  // set, first target index
  auto unwind = [&] {
    for (auto& [set, first] : written) {
      for (size_t j = 0; j < k && first + j < targets.size(); ++j) {
        store_->Release(set, static_cast<int>(j));
      }
    }
    written.clear();
  };

  std::vector<uint32_t> new_crcs(targets.size(), 0);  // each new data cell's CRC-32C
  // With offload the daemons move the objects themselves (GATHER_CELL) and compute parity
  // (PARITY_ENCODE): no span crosses this process. On any error, undo and move them here.
  bool offloaded = false;
  if (options_.parity_offload && res_.mode == SpanResilience::Mode::kErasure && res_.r > 0) {
    std::vector<std::vector<RemoteStore::GatherPiece>> cells(targets.size());
    for (const Move& m : moves) {
      Span* from = work[m.from];
      const uint32_t size = from->cls->size;
      const uint32_t src = m.from_slot * size, dst = m.slot * size;
      auto& pieces = cells[m.target];
      if (!pieces.empty() && pieces.back().set == from->set &&
          pieces.back().member == from->member &&
          pieces.back().src_offset + pieces.back().length == src &&
          pieces.back().dst_offset + pieces.back().length == dst) {
        pieces.back().length += size;  // contiguous in both: one copy
      } else {
        pieces.push_back({from->set, from->member, from->cell_crc, src, dst, size});
      }
    }
    Status gather_error;
    std::vector<std::pair<SpanSet*, int>> corrupt;
    for (size_t i = 0; i < targets.size(); i += k) {
      const size_t n = std::min(k, targets.size() - i);
      SpanOwner* owners[kMaxSetWidth];
      OwnersOf(targets.data() + i, n, owners);
      Result<SpanSet*> set = store_->WriteSetGathered(*io, {cells.data() + i, n}, {owners, n},
                                                      {new_crcs.data() + i, n}, &corrupt);
      if (!set) {
        gather_error = set.error();
        break;
      }
      written.emplace_back(*set, i);
    }
    // Sources the daemons found corrupted: repaired (re-protected) and read rebuilt below.
    for (auto& [set, member] : corrupt) {
      Span* from = nullptr;
      for (Span* w : work) {
        if (w->set == set && w->member == member) from = w;
      }
      if (from != nullptr) ReportCorruptCell(from, "the daemon gathering it");
    }
    if (gather_error.ok()) {
      offloaded = true;
      compaction_offloaded_sets_.fetch_add(written.size(), std::memory_order_relaxed);
    } else {
      unwind();
      compaction_offload_fallbacks_.fetch_add(1, std::memory_order_relaxed);
      if (ShouldLog()) {
        spdlog::warn("far memory: compaction offload failed, the client moves the bytes: {}",
                     gather_error.ToString());
      }
    }
  }

  if (!offloaded) {
    // Read the victims back and pack them here.
    std::vector<uint8_t> in(static_cast<size_t>(span_size_) * work.size());
    for (size_t i = 0; i < work.size() && st.ok(); ++i) {
      uint8_t* cell = in.data() + i * static_cast<size_t>(span_size_);
      st = store_->ReadSpan(*io, work[i]->set, work[i]->member, cell);
      if (st.ok() && ec::Crc32c({cell, span_size_}) != work[i]->cell_crc &&
          ReportCorruptCell(work[i], "this client reading it back")) {
        // Read again: rebuilt from the other members now. If even that does not match, it
        // moves as it is (its objects fail authentication when dereferenced, as they would
        // have where they were).
        st = store_->ReadSpan(*io, work[i]->set, work[i]->member, cell);
      }
      if (st.code() == StatusCode::kDataLoss) {
        // Nothing to move: the span is lost (deref reports it). Try again without it.
        MarkLostLocked(work[i], Status(st.code(), Describe(work[i]) + " is lost: " + st.message()));
        account();
        ReturnIo(io);
        return Status::Ok();
      }
      if (!st.ok()) st = st.WithContext(Describe(work[i]));
    }
    if (!st.ok()) {
      account();
      ReturnIo(io);
      return st.WithContext("compaction");
    }
    std::vector<uint8_t> out(static_cast<size_t>(span_size_) * new_total, 0);
    for (const Move& m : moves) {
      const size_t size = work[m.from]->cls->size;
      std::memcpy(out.data() + m.target * span_size_ + m.slot * size,
                  in.data() + m.from * span_size_ + m.from_slot * size, size);
    }
    for (size_t t = 0; t < targets.size(); ++t) {
      new_crcs[t] = ec::Crc32c({out.data() + t * span_size_, span_size_});
    }
    // Write the new span sets (parity by the daemons when offload is on).
    for (size_t i = 0; i < targets.size() && st.ok(); i += k) {
      const size_t n = std::min(k, targets.size() - i);
      const uint8_t* data[kMaxSetWidth];
      for (size_t j = 0; j < n; ++j) data[j] = out.data() + (i + j) * span_size_;
      SpanOwner* owners[kMaxSetWidth];
      OwnersOf(targets.data() + i, n, owners);
      Result<SpanSet*> set = Err(Internal("not written"));
      if (options_.parity_offload) {
        Status offload_error;
        set = store_->WriteSetOffloaded(*io, {data, n}, {owners, n}, &offload_error);
        if (set && offload_error.ok()) {
          compaction_offloaded_sets_.fetch_add(1, std::memory_order_relaxed);
        } else if (!offload_error.ok()) {
          compaction_offload_fallbacks_.fetch_add(1, std::memory_order_relaxed);
          if (ShouldLog()) {
            spdlog::warn("far memory: parity offload failed, compaction computes parity itself: {}",
                         offload_error.ToString());
          }
        }
      } else {
        set = store_->WriteSet(*io, {data, n}, {owners, n});
      }
      if (!set) {
        st = set.error();
        break;
      }
      written.emplace_back(*set, i);
    }
  }
  account();
  ReturnIo(io);
  if (!st.ok()) {
    unwind();
    return st.WithContext("compaction");
  }
  // Committed: the old cells become holes, the victims take their new identities.
  for (Span* s : work) {
    store_->Release(s->set, s->member);
    s->set = nullptr;
    s->owner.assign(s->cls->slots, nullptr);
    s->live.store(0, std::memory_order_relaxed);
  }
  for (auto& [set, first] : written) {
    for (size_t j = 0; j < k && first + j < targets.size(); ++j) {
      targets[first + j]->set = set;
      targets[first + j]->member = static_cast<int>(j);
      targets[first + j]->cell_crc = new_crcs[first + j];
    }
  }
  for (const Move& m : moves) {
    Span* t = targets[m.target];
    t->owner[m.slot] = m.e;
    t->live.fetch_add(1, std::memory_order_relaxed);
    m.e->slot.store(m.slot, std::memory_order_relaxed);
    m.e->span.store(t, std::memory_order_release);
  }
  for (Span* s : work) {
    if (s->set == nullptr) {
      RetireLocked(s);
      continue;
    }
    s->free_slots.Reset(s->cls->slots, false);
    for (uint32_t i = 0; i < s->cls->slots; ++i) {
      if (s->owner[i] == nullptr) s->free_slots.Put(i);
    }
  }
  const size_t fresh_count = targets.size();
  remote_spans_.fetch_add(fresh_count, std::memory_order_relaxed);
  remote_spans_.fetch_sub(work.size(), std::memory_order_relaxed);
  compactions_.fetch_add(1, std::memory_order_relaxed);
  compaction_spans_in_.fetch_add(work.size(), std::memory_order_relaxed);
  compaction_spans_out_.fetch_add(fresh_count, std::memory_order_relaxed);
  *moved = work.size();
  spdlog::debug("far memory: compacted {} remote spans ({} sets) into {}", work.size(),
                sets_touched.size(), fresh_count);
  return Status::Ok();
}

bool Heap::ReportCorruptCell(Span* s, const char* found_by) {
  compaction_corrupt_cells_.fetch_add(1, std::memory_order_relaxed);
  const int member = s->member;
  const Status why = DataLoss(fmt::format(
      "{} in span set member {} failed its checksum (CRC-32C), found by {} for compaction: its "
      "bytes on the daemon were corrupted",
      Describe(s), member, found_by));
  const bool repair = store_->ReportCorrupt(s->set, member, why);
  // Logged as the failed tags of OpenSealedLocked are, and as often (they count alike).
  const int64_t now =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
          .count();
  int64_t last = last_auth_log_ms_.load(std::memory_order_relaxed);
  if (now - last >= 5000 &&
      last_auth_log_ms_.compare_exchange_strong(last, now, std::memory_order_relaxed)) {
    spdlog::error(
        "far memory: {}; {} ({} such cells found by compaction so far; logged at most "
        "every 5 s)",
        why.message(),
        repair ? "the member is being re-protected and the span is read from the other "
                 "members before it moves"
               : "nothing else holds it: it moves as it is",
        compaction_corrupt_cells_.load(std::memory_order_relaxed));
  }
  return repair;
}

}  // namespace farmem::farptr_internal
