// Object paths, the remote side: deref miss (swap-in of one span, opening sealed objects, losing
// the ones no copy can produce) and prefetch. Allocation, free, frames, entries and span
// bookkeeping are in object_heap.cc.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "heap.h"

namespace farmem::farptr_internal {

namespace {
// A miss gathers its object into the hot span only for classes of at least this many slots per
// span: a span of a few large objects is read for little more than the one wanted anyway.
constexpr uint32_t kGatherMinSlots = 8;

// Where this thread's gathering misses read their objects (RemoteStore::ReadSpan with a piece:
// only the object's sealed bytes, packed one slot after another), `bytes` long: one area kept
// across calls, so its pages stay resident and a miss takes no page fault (whole frames as
// scratch did: a round of 30 misses took 30 frames, beyond the free-frame cache, and each came
// back from the kernel zeroed). At most kMaxReadRound slots of a gathering class: a slot is at
// most span_size / kGatherMinSlots. Not counted in local_budget (like io.scratch).
uint8_t* PieceScratch(size_t bytes) {
  thread_local std::vector<uint8_t> area;
  if (area.size() < bytes) area.resize(bytes);
  return area.data();
}
}  // namespace

// ---------------------------------------------------------------------------------------------
// Deref miss

Result<void*> Heap::Deref(ObjectEntry* e, bool mut) {
  const uint64_t bits = kHot | (mut ? kDirty : 0);
  for (;;) {
    uint64_t w = LoadWord(e);
    if ((w & kPresent) != 0 && (w & kEvacuating) == 0 && (!mut || (w & kDirty) != 0)) {
      // Present, only the hot bit missing. (A first write takes the span lock below: the span's
      // clean remote copy must become a hole first.)
      if (e->word.compare_exchange_weak(w, w | bits, std::memory_order_seq_cst)) {
        return reinterpret_cast<void*>(w & kAddrMask);
      }
      continue;
    }
    Span* s = e->span.load(std::memory_order_acquire);
    MutexLock lock(&s->mu);
    if (e->span.load(std::memory_order_acquire) != s) continue;
    bool add_partial = false;
    switch (s->state) {
      case SpanState::kEvicting: {
        // The bytes are still here: take the span back rather than wait for the evictor (which
        // may be waiting for this very scope).
        for (ObjectEntry* o : s->owner) {
          if (o != nullptr) o->word.fetch_and(~kEvacuating, std::memory_order_seq_cst);
        }
        s->state = SpanState::kLocal;
        eviction_cancels_.fetch_add(1, std::memory_order_relaxed);
        break;
      }
      case SpanState::kLocal:
        // A hot-object relocation was pending for this object: cancel it.
        e->word.fetch_and(~kEvacuating, std::memory_order_seq_cst);
        break;
      case SpanState::kWriting:
        s->cv.Wait(&s->mu, [&] {
          s->mu.AssertHeld();
          return s->state != SpanState::kWriting;
        });
        continue;
      case SpanState::kRemote: {
        Result<bool> gathered = MissLocked(s, e);
        if (!gathered) return Err(gathered.error());
        if (*gathered) continue;  // now local in its class's hot span
        // This very object may have failed authentication and moved to a kLost span.
        if (e->span.load(std::memory_order_acquire) != s) continue;
        add_partial = !s->free_slots.empty();
        break;
      }
      case SpanState::kLost:
        return Err(s->lost);
      case SpanState::kFree:
        return Err(Internal("deref of an object whose span was freed (use after free?)"));
    }
    if (s->sealed_left > 0) {
      // Encryption: the object's bytes are still ciphertext (only what is dereferenced is
      // opened, see heap.h).
      const uint32_t slot = e->slot.load(std::memory_order_relaxed);
      if (s->sealed[slot]) {
        FARMEM_RETURN_IF_ERROR(OpenSealedLocked(s, {&slot, 1}));
        // It may have failed authentication and moved to a kLost span.
        if (e->span.load(std::memory_order_acquire) != s) continue;
      }
    }
    if (mut) DropCopyLocked(s);
    const uint64_t now = e->word.fetch_or(bits, std::memory_order_seq_cst);
    lock.Unlock();
    if (add_partial) AddPartial(s);
    return reinterpret_cast<void*>(now & kAddrMask);
  }
}

Result<uint8_t*> Heap::ReadSpanLocked(Span* s, uint8_t* frame) {
  if (frame == nullptr) frame = GetFrame();
  IoContext* io = CheckoutIo();
  Status st = store_->ReadSpan(*io, s->set, s->member, frame);
  ReturnIo(io);
  if (!st.ok()) {
    PutFrame(frame);
    return Err(SwapInFailedLocked(s, st));
  }
  return frame;
}

Status Heap::SwapInLocked(Span* s, bool prefetch) {
  FARMEM_ASSIGN_OR_RETURN(uint8_t * frame, ReadSpanLocked(s));
  FinishSwapInLocked(s, frame, prefetch);
  return Status::Ok();
}

bool Heap::GatherOnMissLocked(Span* s) {
  const uint64_t now = miss_clock_.fetch_add(1, std::memory_order_relaxed) + 1;
  // Locality: the span was missed again within the last budget/8 misses (a scan, objects used
  // together): bring it whole, as the next misses would otherwise read it again and again.
  const bool recent =
      s->last_miss != 0 && now - s->last_miss <= std::max<size_t>(8, budget_frames_ / 8);
  s->last_miss = now;
  return options_.gather_on_miss && s->cls->slots >= kGatherMinSlots && !recent;
}

uint32_t Heap::SealedBytesOf(Span* s, const ObjectEntry* e) const {
  return crypto_ ? SpanCrypto::SealedBytes(e->size, s->cls->size) : e->size;
}

RemoteStore::Piece Heap::PieceOf(Span* s, ObjectEntry* e) const {
  return {e->slot.load(std::memory_order_relaxed) * s->cls->size, SealedBytesOf(s, e)};
}

Result<bool> Heap::MissLocked(Span* s, ObjectEntry* e) {
  if (!GatherOnMissLocked(s)) {
    FARMEM_RETURN_IF_ERROR(SwapInLocked(s, false));
    return false;
  }
  // Only the object's bytes: the rest of the cell would be thrown away.
  uint8_t* sealed = PieceScratch(s->cls->size);
  IoContext* io = CheckoutIo();
  Status st = store_->ReadSpan(*io, s->set, s->member, sealed, PieceOf(s, e));
  ReturnIo(io);
  if (!st.ok()) return Err(SwapInFailedLocked(s, st));
  return GatherLocked(s, e, sealed);
}

Result<bool> Heap::SwapInWholeLocked(Span* s) {
  FARMEM_ASSIGN_OR_RETURN(uint8_t * frame, ReadSpanLocked(s));
  FinishSwapInLocked(s, frame, false);
  return false;
}

// NO_THREAD_SAFETY_ANALYSIS: try-locks the size class and its hot span while s is held (the
// evictor's Relocate takes them in the other order, so waiting here could deadlock); the
// analysis cannot follow the hot span's SpanLock.
Result<bool> Heap::GatherLocked(Span* s, ObjectEntry* e,
                                const uint8_t* sealed) NO_THREAD_SAFETY_ANALYSIS {
  SizeClass* c = s->cls;
  const uint32_t slot = e->slot.load(std::memory_order_relaxed);
  const uint8_t* bytes = sealed;
  if (crypto_) {
    thread_local std::vector<uint8_t> plain;
    if (plain.size() < c->size) plain.resize(c->size);
    if (!crypto_->OpenObject(sealed, plain.data(), c->size, e)) {
      // The swap-in's way of answering a failed tag (from the other members) takes over; it
      // needs the whole cell.
      return SwapInWholeLocked(s);
    }
    bytes = plain.data();
  }
  Span* dst = nullptr;
  SpanLock dl;
  if (c->mu.TryLock()) {
    MutexLock cl(&c->mu, kAdoptLock);
    dst = HotSpanLocked(c, s, &dl, true);
  }
  if (dst == nullptr) return SwapInWholeLocked(s);
  (void)PlaceObjectLocked(dst, e, bytes, 0);
  dl.unlock();
  // The rest of s stays remote; its cell keeps e's old bytes in the slot, now free.
  s->owner[slot] = nullptr;
  s->free_slots.Put(slot);
  remote_object_bytes_.fetch_sub(c->size, std::memory_order_relaxed);
  if (s->live.fetch_sub(1, std::memory_order_relaxed) == 1) RetireRemoteLocked(s);
  swap_ins_.fetch_add(1, std::memory_order_relaxed);
  objects_gathered_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// NO_THREAD_SAFETY_ANALYSIS: holds a batch of span locks in an array across the batched read (as
// PrefetchLoop); the analysis cannot follow span locks held that way.
void Heap::FetchMany(std::span<ObjectEntry* const> entries) NO_THREAD_SAFETY_ANALYSIS {
  struct Want {
    Span* span;
    ObjectEntry* entry;
  };
  std::vector<Want> wants;
  wants.reserve(entries.size());
  for (ObjectEntry* e : entries) {
    // Present and not being moved: its deref is a few instructions.
    if (e == nullptr || (LoadWord(e) & (kPresent | kEvacuating)) == kPresent) continue;
    if (Span* s = e->span.load(std::memory_order_acquire); s != nullptr) wants.push_back({s, e});
  }
  // Span locks in address order (heap.h); the first of a round is waited for, the others only
  // tried (a busy one waits for a later round), so holding several can never deadlock. The same
  // object twice is wanted once.
  std::sort(wants.begin(), wants.end(), [](const Want& a, const Want& b) {
    if (a.span != b.span) return std::less<Span*>{}(a.span, b.span);
    return std::less<ObjectEntry*>{}(a.entry, b.entry);
  });
  wants.erase(std::unique(wants.begin(), wants.end(),
                          [](const Want& a, const Want& b) { return a.entry == b.entry; }),
              wants.end());
  // Whether e is, now, the object in its slot of s (s->mu held). The entries may be stale: the
  // caller need not hold anything that keeps its objects alive across this call
  // (far_hash_map::get_many holds no lock across its reads), and a freed entry, or one reused
  // since, can still point at s. Such an entry must not be gathered (that would move a slot it
  // does not own) nor count as wanted.
  auto owns = [](Span* s, ObjectEntry* e) {
    s->mu.AssertHeld();
    if (e->span.load(std::memory_order_acquire) != s) return false;
    const uint32_t slot = e->slot.load(std::memory_order_relaxed);
    return slot < s->owner.size() && s->owner[slot] == e;
  };
  // The wanted objects of a local span, as their derefs would leave them: opened (a swap-in
  // leaves every object sealed until its first deref), a relocation pending for one called off,
  // and hot, so that the evictor's next sweep leaves them for the caller, which may deref them
  // in a later scope. A tag that fails is left to the deref to report.
  auto ready = [&](Span* s, const Want* first, const Want* last) {
    s->mu.AssertHeld();
    if (s->state != SpanState::kLocal) return;
    if (s->sealed_left > 0) {
      std::vector<uint32_t> slots;
      for (const Want* w = first; w != last; ++w) {
        const uint32_t slot = w->entry->slot.load(std::memory_order_relaxed);
        if (owns(s, w->entry) && s->sealed[slot]) slots.push_back(slot);
      }
      if (!slots.empty()) (void)OpenSealedLocked(s, slots);
    }
    for (const Want* w = first; w != last; ++w) {
      if (!owns(s, w->entry)) continue;
      w->entry->word.fetch_and(~kEvacuating, std::memory_order_seq_cst);
      w->entry->word.fetch_or(kHot, std::memory_order_seq_cst);
    }
  };
  // The wants of each span: [first, second) in `wants`. A round locks the first span pending
  // (waiting for it, and for its write-out) and tries the next ones, up to kMaxReadRound; a span
  // busy or being written out waits for a later round, where it may come first. So every round
  // settles at least one span, and none is left to its deref merely for being busy.
  std::vector<std::pair<size_t, size_t>> pending, later;
  for (size_t i = 0; i < wants.size();) {
    size_t end = i;
    while (end < wants.size() && wants[end].span == wants[i].span) ++end;
    pending.emplace_back(i, end);
    i = end;
  }
  while (!pending.empty()) {
    Span* spans[kMaxReadRound];
    SpanLock locks[kMaxReadRound];
    ObjectEntry* gather[kMaxReadRound];  // the one object to gather, or null: swap in whole
    const Want* first[kMaxReadRound];    // the span's wants: [first, last)
    const Want* last[kMaxReadRound];
    uint8_t* frames[kMaxReadRound];
    SpanSet* sets[kMaxReadRound];
    int members[kMaxReadRound];
    RemoteStore::Piece pieces[kMaxReadRound];
    Status results[kMaxReadRound];
    size_t scratch_at[kMaxReadRound];  // a gathering read's place in the round's PieceScratch
    size_t scratch_bytes = 0;
    size_t n = 0;
    later.clear();
    for (const auto& [begin, end] : pending) {
      Span* s = wants[begin].span;
      const Want* from = wants.data() + begin;
      const Want* to = wants.data() + end;
      if (n == static_cast<size_t>(kMaxReadRound)) {
        later.emplace_back(begin, end);
        continue;
      }
      SpanLock lock = n == 0 ? SpanLock(&s->mu) : SpanLock(&s->mu, std::try_to_lock);
      if (!lock.owns_lock()) {
        later.emplace_back(begin, end);
        continue;
      }
      if (n == 0) {
        // Waited for through its write-out too, as its deref would be (the writer does not wait
        // for scopes, so this cannot deadlock); no other span lock is held here.
        s->cv.Wait(&s->mu, [&] {
          s->mu.AssertHeld();
          return s->state != SpanState::kWriting;
        });
      } else if (s->state == SpanState::kWriting) {
        later.emplace_back(begin, end);
        continue;
      }
      ObjectEntry* only = nullptr;
      size_t missing = 0;
      for (const Want* w = from; w != to; ++w) {
        if (!owns(s, w->entry)) continue;  // moved or freed meanwhile
        only = w->entry;
        ++missing;
      }
      if (missing == 0) continue;
      if (s->state == SpanState::kEvicting) {
        // The bytes are still here: take the span back, as a deref would.
        for (ObjectEntry* o : s->owner) {
          if (o != nullptr) o->word.fetch_and(~kEvacuating, std::memory_order_seq_cst);
        }
        s->state = SpanState::kLocal;
        eviction_cancels_.fetch_add(1, std::memory_order_relaxed);
      }
      if (s->state == SpanState::kLocal) {
        ready(s, from, to);  // no read: what the derefs would do here
        continue;
      }
      if (s->state != SpanState::kRemote) continue;  // written out (busy), lost: left to the deref
      // Several objects of one span wanted together: that is locality, read it whole.
      const bool gathers = GatherOnMissLocked(s) && missing == 1;
      spans[n] = s;
      gather[n] = gathers ? only : nullptr;
      first[n] = from;
      last[n] = to;
      sets[n] = s->set;
      members[n] = s->member;
      if (gathers) {
        // Only the object's bytes, into the round's scratch area (one slot each, so that
        // GatherLocked can copy the whole slot as it copies any object), not a whole frame.
        pieces[n] = PieceOf(s, only);
        frames[n] = nullptr;
        scratch_at[n] = scratch_bytes;
        scratch_bytes += (s->cls->size + 63) & ~size_t{63};
      } else {
        pieces[n] = RemoteStore::Piece{0, span_size_};
        frames[n] = GetFrame();
      }
      locks[n++] = std::move(lock);
    }
    pending.swap(later);
    if (n == 0) continue;
    if (scratch_bytes > 0) {
      uint8_t* area = PieceScratch(scratch_bytes);
      for (size_t i = 0; i < n; ++i) {
        if (gather[i] != nullptr) frames[i] = area + scratch_at[i];
      }
    }
    IoContext* io = CheckoutIo();
    store_->ReadSpans(*io, {sets, n}, {members, n}, {frames, n}, {results, n}, {pieces, n});
    ReturnIo(io);
    bool partial[kMaxReadRound] = {};
    for (size_t i = 0; i < n; ++i) {
      Span* s = spans[i];
      if (!results[i].ok()) {
        if (gather[i] == nullptr) PutFrame(frames[i]);
        (void)SwapInFailedLocked(s, results[i]);  // its deref reads again and reports it
      } else if (gather[i] != nullptr) {
        // An error here marked s lost or left it remote: the deref reports it. False: the read
        // became a whole swap-in (the hot span was busy, or a tag failed).
        Result<bool> g = GatherLocked(s, gather[i], frames[i]);
        if (g && !*g) ready(s, first[i], last[i]);
        partial[i] = g && !*g && !s->free_slots.empty();
      } else {
        FinishSwapInLocked(s, frames[i], false);
        ready(s, first[i], last[i]);
        partial[i] = !s->free_slots.empty();
      }
    }
    // Every span lock of the batch goes before any class lock is taken: Allocate takes a class
    // lock and then span locks, so taking one while holding the batch's could deadlock.
    for (size_t i = 0; i < n; ++i) locks[i].unlock();
    for (size_t i = 0; i < n; ++i) {
      if (partial[i]) AddPartial(spans[i]);
    }
  }
}

Status Heap::OpenSealedLocked(Span* s, std::span<const uint32_t> slots) {
  const uint32_t csize = s->cls->size;
  // Opened out of place, so that the ciphertext of a slot whose tag fails stays in the frame.
  thread_local std::vector<uint8_t> plain;
  if (plain.size() < span_size_) plain.resize(span_size_);
  std::vector<uint32_t> failed;
  crypto_->OpenSlots(s->frame, plain.data(), csize, s->owner, slots, &failed);
  MarkOpenedLocked(s, slots, failed, plain.data());
  if (failed.empty()) return Status::Ok();
  // A failed tag means the cell's bytes are not what this process sealed: corrupted (a bit flip
  // in the lender's memory) or tampered with. Treat the member like a failed one.
  auth_failures_.fetch_add(1, std::memory_order_relaxed);
  auth_failed_objects_.fetch_add(failed.size(), std::memory_order_relaxed);
  SpanSet* set = s->set;
  const int member = s->member;
  const Status why = DataLoss(fmt::format(
      "{} of its objects failed authentication (AES-GCM tag) when read back from span set "
      "member {}: its bytes on the daemon were corrupted or tampered with",
      failed.size(), member));
  const bool reread = store_->ReportCorrupt(set, member, why);
  bool recovered = false;
  if (reread) {
    uint8_t* cell = GetFrame();
    IoContext* io = CheckoutIo();
    Status st = store_->ReadSpan(*io, set, member, cell);
    ReturnIo(io);
    if (st.ok()) {
      // Every slot still sealed came from the member just reported: take the others' bytes (the
      // ciphertext and, in the slot, the tag).
      for (uint32_t i = 0; i < s->sealed.size(); ++i) {
        if (!s->sealed[i]) continue;
        const size_t off = static_cast<size_t>(i) * csize;
        std::memcpy(s->frame + off, cell + off, SealedBytesOf(s, s->owner[i]));
      }
      PutFrame(cell);
      std::vector<uint32_t> again;
      crypto_->OpenSlots(s->frame, plain.data(), csize, s->owner, failed, &again);
      MarkOpenedLocked(s, failed, again, plain.data());
      recovered = again.empty();
      if (!recovered) {
        auth_failures_.fetch_add(1, std::memory_order_relaxed);
        failed = std::move(again);
      }
    } else {
      PutFrame(cell);
      // Unreadable for now: the failed slots stay sealed, a later deref reads them again.
      if (st.code() != StatusCode::kDataLoss) return st.WithContext(Describe(s));
    }
  }
  const int64_t now =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
          .count();
  int64_t last = last_auth_log_ms_.load(std::memory_order_relaxed);
  const bool log = now - last >= 5000 &&
                   last_auth_log_ms_.compare_exchange_strong(last, now, std::memory_order_relaxed);
  if (recovered) {
    if (log) {
      spdlog::error(
          "far memory: {}: {}; read it from the other members, the member is being "
          "re-protected ({} such cells so far; logged at most every 5 s)",
          Describe(s), why.message(), auth_failures_.load());
    }
    return Status::Ok();
  }
  auth_lost_objects_.fetch_add(failed.size(), std::memory_order_relaxed);
  const Status lost = DataLoss(
      fmt::format("{} is lost: {}{}; resilience {} has no other copy to read it from", Describe(s),
                  why.message(), reread ? " (and again when rebuilt from the other members)" : "",
                  res_.ToString()));
  if (log) {
    spdlog::error(
        "far memory: {} object(s) lost: {} ({} such cells so far; logged at most "
        "every 5 s)",
        failed.size(), lost.message(), auth_failures_.load());
  }
  // A span left with no object is released by the evictor's next sweep (PickVictims).
  LoseObjectsLocked(s, failed, lost);
  return Status::Ok();
}

void Heap::MarkOpenedLocked(Span* s, std::span<const uint32_t> slots,
                            const std::vector<uint32_t>& failed, const uint8_t* plain) {
  const uint32_t csize = s->cls->size;
  for (const uint32_t i : slots) {
    if (std::find(failed.begin(), failed.end(), i) != failed.end()) continue;
    ObjectEntry* o = s->owner[i];
    const size_t off = static_cast<size_t>(i) * csize;
    std::memcpy(s->frame + off, plain + off, o->size);
    s->sealed[i] = false;
    --s->sealed_left;
    // The word of a sealed object holds no address, only flags (kHot, kEvacuating).
    o->word.fetch_or(reinterpret_cast<uint64_t>(s->frame + off) | kPresent,
                     std::memory_order_seq_cst);
  }
}

Status Heap::OpenAllSealedLocked(Span* s) {
  std::vector<uint32_t> slots;
  slots.reserve(s->sealed_left);
  for (uint32_t i = 0; i < s->sealed.size(); ++i) {
    if (s->sealed[i]) slots.push_back(i);
  }
  return OpenSealedLocked(s, slots);
}

void Heap::LoseObjectsLocked(Span* s, std::span<const uint32_t> slots, const Status& why) {
  // A span of their own, kLost, so that each deref of them says why and frees retire it.
  Span* lost = NewSpan(s->cls, SpanState::kLost);
  MutexLock ll(&lost->mu);  // nobody else can reach it until the entries point to it
  lost->lost = why;
  lost->free_slots.Reset(s->cls->slots, false);
  const bool local = s->state == SpanState::kLocal || s->state == SpanState::kEvicting;
  for (uint32_t slot : slots) {
    if (s->sealed_left > 0 && s->sealed[slot]) {
      s->sealed[slot] = false;
      --s->sealed_left;
    }
    ObjectEntry* e = s->owner[slot];
    s->owner[slot] = nullptr;
    s->free_slots.Put(slot);
    s->live.fetch_sub(1, std::memory_order_relaxed);
    lost->owner[slot] = e;
    lost->live.fetch_add(1, std::memory_order_relaxed);
    e->word.store(0, std::memory_order_release);
    e->span.store(lost, std::memory_order_release);
  }
  remote_object_bytes_.fetch_sub(static_cast<uint64_t>(slots.size()) * s->cls->size,
                                 std::memory_order_relaxed);
  if (local && s->set != nullptr) {  // they were counted as the local span's clean copy too
    copy_object_bytes_.fetch_sub(static_cast<uint64_t>(slots.size()) * s->cls->size,
                                 std::memory_order_relaxed);
  }
  spans_lost_.fetch_add(1, std::memory_order_relaxed);
}

Result<std::vector<ObjectPlace>> Heap::Locate(ObjectEntry* e) {
  for (;;) {
    Span* s = e->span.load(std::memory_order_acquire);
    MutexLock lock(&s->mu);
    if (e->span.load(std::memory_order_acquire) != s) continue;
    if (s->set == nullptr) return Err(NotFound("the object has no remote cell"));
    const uint64_t slot_off =
        static_cast<uint64_t>(e->slot.load(std::memory_order_relaxed)) * s->cls->size;
    std::vector<ObjectPlace> out;
    for (auto& [lease, off] : store_->CellPlaces(s->set, s->member)) {
      out.push_back({lease, off + slot_off, e->size, SealedBytesOf(s, e)});
    }
    return out;
  }
}

Result<std::vector<ObjectPlace>> LocateObjectForTest(ObjectEntry* e) {
  return e->span.load(std::memory_order_acquire)->heap->Locate(e);
}

Status Heap::SwapInFailedLocked(Span* s, Status st) {
  st = Status(st.code(), fmt::format("{} {}: {}", Describe(s),
                                     st.code() == StatusCode::kDataLoss ? "is lost" : "unreadable",
                                     st.message()));
  if (st.code() == StatusCode::kDataLoss) MarkLostLocked(s, st);
  return st;
}

void Heap::FinishSwapInLocked(Span* s, uint8_t* frame, bool prefetch) {
  s->frame = frame;
  s->state = SpanState::kLocal;
  const uint32_t csize = s->cls->size;
  uint32_t live = 0;
  // Encryption: every object stays sealed until its first deref (heap.h, kLocal).
  const bool sealed = crypto_ != nullptr;
  if (sealed) s->sealed.assign(s->owner.size(), false);
  for (uint32_t i = 0; i < s->owner.size(); ++i) {
    if (ObjectEntry* o = s->owner[i]; o != nullptr) {
      // A prefetched span counts as hot for one CLOCK sweep, so the evictor does not take it
      // back before the scan that asked for it arrives.
      const uint64_t hot = prefetch ? kHot : 0;
      if (sealed) {
        s->sealed[i] = true;
        o->word.store(hot, std::memory_order_release);
      } else {
        o->word.store(
            reinterpret_cast<uint64_t>(frame + static_cast<size_t>(i) * csize) | kPresent | hot,
            std::memory_order_release);
      }
      ++live;
    }
  }
  s->sealed_left = sealed ? live : 0;
  // The remote cell stays as the span's clean copy (remote_object_bytes_ keeps counting it):
  // evicting the span again before anything in it is written costs no I/O.
  AddResident(s);
  remote_spans_.fetch_sub(1, std::memory_order_relaxed);
  copy_object_bytes_.fetch_add(static_cast<uint64_t>(live) * csize, std::memory_order_relaxed);
  swap_ins_.fetch_add(1, std::memory_order_relaxed);
  if (prefetch) prefetches_.fetch_add(1, std::memory_order_relaxed);
}

// ---------------------------------------------------------------------------------------------
// Prefetch

void Heap::Prefetch(ObjectEntry* e) {
  if (prefetchers_.empty()) return;
  {
    MutexLock lock(&prefetch_mu_);
    if (prefetch_queue_.size() >= 256) return;  // behind: drop hints rather than queue forever
    prefetch_queue_.push_back(e);
  }
  prefetch_cv_.Signal();
}

// NO_THREAD_SAFETY_ANALYSIS: holds a batch of span locks in an array across the batched read; the
// analysis cannot follow span locks held that way.
void Heap::PrefetchLoop() NO_THREAD_SAFETY_ANALYSIS {
  // Hints are taken in batches; the spans they name are read together (one doorbell per daemon,
  // round trips overlapping), so a scan's prefetch keeps several reads in flight.
  constexpr size_t kBatch = 8;
  std::vector<ObjectEntry*> hints;
  for (;;) {
    hints.clear();
    {
      MutexLock lock(&prefetch_mu_);
      prefetch_cv_.Wait(&prefetch_mu_, [&] {
        prefetch_mu_.AssertHeld();
        MutexLock el(&evict_mu_);
        return stopping_ || !prefetch_queue_.empty();
      });
      {
        MutexLock el(&evict_mu_);
        if (stopping_) return;
      }
      while (!prefetch_queue_.empty() && hints.size() < 4 * kBatch) {
        hints.push_back(prefetch_queue_.front());
        prefetch_queue_.pop_front();
      }
    }
    size_t next = 0;
    while (next < hints.size()) {
      // The entries may have been freed (and even reused) since the hint: every step re-checks
      // under the span lock, and a stale hint at worst swaps in a span someone else wanted.
      Span* spans[kBatch];
      SpanLock locks[kBatch];
      uint8_t* frames[kBatch];
      SpanSet* sets[kBatch];
      int members[kBatch];
      Status results[kBatch];
      size_t n = 0;
      for (; next < hints.size() && n < kBatch; ++next) {
        ObjectEntry* e = hints[next];
        if ((LoadWord(e) & kPresent) != 0) continue;
        Span* s = e->span.load(std::memory_order_acquire);
        if (s == nullptr || std::find(spans, spans + n, s) != spans + n) continue;
        // try_lock: this thread holds other span locks; whoever holds this one is using it.
        SpanLock lock(&s->mu, std::try_to_lock);
        if (!lock.owns_lock() || s->state != SpanState::kRemote) continue;
        if (frames_in_use_.load(std::memory_order_relaxed) + 1 >= prefetch_frames_) break;  // full
        spans[n] = s;
        sets[n] = s->set;
        members[n] = s->member;
        frames[n] = GetFrame();
        locks[n++] = std::move(lock);
      }
      if (n == 0) {
        if (next < hints.size() &&
            frames_in_use_.load(std::memory_order_relaxed) + 1 >= prefetch_frames_) {
          break;  // no room for the rest of this batch
        }
        continue;
      }
      IoContext* io = CheckoutIo();
      store_->ReadSpans(*io, {sets, n}, {members, n}, {frames, n}, {results, n});
      bool partial[kMaxSetWidth] = {};
      for (size_t i = 0; i < n; ++i) {
        Span* s = spans[i];
        Status st = results[i];
        if (st.ok()) {
          FinishSwapInLocked(s, frames[i], true);
          // A prefetch opens the whole span here, off the scan's path (what a miss leaves to
          // each first deref). A re-read that fails for now leaves those objects sealed: their
          // derefs try again.
          if (s->sealed_left > 0) (void)OpenAllSealedLocked(s);
          partial[i] = !s->free_slots.empty();
        } else {
          PutFrame(frames[i]);
          (void)SwapInFailedLocked(s, st);  // a deref reports it
        }
      }
      // As in FetchMany: the batch's span locks all go before AddPartial takes a class lock.
      for (size_t i = 0; i < n; ++i) locks[i].unlock();
      for (size_t i = 0; i < n; ++i) {
        if (partial[i]) AddPartial(spans[i]);
      }
      ReturnIo(io);
    }
  }
}

}  // namespace farmem::farptr_internal
