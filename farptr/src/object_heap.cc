// Object paths, the local side: allocate, free; frames, entries and span bookkeeping. The deref
// miss (swap-in) and prefetch are in object_swap_in.cc.
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "farmem/internal/budget_gate.h"
#include "heap.h"

namespace farmem::farptr_internal {

namespace {
constexpr size_t kFrameChunk = 1u << 20;  // frames are mapped this many bytes at a time
}  // namespace

// ---------------------------------------------------------------------------------------------
// Entry points used by far_ptr.h

Result<void*> DerefSlow(ObjectEntry* e, bool mut) {
  if (e == nullptr) return Err(InvalidArgument("deref of a null far_ptr"));
  return e->span.load(std::memory_order_acquire)->heap->Deref(e, mut);
}

void* DerefOrDie(ObjectEntry* e, bool mut) {
  Result<void*> r = DerefSlow(e, mut);
  if (!r) {
    spdlog::critical("far memory: deref failed: {}", r.error().ToString());
    std::fprintf(stderr, "far memory: deref failed: %s\n", r.error().ToString().c_str());
    std::abort();
  }
  return *r;
}

ObjectEntry* AllocateObject(Runtime* rt, size_t size, void** addr) {
  if (rt == nullptr) {
    std::fprintf(stderr, "far memory: make_far without a runtime (create a farmem::Runtime)\n");
    std::abort();
  }
  return rt->heap()->Allocate(size, addr);
}

void FreeObject(ObjectEntry* e) { e->span.load(std::memory_order_acquire)->heap->Free(e); }

void PrefetchObject(ObjectEntry* e) { e->span.load(std::memory_order_acquire)->heap->Prefetch(e); }

void FetchObjects(Runtime* rt, std::span<ObjectEntry* const> entries) {
  rt->heap()->FetchMany(entries);
}

Runtime* RuntimeOf(const ObjectEntry* e) {
  return e->span.load(std::memory_order_acquire)->heap->runtime();
}

// ---------------------------------------------------------------------------------------------
// Frames, entries, I/O contexts

uint8_t* Heap::GetFrame() {
  uint8_t* f = nullptr;
  {
    MutexLock lock(&frames_mu_);
    if (warm_frames_.empty() && cold_frames_.empty()) {
      // A new chunk of frames (span_size divides kFrameChunk, or the chunk is one frame).
      const size_t len = std::max<size_t>(kFrameChunk, span_size_);
      void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) {
        std::fprintf(stderr, "far memory: out of local memory for %zu bytes of span frames\n", len);
        std::abort();
      }
      frame_chunks_.emplace_back(p, len);
      for (size_t off = len; off >= span_size_; off -= span_size_) {
        cold_frames_.push_back(static_cast<uint8_t*>(p) + off - span_size_);
      }
    }
    std::vector<uint8_t*>& from = warm_frames_.empty() ? cold_frames_ : warm_frames_;
    f = from.back();
    from.pop_back();
  }
  const size_t used = frames_in_use_.fetch_add(1, std::memory_order_acq_rel) + 1;
  if (used > budget_frames_ && !eviction_stalled_.load(std::memory_order_relaxed)) {
    SetOverBudget(this, over_budget_, true);
  }
  if (used > high_frames_) {
    MutexLock lock(&evict_mu_);
    if (!evict_wanted_) {
      evict_wanted_ = true;
      evict_cv_.Signal();
    }
  }
  return f;
}

void Heap::PutFrame(uint8_t* f) {
  bool cold = false;
  {
    MutexLock lock(&frames_mu_);
    if (warm_frames_.size() < warm_limit_) {
      warm_frames_.push_back(f);
    } else {
      cold = true;
    }
  }
  if (cold) {
    // Its pages go back to the kernel now (they read as zeros when next touched); the frame
    // stays in the pool.
    (void)::madvise(f, span_size_, MADV_DONTNEED);
    MutexLock lock(&frames_mu_);
    cold_frames_.push_back(f);
  }
  frames_in_use_.fetch_sub(1, std::memory_order_acq_rel);
  RecheckOverBudget();
}

void Heap::RecheckOverBudget() {
  if (frames_in_use_.load(std::memory_order_seq_cst) <= budget_frames_ &&
      over_budget_.load(std::memory_order_acquire)) {
    SetOverBudget(this, over_budget_, false);
  }
}

void Heap::SetOverBudgetForTest() { SetOverBudget(this, over_budget_, true); }

bool OverBudgetForTest(ObjectEntry* e) {
  return e->span.load(std::memory_order_acquire)->heap->OverBudgetForTest();
}

void SetOverBudgetForTest(ObjectEntry* e) {
  e->span.load(std::memory_order_acquire)->heap->SetOverBudgetForTest();
}

ObjectEntry* Heap::NewEntry() {
  MutexLock lock(&entries_mu_);
  if (free_entries_.empty()) {
    entry_chunks_.push_back(std::make_unique<ObjectEntry[]>(kEntriesPerChunk));
    entry_bytes_.fetch_add(kEntriesPerChunk * sizeof(ObjectEntry), std::memory_order_relaxed);
    UpdateFrameLimits();
    ObjectEntry* chunk = entry_chunks_.back().get();
    for (size_t i = kEntriesPerChunk; i-- > 0;) free_entries_.push_back(&chunk[i]);
  }
  ObjectEntry* e = free_entries_.back();
  free_entries_.pop_back();
  return e;
}

void Heap::DeleteEntry(ObjectEntry* e) {
  MutexLock lock(&entries_mu_);
  free_entries_.push_back(e);
}

IoContext* Heap::CheckoutIo() {
  MutexLock lock(&io_mu_);
  if (io_free_.empty()) {
    io_all_.push_back(store_->NewIoContext());
    return io_all_.back().get();
  }
  IoContext* io = io_free_.back();
  io_free_.pop_back();
  return io;
}

void Heap::ReturnIo(IoContext* io) {
  bytes_read_.fetch_add(std::exchange(io->bytes_read, 0), std::memory_order_relaxed);
  bytes_written_.fetch_add(std::exchange(io->bytes_written, 0), std::memory_order_relaxed);
  MutexLock lock(&io_mu_);
  io_free_.push_back(io);
}

// ---------------------------------------------------------------------------------------------
// Spans

SizeClass* Heap::ClassFor(size_t size) {
  if (size > span_size_) return nullptr;
  return classes_[class_of_[(size + 15) / 16]].get();
}

SizeClass* Heap::ClassForObject(size_t size) {
  SizeClass* c = ClassFor(size);
  if (c == nullptr || crypto_ == nullptr || SpanCrypto::TagInSlot(size, c->size)) return c;
  SizeClass* t = ClassFor(size + aead::kTagBytes);
  return t != nullptr && t->size <= c->size + c->size / 4 ? t : c;
}

// NO_THREAD_SAFETY_ANALYSIS: the new span's lock is a SpanLock (try first, see below).
Span* Heap::NewSpan(SizeClass* cls, SpanState state) NO_THREAD_SAFETY_ANALYSIS {
  // Only a free span whose lock is free is reused: a retired span can still be locked by the
  // thread that retired it, which may be this one (FetchMany holds every span of a round until
  // the round is done, and gathering one span's last object retires it; a later gather of the
  // round that starts a hot span would then wait for itself), or briefly by another thread that
  // checks a stale entry against it. Trying under free_mu cannot deadlock (it never waits).
  Span* s = nullptr;
  SpanLock sl;
  {
    MutexLock lock(&cls->free_mu);
    for (size_t i = cls->free_spans.size(); i-- > 0;) {
      SpanLock tried(&cls->free_spans[i]->mu, std::try_to_lock);
      if (!tried.owns_lock()) continue;
      s = cls->free_spans[i];
      cls->free_spans.erase(cls->free_spans.begin() + static_cast<long>(i));
      sl = std::move(tried);
      break;
    }
  }
  if (s == nullptr) {
    auto fresh = std::make_unique<Span>();
    fresh->heap = this;
    fresh->cls = cls;
    MutexLock lock(&spans_mu_);
    spans_.push_back(std::move(fresh));
    s = spans_.back().get();
    span_structs_.fetch_add(1, std::memory_order_relaxed);
  }
  // A fresh span is in nobody's hands (a miss that gathers an object makes its hot span while
  // holding another span's lock: HotSpanLocked), so this never waits.
  if (!sl.owns_lock()) sl = SpanLock(&s->mu, std::try_to_lock);
  if (!sl.owns_lock()) sl = SpanLock(&s->mu);
  s->id = next_span_id_.fetch_add(1, std::memory_order_relaxed);
  s->state = state;
  s->frame = nullptr;
  s->set = nullptr;
  s->member = -1;
  s->lost = Status::Ok();
  s->sealed.clear();
  s->sealed_left = 0;
  s->last_miss = 0;
  s->live.store(0, std::memory_order_relaxed);
  s->owner.assign(cls->slots, nullptr);
  slot_table_bytes_.fetch_add(SlotTableBytes(cls), std::memory_order_relaxed);
  UpdateFrameLimits();
  s->free_slots.Reset(cls->slots, true);
  return s;
}

void Heap::MarkLostLocked(Span* s, const Status& why) {
  s->state = SpanState::kLost;
  s->lost = why;
  store_->Release(s->set, s->member);
  s->set = nullptr;
  spans_lost_.fetch_add(1, std::memory_order_relaxed);
  remote_spans_.fetch_sub(1, std::memory_order_relaxed);
  remote_object_bytes_.fetch_sub(
      static_cast<uint64_t>(s->live.load(std::memory_order_relaxed)) * s->cls->size,
      std::memory_order_relaxed);
  spdlog::debug("far memory: {}", why.ToString());
}

void Heap::RetireLocked(Span* s) {
  s->state = SpanState::kFree;
  s->set = nullptr;
  s->member = -1;
  s->sealed.clear();
  s->sealed_left = 0;
  s->owner.clear();
  s->owner.shrink_to_fit();
  s->free_slots.Release();
  slot_table_bytes_.fetch_sub(SlotTableBytes(s->cls), std::memory_order_relaxed);
  UpdateFrameLimits();
  s->cv.SignalAll();
  MutexLock lock(&s->cls->free_mu);
  s->cls->free_spans.push_back(s);
}

void Heap::RetireRemoteLocked(Span* s) {
  store_->Release(s->set, s->member);
  RetireLocked(s);
  remote_spans_.fetch_sub(1, std::memory_order_relaxed);
}

void Heap::AddResident(Span* s) {
  MutexLock lock(&resident_mu_);
  s->resident_index = static_cast<int64_t>(resident_.size());
  resident_.push_back(s);
  resident_spans_.fetch_add(1, std::memory_order_relaxed);
}

void Heap::RemoveResident(Span* s) {
  MutexLock lock(&resident_mu_);
  if (s->resident_index < 0) return;
  const size_t i = static_cast<size_t>(s->resident_index);
  resident_[i] = resident_.back();
  resident_[i]->resident_index = static_cast<int64_t>(i);
  resident_.pop_back();
  s->resident_index = -1;
  resident_spans_.fetch_sub(1, std::memory_order_relaxed);
}

void Heap::AddPartial(Span* s) {
  SizeClass* c = s->cls;
  MutexLock lock(&c->mu);
  if (!s->in_partial) {
    s->in_partial = true;
    c->partial.push_back(s);
  }
}

void Heap::ReleaseLocalLocked(Span* s) {
  DropCopyLocked(s);
  PutFrame(s->frame);
  s->frame = nullptr;
  RemoveResident(s);
  RetireLocked(s);
}

void Heap::DropCopyLocked(Span* s) {
  if (s->set == nullptr) return;
  if (s->sealed_left > 0) {
    // The cell is the only place a failed tag can be answered from: open everything first.
    if (Status st = OpenAllSealedLocked(s); !st.ok()) {
      // The cell could not be read again to answer a failed tag, and it goes now: what failed
      // goes with it.
      std::vector<uint32_t> left;
      for (uint32_t i = 0; i < s->sealed.size(); ++i) {
        if (s->sealed[i]) left.push_back(i);
      }
      auth_lost_objects_.fetch_add(left.size(), std::memory_order_relaxed);
      LoseObjectsLocked(
          s, left,
          DataLoss(fmt::format("{}: {} object(s) failed authentication and could not be read "
                               "again from the other members before the cell was given up: {}",
                               Describe(s), left.size(), st.message())));
    }
  }
  const uint64_t bytes =
      static_cast<uint64_t>(s->live.load(std::memory_order_relaxed)) * s->cls->size;
  store_->Release(s->set, s->member);
  s->set = nullptr;
  s->member = -1;
  remote_object_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
  copy_object_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
  copies_dropped_.fetch_add(1, std::memory_order_relaxed);
}

std::string Heap::Describe(Span* s) {
  return fmt::format("span {} (size class {} B, {} live objects)", s->id, s->cls->size,
                     s->live.load(std::memory_order_relaxed));
}

// ---------------------------------------------------------------------------------------------
// Allocate / free

// NO_THREAD_SAFETY_ANALYSIS: keeps the span it picked locked out of the search loop
// (SpanLock::release) and unlocks it by hand; the analysis cannot follow span locks held that way.
ObjectEntry* Heap::Allocate(size_t size, void** addr) NO_THREAD_SAFETY_ANALYSIS {
  SizeClass* cls = ClassForObject(size);
  if (cls == nullptr) {
    std::fprintf(stderr, "far memory: object of %zu bytes exceeds the span size %u\n", size,
                 span_size_);
    std::abort();
  }
  ObjectEntry* e = NewEntry();
  e->size = static_cast<uint32_t>(size);
  MutexLock clock(&cls->mu);
  Span* s = nullptr;
  while (!cls->partial.empty()) {
    Span* cand = cls->partial.back();
    SpanLock sl(&cand->mu);
    if (cand->state == SpanState::kLocal && !cand->free_slots.empty()) {
      s = cand;
      sl.release();
      break;
    }
    sl.unlock();
    cls->partial.pop_back();
    cand->in_partial = false;
  }
  if (s == nullptr) {
    s = NewSpan(cls, SpanState::kLocal);
    s->mu.Lock();
    s->frame = GetFrame();
    AddResident(s);
    s->in_partial = true;
    cls->partial.push_back(s);
  }
  DropCopyLocked(s);  // the new object is written into the frame
  const uint32_t slot = s->free_slots.Take();
  s->owner[slot] = e;
  s->live.fetch_add(1, std::memory_order_relaxed);
  uint8_t* p = s->frame + static_cast<size_t>(slot) * cls->size;
  e->slot.store(slot, std::memory_order_relaxed);
  e->span.store(s, std::memory_order_release);
  e->word.store(reinterpret_cast<uint64_t>(p) | kPresent | kHot | kDirty,
                std::memory_order_release);
  if (s->free_slots.empty() && cls->partial.back() == s) {
    cls->partial.pop_back();
    s->in_partial = false;
  }
  s->mu.Unlock();
  clock.Unlock();
  objects_.fetch_add(1, std::memory_order_relaxed);
  object_bytes_.fetch_add(cls->size, std::memory_order_relaxed);
  *addr = p;
  return e;
}

// NO_THREAD_SAFETY_ANALYSIS: locks the entry's span through a pointer re-checked after locking (the
// span may change); the analysis cannot follow span locks held that way.
void Heap::Free(ObjectEntry* e) NO_THREAD_SAFETY_ANALYSIS {
  Span* s = nullptr;
  SpanLock lock;
  for (;;) {
    s = e->span.load(std::memory_order_acquire);
    lock = SpanLock(&s->mu);
    if (e->span.load(std::memory_order_acquire) == s) break;
    lock.unlock();
  }
  const uint32_t slot = e->slot.load(std::memory_order_relaxed);
  const uint32_t csize = s->cls->size;
  if (s->sealed_left > 0 && s->sealed[slot]) {
    s->sealed[slot] = false;
    --s->sealed_left;
  }
  s->owner[slot] = nullptr;
  s->free_slots.Put(slot);
  const uint32_t live = s->live.fetch_sub(1, std::memory_order_relaxed) - 1;
  e->word.store(0, std::memory_order_release);
  bool add_partial = false;
  if (s->set != nullptr && (s->state == SpanState::kLocal || s->state == SpanState::kEvicting)) {
    remote_object_bytes_.fetch_sub(csize, std::memory_order_relaxed);  // its clean copy
    copy_object_bytes_.fetch_sub(csize, std::memory_order_relaxed);
  }
  switch (s->state) {
    case SpanState::kLocal:
      if (live == 0) {
        ReleaseLocalLocked(s);
      } else {
        add_partial = true;
      }
      break;
    case SpanState::kEvicting:
    case SpanState::kWriting:
      break;  // the evictor notices an empty span
    case SpanState::kRemote:
      remote_object_bytes_.fetch_sub(csize, std::memory_order_relaxed);
      if (live == 0) RetireRemoteLocked(s);
      break;
    case SpanState::kLost:
      if (live == 0) RetireLocked(s);
      break;
    case SpanState::kFree:
      break;
  }
  lock.unlock();
  if (add_partial) AddPartial(s);
  objects_.fetch_sub(1, std::memory_order_relaxed);
  object_bytes_.fetch_sub(csize, std::memory_order_relaxed);
  if (crypto_ && !SpanCrypto::TagInSlot(e->size, csize)) crypto_->Forget(e);
  DeleteEntry(e);
}

}  // namespace farmem::farptr_internal
