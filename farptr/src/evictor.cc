// The evictor: CLOCK over resident spans, hot objects moved out of cold spans, cold spans written
// out as span sets (Carbink's swap-out).
//
// One round:
//   1. Sweep: for each resident span, count objects whose kHot bit is set and clear the bits
//      (CLOCK second chance). A span with no hot object is a victim. So is a span with only a few
//      hot objects (at most 1/8 of its live ones), which first gives them up: they are relocated
//      into the size class's hot span, and the cold rest leaves in the same round. Victims get
//      kEvacuating on every object and state kEvicting.
//   2. Grace period: wait until every scope that was open at step 1 has ended (scope.cc). A deref
//      that meets kEvacuating meanwhile cancels (the bytes never moved).
//   3. Relocate the hot objects of the victims still kEvicting; commit those victims (state
//      kWriting) and write them in sets of k with r parity spans, one batch per set.
//   4. Each written span becomes kRemote, its frame returns to the pool.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "farmem/ec/crc32c.h"
#include "heap.h"

namespace farmem::farptr_internal {

namespace {
// A span whose hot objects are at most this fraction of its live ones gives them up.
constexpr uint32_t kRelocateDivisor = 8;
}  // namespace

bool Heap::ShouldLog() {
  const int64_t now =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
          .count();
  int64_t last = last_warning_ms_.load(std::memory_order_relaxed);
  return now - last >= 5000 &&
         last_warning_ms_.compare_exchange_strong(last, now, std::memory_order_relaxed);
}

void Heap::EvictorLoop() {
  auto last_compact = Clock::now();
  int zero_rounds = 0;
  MutexLock lock(&evict_mu_);
  for (;;) {
    evict_cv_.WaitFor(&evict_mu_, std::chrono::milliseconds(50), [&] {
      evict_mu_.AssertHeld();
      return stopping_ || evict_wanted_;
    });
    if (stopping_) return;
    evict_wanted_ = false;
    lock.Unlock();
    if (frames_in_use_.load() > high_frames_) {
      MutexLock round(&evict_round_mu_);
      // Keep going while the mutators keep allocating.
      size_t progress = 0;
      for (int i = 0; i < 64 && frames_in_use_.load() > low_frames_; ++i) {
        // Swap-ins leave holes as fast as evictions fill sets: compact as we go, or remote
        // usage grows with every miss.
        if (options_.auto_compact && CompactionWanted()) {
          size_t moved = 0;
          DropCopiesInHoledSets();
          (void)CompactOnce(&moved);
        }
        const size_t n = EvictRound(low_frames_, false);
        if (n == 0) break;
        progress += n;
      }
      // A round can come back empty because derefs cancelled every victim (a scan walking into
      // the spans the sweep found coldest); only a second of that in a row counts as stuck.
      zero_rounds = progress > 0 ? 0 : zero_rounds + 1;
      if (progress > 0) {
        eviction_stalled_.store(false, std::memory_order_relaxed);
      } else if (zero_rounds >= 20 && frames_in_use_.load() > budget_frames_ &&
                 !eviction_stalled_.exchange(true, std::memory_order_relaxed)) {
        // Nothing can go out (daemons full or gone, everything pinned): holding threads at the
        // gate would only stall the program. Run over budget until eviction works again.
        if (ShouldLog()) {
          spdlog::warn("far memory: eviction is stuck at {} local (budget {}); running over budget",
                       FormatSize(frames_in_use_.load() * span_size_),
                       FormatSize(options_.local_budget));
        }
        SetOverBudget(this, over_budget_, false);
      }
    }
    if (options_.auto_compact && Clock::now() - last_compact > std::chrono::milliseconds(100)) {
      last_compact = Clock::now();
      if (CompactionWanted()) {
        MutexLock round(&evict_round_mu_);
        size_t moved = 0;
        DropCopiesInHoledSets();
        for (int i = 0; i < 8 && CompactionWanted(); ++i) {
          if (Status s = CompactOnce(&moved); !s.ok() || moved == 0) break;
          if (frames_in_use_.load() > high_frames_) break;  // eviction comes first
        }
      }
    }
    lock.Lock();
  }
}

bool Heap::TryReclaim() {
  if (!evict_round_mu_.TryLock()) return false;
  MutexLock round(&evict_round_mu_, kAdoptLock);
  size_t progress = 0;
  for (int i = 0; i < 16 && frames_in_use_.load() > low_frames_; ++i) {
    const size_t n = EvictRound(low_frames_, false, std::chrono::milliseconds(2));
    if (n == 0) break;
    progress += n;
  }
  return progress > 0;
}

Status Heap::EvictUntil(uint64_t target_bytes) {
  if (InScope()) {
    return InvalidArgument("EvictUntil inside a DerefScope would wait for its own scope");
  }
  const size_t target = static_cast<size_t>(target_bytes / span_size_);
  MutexLock round(&evict_round_mu_);
  // A round can come back empty while another thread holds spans' locks (the sweep only
  // try-locks: a compaction pass or a swap-in in flight, which on a loaded machine can take
  // tens of milliseconds): give up only when no round has given memory back for kPatience.
  // (Three empty rounds a yield apart gave up spuriously beside a compaction pass, ~1 run in 80
  // of far_list_queue_test on a loaded machine.)
  constexpr auto kPatience = std::chrono::milliseconds(500);
  auto last_progress = std::chrono::steady_clock::now();
  for (int i = 0, empty = 0; i < 1000 && frames_in_use_.load() > target;) {
    if (EvictRound(target, target == 0) != 0) {
      ++i;
      empty = 0;
      last_progress = std::chrono::steady_clock::now();
      continue;
    }
    if (std::chrono::steady_clock::now() - last_progress >= kPatience) break;
    if (++empty < 3) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));  // waits for a holder: no spin
    }
  }
  if (frames_in_use_.load() > target) {
    return ResourceExhausted(fmt::format(
        "{} of local memory still in use after evicting (target {}): pinned by scopes, or the "
        "daemons have no room",
        FormatSize(frames_in_use_.load() * span_size_), FormatSize(target_bytes)));
  }
  return Status::Ok();
}

// NO_THREAD_SAFETY_ANALYSIS: try-locks each span the clock hand reaches (SpanLock, skipped when
// busy); the analysis cannot follow span locks held that way.
size_t Heap::PickVictims(size_t need, bool force, std::vector<Span*>* victims,
                         std::vector<Relocation>* relocations) NO_THREAD_SAFETY_ANALYSIS {
  size_t total = 0;
  size_t released = 0;
  {
    MutexLock lock(&resident_mu_);
    total = resident_.size();
  }
  // Two passes of the hand at most: the first clears hot bits that the second then sees clear.
  for (size_t scanned = 0; scanned < 2 * total && victims->size() < need; ++scanned) {
    Span* s = nullptr;
    {
      MutexLock lock(&resident_mu_);
      if (resident_.empty()) break;
      if (clock_hand_ >= resident_.size()) clock_hand_ = 0;
      s = resident_[clock_hand_++];
    }
    SpanLock sl(&s->mu, std::try_to_lock);
    if (!sl.owns_lock() || s->state != SpanState::kLocal) continue;
    uint32_t hot = 0;
    uint32_t live = 0;
    hot_slots_.clear();
    for (uint32_t i = 0; i < s->owner.size(); ++i) {
      ObjectEntry* o = s->owner[i];
      if (o == nullptr) continue;
      ++live;
      if ((o->word.load(std::memory_order_relaxed) & kHot) != 0) {
        ++hot;
        hot_slots_.push_back(i);
        o->word.fetch_and(~kHot, std::memory_order_relaxed);
      }
    }
    if (live == 0) {
      // Nobody holds an empty resident span: an allocation fills a new span before it unlocks
      // it. This one is a hot span whose relocations were called off (their source became a
      // victim, or was freed): its frame would otherwise stay in use for good.
      ReleaseLocalLocked(s);
      ++released;
      continue;
    }
    if (hot > 0 && !force) {
      // Carbink's hot/cold separation: a mostly cold span hands its few hot objects to the hot
      // span of its class and leaves in this same round (Relocate runs before the write).
      if (hot * kRelocateDivisor > live || s->cls->slots <= 1) continue;
      for (uint32_t i : hot_slots_) relocations->push_back({s, i, s->owner[i]});
    }
    s->state = SpanState::kEvicting;
    for (ObjectEntry* o : s->owner) {
      if (o != nullptr) o->word.fetch_or(kEvacuating, std::memory_order_seq_cst);
    }
    victims->push_back(s);
  }
  return released;
}

// NO_THREAD_SAFETY_ANALYSIS: locks two spans in address order (which is first is decided at run
// time); the analysis cannot follow span locks held that way.
void Heap::Relocate(const std::vector<Relocation>& relocations) NO_THREAD_SAFETY_ANALYSIS {
  for (const Relocation& r : relocations) {
    SizeClass* c = r.span->cls;
    MutexLock cl(&c->mu);
    Span* dst = nullptr;
    {
      // The hot span itself went cold (r.span): a new one is started.
      SpanLock dl;
      dst = HotSpanLocked(c, r.span, &dl, false);
    }
    Span* src = r.span;
    // src may have lost all its objects since the sweep (freed: then retired, its owner table
    // cleared, and perhaps reused — even as the new hot span just taken above). Its object is
    // gone in every such case.
    if (src == dst) continue;
    SpanLock l1(src < dst ? &src->mu : &dst->mu);
    SpanLock l2(src < dst ? &dst->mu : &src->mu);
    // Sources are victims of this round: a deref that cancelled the eviction meanwhile made
    // the span kLocal again and cleared every kEvacuating (checked below).
    if (src->state != SpanState::kEvicting && src->state != SpanState::kLocal) continue;
    if (r.slot >= src->owner.size() || src->owner[r.slot] != r.entry) continue;  // freed
    const uint64_t w = r.entry->word.load(std::memory_order_seq_cst);
    if ((w & kEvacuating) == 0) continue;  // a deref took the span back
    // An object that cannot move (the hot span went meanwhile; still sealed: hot only as part of
    // a prefetch, its bytes are ciphertext) keeps kEvacuating and leaves with its span.
    if (dst->state != SpanState::kLocal || dst->free_slots.empty()) continue;
    if (src->sealed_left > 0 && src->sealed[r.slot]) continue;
    MoveObjectLocked(src, r.slot, dst, w);
    objects_relocated_.fetch_add(1, std::memory_order_relaxed);
  }
}

// NO_THREAD_SAFETY_ANALYSIS: the hot span's lock is handed to the caller in a SpanLock.
Span* Heap::HotSpanLocked(SizeClass* c, Span* not_this, SpanLock* lock,
                          bool try_only) NO_THREAD_SAFETY_ANALYSIS {
  Span* dst = c->hot_span;
  if (dst != nullptr && dst != not_this) {
    *lock = try_only ? SpanLock(&dst->mu, std::try_to_lock) : SpanLock(&dst->mu);
    if (!lock->owns_lock()) return nullptr;
    // A hot span that was evicted and came back has a clean copy: filling it would make that a
    // hole at once; start another.
    if (dst->state == SpanState::kLocal && !dst->free_slots.empty() && dst->set == nullptr) {
      return dst;
    }
    lock->unlock();
  }
  dst = NewSpan(c, SpanState::kLocal);
  // A new span: nobody else can reach it until c->hot_span names it, so this never waits.
  *lock = SpanLock(&dst->mu, std::try_to_lock);
  if (!lock->owns_lock()) *lock = SpanLock(&dst->mu);
  dst->frame = GetFrame();
  AddResident(dst);
  c->hot_span = dst;
  return dst;
}

uint32_t Heap::PlaceObjectLocked(Span* dst, ObjectEntry* e, const uint8_t* bytes, uint64_t flags) {
  const uint32_t csize = dst->cls->size;
  DropCopyLocked(dst);  // written below (a no-op for a hot span, which has no copy)
  const uint32_t slot = dst->free_slots.Take();
  uint8_t* to = dst->frame + static_cast<size_t>(slot) * csize;
  std::memcpy(to, bytes, csize);
  dst->owner[slot] = e;
  dst->live.fetch_add(1, std::memory_order_relaxed);
  e->slot.store(slot, std::memory_order_relaxed);
  e->span.store(dst, std::memory_order_release);
  e->word.store(reinterpret_cast<uint64_t>(to) | kPresent | kHot | flags,
                std::memory_order_seq_cst);
  return slot;
}

void Heap::MoveObjectLocked(Span* src, uint32_t from, Span* dst, uint64_t w) {
  SizeClass* c = src->cls;
  ObjectEntry* e = src->owner[from];
  if (src->set != nullptr) {
    remote_object_bytes_.fetch_sub(c->size, std::memory_order_relaxed);  // src's clean copy
    copy_object_bytes_.fetch_sub(c->size, std::memory_order_relaxed);
  }
  (void)PlaceObjectLocked(dst, e, src->frame + static_cast<size_t>(from) * c->size, w & kDirty);
  src->owner[from] = nullptr;
  src->free_slots.Put(from);
  if (src->live.fetch_sub(1, std::memory_order_relaxed) == 1) ReleaseLocalLocked(src);
}

size_t Heap::EvictRound(size_t target_frames, bool force, std::chrono::nanoseconds drain_limit) {
  const size_t in_use = frames_in_use_.load();
  if (in_use <= target_frames) return 0;
  size_t need = in_use - target_frames;
  const size_t k = static_cast<size_t>(res_.k);
  need = (need + k - 1) / k * k;
  std::vector<Span*> victims;
  std::vector<Relocation> relocations;
  const size_t released = PickVictims(need, force, &victims, &relocations);
  if (victims.empty() && relocations.empty()) return released;
  if (!WaitForScopesToDrainFor(drain_limit)) {
    // Give the round up: every mark goes, as if derefs had cancelled them.
    for (Span* s : victims) {
      MutexLock sl(&s->mu);
      if (s->state != SpanState::kEvicting) continue;
      for (ObjectEntry* o : s->owner) {
        if (o != nullptr) o->word.fetch_and(~kEvacuating, std::memory_order_seq_cst);
      }
      s->state = SpanState::kLocal;
    }
    for (const Relocation& r : relocations) {
      MutexLock sl(&r.span->mu);
      if (r.span->state == SpanState::kLocal && r.slot < r.span->owner.size() &&
          r.span->owner[r.slot] == r.entry) {
        r.entry->word.fetch_and(~kEvacuating, std::memory_order_seq_cst);
      }
    }
    return released;
  }
  const size_t relocated_before = objects_relocated_.load();
  Relocate(relocations);
  const size_t relocated = objects_relocated_.load() - relocated_before;
  std::vector<Span*> committed;
  size_t clean = 0;
  for (Span* s : victims) {
    MutexLock sl(&s->mu);
    if (s->state != SpanState::kEvicting) continue;  // a deref took it back
    if (s->live.load(std::memory_order_relaxed) == 0) {
      ReleaseLocalLocked(s);
      continue;
    }
    if (s->set != nullptr) {
      if (store_->Healthy(s->set)) {
        EvictCleanLocked(s);
        ++clean;
        continue;
      }
      DropCopyLocked(s);  // its group is degraded: write the span anew
      if (s->live.load(std::memory_order_relaxed) == 0) {  // all lost opening it (heap.h)
        ReleaseLocalLocked(s);
        continue;
      }
    }
    s->state = SpanState::kWriting;
    committed.push_back(s);
  }
  // Progress is memory given back: relocating hot objects frees nothing by itself.
  (void)relocated;
  return released + clean + WriteOut(committed);
}

void Heap::EvictCleanLocked(Span* s) {
  // Nothing in the span was written since it came in (DropCopyLocked runs before any write):
  // its cell still holds these bytes.
  for (ObjectEntry* o : s->owner) {
    if (o != nullptr) o->word.store(0, std::memory_order_release);
  }
  s->sealed.clear();  // what was still sealed is in the cell as it is
  s->sealed_left = 0;
  PutFrame(s->frame);
  s->frame = nullptr;
  RemoveResident(s);
  s->state = SpanState::kRemote;
  copy_object_bytes_.fetch_sub(
      static_cast<uint64_t>(s->live.load(std::memory_order_relaxed)) * s->cls->size,
      std::memory_order_relaxed);
  remote_spans_.fetch_add(1, std::memory_order_relaxed);
  spans_evicted_.fetch_add(1, std::memory_order_relaxed);
  clean_evictions_.fetch_add(1, std::memory_order_relaxed);
  s->cv.SignalAll();
}

void Heap::DropCopiesInHoledSets() {
  // Snapshot, then lock each span on its own (no other span lock is held here).
  for (Span* s : SpansOf(store_->CompactionCandidates(256))) {
    MutexLock sl(&s->mu);
    if (s->state == SpanState::kLocal || s->state == SpanState::kEvicting) DropCopyLocked(s);
  }
}

size_t Heap::WriteOut(std::vector<Span*>& spans) {
  const size_t k = static_cast<size_t>(res_.k);
  size_t written = 0;
  IoContext* io = CheckoutIo();
  // With encryption the spans go out as sealed images (span_crypto.h): each live object sealed
  // on its own, everything else zero. The frames keep the plaintext (a failed write leaves the
  // spans local).
  thread_local std::vector<uint8_t> sealed;
  if (crypto_ && sealed.size() < k * span_size_) sealed.resize(k * span_size_);
  size_t i = 0;
  for (; i < spans.size(); i += k) {
    const size_t n = std::min(k, spans.size() - i);
    const uint8_t* data[kMaxSetWidth];
    Span* members[kMaxSetWidth];
    Status seal_error;
    for (size_t j = 0; j < n; ++j) {
      members[j] = spans[i + j];
      // The span is kWriting: nobody writes its frame (derefs wait), frees only touch metadata.
      MutexLock sl(&members[j]->mu);
      data[j] = members[j]->frame;
      if (crypto_ && seal_error.ok()) {
        uint8_t* image = sealed.data() + j * span_size_;
        seal_error = crypto_->SealSpan(members[j]->frame, members[j]->cls->size, span_size_,
                                       members[j]->owner, image);
        data[j] = image;
      }
    }
    if (!seal_error.ok()) {
      if (ShouldLog()) spdlog::error("far memory: cannot seal spans: {}", seal_error.ToString());
      break;
    }
    // What compaction checks each cell against before it moves it (Span::cell_crc).
    uint32_t crcs[kMaxSetWidth];
    for (size_t j = 0; j < n; ++j) crcs[j] = ec::Crc32c({data[j], span_size_});
    SpanOwner* owners[kMaxSetWidth];
    OwnersOf(members, n, owners);
    Result<SpanSet*> set = store_->WriteSet(*io, {data, n}, {owners, n});
    if (!set && set.error().code() == StatusCode::kResourceExhausted) {
      // The daemons are full: compaction may give rows back.
      size_t moved = 0;
      for (int c = 0; c < 4 && !set; ++c) {
        if (!CompactOnce(&moved).ok() || moved == 0) break;
        set = store_->WriteSet(*io, {data, n}, {owners, n});
      }
    }
    if (!set) {
      if (!eviction_stalled_.load(std::memory_order_relaxed) && ShouldLog()) {
        spdlog::warn("far memory: cannot swap out {} spans: {}", n, set.error().ToString());
      }
      break;
    }
    sets_written_.fetch_add(1, std::memory_order_relaxed);
    for (size_t j = 0; j < n; ++j) {
      Span* s = members[j];
      MutexLock sl(&s->mu);
      for (ObjectEntry* o : s->owner) {
        if (o != nullptr) o->word.store(0, std::memory_order_release);
      }
      PutFrame(s->frame);
      s->frame = nullptr;
      RemoveResident(s);
      spans_evicted_.fetch_add(1, std::memory_order_relaxed);
      const uint32_t live = s->live.load(std::memory_order_relaxed);
      if (live == 0) {
        // Every object died while it was being written.
        store_->Release(*set, static_cast<int>(j));
        RetireLocked(s);
      } else {
        s->state = SpanState::kRemote;
        s->set = *set;
        s->member = static_cast<int>(j);
        s->cell_crc = crcs[j];
        remote_spans_.fetch_add(1, std::memory_order_relaxed);
        remote_object_bytes_.fetch_add(static_cast<uint64_t>(live) * s->cls->size,
                                       std::memory_order_relaxed);
      }
      s->cv.SignalAll();
      ++written;
    }
  }
  // Whatever could not be written stays local.
  for (; i < spans.size(); ++i) {
    Span* s = spans[i];
    MutexLock sl(&s->mu);
    for (ObjectEntry* o : s->owner) {
      if (o != nullptr) o->word.fetch_and(~kEvacuating, std::memory_order_seq_cst);
    }
    s->state = SpanState::kLocal;
    s->cv.SignalAll();
  }
  ReturnIo(io);
  return written;
}

}  // namespace farmem::farptr_internal
