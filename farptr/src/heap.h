// Heap: the implementation behind farmem::Runtime — size-class spans, the local frame budget,
// object entries, swap-in, the evictor and the compactor.
//
// Spans. Every object lives in a span: span_size bytes cut into slots of one size class. A span
// is in one of these states (Span::state, guarded by Span::mu):
//
//   kLocal     its frame is resident; objects have kPresent words (but see *sealed* below). A
//              span swapped in keeps its
//              remote cell (set/member stay set) while it is clean: evicting it again then costs
//              no write at all. The first write (deref_mut, a new object in it, a relocation
//              into it) or the compactor wanting its row turns the cell into a hole (DropCopy).
//              Invariant: a kLocal/kEvicting span with `set` has no object word with kDirty.
//              Encryption opens lazily: a miss authenticates and decrypts only the object
//              dereferenced (a prefetch opens all); the others stay *sealed* (Span::sealed):
//              their slots in the frame hold the ciphertext read from the cell and their words
//              no kPresent, until their first deref opens them. Only a span with its cell has
//              sealed slots: DropCopyLocked opens them all first, so a tag that fails can still
//              be answered from the cell's other members, and nothing sealed is written out.
//   kEvicting  picked by the evictor; every object's word has kEvacuating; the evictor waits for
//              scopes open at that moment to end. A deref in this state cancels the eviction
//              (the bytes are still here), so no mutator ever waits for the evictor here
//   kWriting   committed: the span is being written out as part of a span set; derefs wait on
//              Span::cv (the evictor does no more waiting on scopes, so this cannot deadlock)
//   kRemote    lives in cell `member` of span set `set`; object words are 0
//   kLost      its data cannot be produced; `lost` says why
//   kFree      no live object; the struct is kept (never reused) so stale pointers stay safe
//
// Locks, in the order they may be taken:
//   SizeClass::mu  ->  Span::mu (of one span, or of several in address order)  ->
//   RemoteStore::mu_ / resident_mu_ / frames_mu_ / entries_mu_ / io_mu_ / spans_mu_ (leaves)
// An entry's `span`/`slot` change only while the lock of the span it points to is held, so a
// reader locks entry->span and checks it is still the entry's span.
//
// Threads: mutators (any thread, inside DerefScopes) take the slow paths here; the evictor thread
// sweeps, evicts, relocates hot objects and compacts; prefetch threads swap spans in ahead of
// far_vector scans; the RemoteStore's recovery thread re-protects failed members.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>  // std::try_to_lock
#include <thread>
#include <utility>
#include <vector>

#include "farmem/client/cluster.h"
#include "farmem/common/mutex.h"
#include "farmem/internal/free_slots.h"
#include "farmem/internal/object.h"
#include "farmem/internal/seal_observer.h"
#include "farmem/runtime.h"
#include "farmem/spanstore/remote_store.h"
#include "span_crypto.h"

namespace farmem::farptr_internal {

class Heap;
struct SizeClass;

// The span-set store (farmem::spanstore, shared with farmem-nbd's stripe layout) under the names
// far_ptr has always used for it.
using spanstore::Group;
using spanstore::IoContext;
using spanstore::kMaxReadRound;
using spanstore::kMaxSetWidth;
using spanstore::NodeGone;
using spanstore::RemoteStore;
using spanstore::RemoteStoreStats;
using spanstore::SpanOwner;
using spanstore::SpanSet;
using spanstore::Vacant;

enum class SpanState : uint8_t { kLocal, kEvicting, kWriting, kRemote, kLost, kFree };

struct Span : SpanOwner {  // the owner RemoteStore keeps of the span's cell (Owners, SpanOf)
  Heap* heap = nullptr;
  SizeClass* cls = nullptr;
  uint64_t id = 0;
  Mutex mu;
  CondVar cv;  // state left kWriting
  SpanState state GUARDED_BY(mu) = SpanState::kFree;
  uint8_t* frame GUARDED_BY(mu) = nullptr;
  std::vector<ObjectEntry*> owner GUARDED_BY(mu);  // slot -> entry; null = free slot
  FreeSlots free_slots GUARDED_BY(mu);
  std::atomic<uint32_t> live{0};  // written under mu; read racily by stats and the compactor
  SpanSet* set GUARDED_BY(mu) = nullptr;
  int member GUARDED_BY(mu) = -1;
  // CRC-32C of the whole cell as written (valid while `set` is): compaction checks each cell it
  // moves against it, so a corrupted one is repaired before it moves (compactor.cc).
  uint32_t cell_crc GUARDED_BY(mu) = 0;
  Status lost GUARDED_BY(mu);
  // Slots still sealed (see kLocal above); empty or all false without encryption.
  std::vector<bool> sealed GUARDED_BY(mu);
  uint32_t sealed_left GUARDED_BY(mu) = 0;
  // Heap::miss_clock_ at this span's last demand miss (0: none since it was made): a span missed
  // again soon after is read whole (GatherMiss).
  uint64_t last_miss GUARDED_BY(mu) = 0;
  bool in_partial = false;      // guarded by cls->mu
  int64_t resident_index = -1;  // guarded by Heap::resident_mu_
};

// RemoteStore keeps spans as SpanOwner pointers: every one it hands back is a Span.
inline Span* SpanOf(SpanOwner* o) { return static_cast<Span*>(o); }
inline std::vector<Span*> SpansOf(const std::vector<SpanOwner*>& owners) {
  std::vector<Span*> out;
  out.reserve(owners.size());
  for (SpanOwner* o : owners) out.push_back(SpanOf(o));
  return out;
}
// owners[j] = spans[j] for the n spans of one set (the form WriteSet* takes them in).
inline void OwnersOf(Span* const* spans, size_t n, SpanOwner** owners) {
  for (size_t j = 0; j < n; ++j) owners[j] = spans[j];
}

struct SizeClass {
  uint32_t index = 0;
  uint32_t size = 0;   // slot bytes
  uint32_t slots = 0;  // per span
  Mutex mu;
  std::vector<Span*> partial GUARDED_BY(mu);  // spans that may have free slots (checked on use)
  Span* hot_span GUARDED_BY(mu) = nullptr;    // where relocated hot objects go
  Mutex free_mu;                              // a leaf
  std::vector<Span*> free_spans GUARDED_BY(free_mu);  // kFree spans of this class, for reuse
};

// A span lock that can be moved (into a batch of spans locked together, or out of a loop that
// re-checks which span it locked): std::unique_lock for a farmem::Mutex. The analysis cannot
// follow a lock held this way, so every function that uses one is NO_THREAD_SAFETY_ANALYSIS and
// says why; prefer MutexLock wherever the lock stays in one scope.
class SpanLock {
 public:
  SpanLock() = default;
  explicit SpanLock(Mutex* mu) NO_THREAD_SAFETY_ANALYSIS : mu_(mu) { mu_->Lock(); }
  SpanLock(Mutex* mu, std::try_to_lock_t) NO_THREAD_SAFETY_ANALYSIS
      : mu_(mu->TryLock() ? mu : nullptr) {}
  SpanLock(SpanLock&& o) noexcept : mu_(std::exchange(o.mu_, nullptr)) {}
  SpanLock& operator=(SpanLock&& o) noexcept {
    if (this != &o) {
      unlock();
      mu_ = std::exchange(o.mu_, nullptr);
    }
    return *this;
  }
  ~SpanLock() { unlock(); }
  bool owns_lock() const { return mu_ != nullptr; }
  void unlock() NO_THREAD_SAFETY_ANALYSIS {
    if (mu_ != nullptr) std::exchange(mu_, nullptr)->Unlock();
  }
  // Keeps the mutex locked and forgets it (the caller unlocks it).
  void release() { mu_ = nullptr; }

 private:
  Mutex* mu_ = nullptr;
};

class Heap {
 public:
  Heap(Runtime* rt, RuntimeOptions options);
  ~Heap();
  Status Start();
  void Stop();

  Runtime* runtime() const { return rt_; }
  const RuntimeOptions& options() const { return options_; }
  const SpanResilience& resilience() const { return res_; }
  client::Cluster& cluster() { return *cluster_; }
  RuntimeStats stats() const;
  std::vector<std::vector<Endpoint>> GroupLayout() const { return store_->GroupLayout(); }

  // Object paths (object_heap.cc; the deref miss and prefetch: object_swap_in.cc).
  ObjectEntry* Allocate(size_t size, void** addr);
  void Free(ObjectEntry* e);
  Result<void*> Deref(ObjectEntry* e, bool mut);
  void Prefetch(ObjectEntry* e);
  // Makes the objects of `entries` local as their demand misses would (each gathered into its
  // hot span, or its span swapped in whole when several of them share it or it was missed just
  // before), with the reads posted together, up to kMaxReadRound spans a round (one doorbell per
  // daemon, the round trips overlapping); each is left open (not sealed) and hot, as its deref
  // would leave it. The first span of a round is waited for (its write-out too), the others
  // only tried: a busy one goes to a later round. Entries present or null are skipped, objects
  // that cannot be read are left to their deref, which reports the error. The entries may be stale
  // (freed, even reused, since the caller read them: every one is checked against its span's owner
  // table under the span's lock), so a caller need hold no lock across this call. Nothing is
  // pinned: deref them in the same scope, or check that they are still local.
  void FetchMany(std::span<ObjectEntry* const> entries);
  // Where a remote object's bytes lie (LocateObjectForTest).
  Result<std::vector<ObjectPlace>> Locate(ObjectEntry* e);

  // Evictor (evictor.cc).
  Status EvictUntil(uint64_t target_bytes);
  // Direct reclaim, for a thread at the budget gate (holding no scope, no lock): one eviction
  // burst down to the low watermark, unless an eviction is already running. True if it gave
  // memory back.
  bool TryReclaim();
  // Clears this heap's over-budget flag if its frames are back within the budget: after every
  // PutFrame, and as the budget gate's check of its own reason to hold a thread (scope.cc). The
  // gate needs it because the flag can be left set with nothing over: a GetFrame that crossed the
  // budget sets it just after a PutFrame that went back under found it still clear, and then no
  // PutFrame comes to clear it (the evictor has nothing to do under the budget), so every scope
  // entry would wait out the gate's full second.
  void RecheckOverBudget();
  // For tests (farmem/internal/budget_gate.h): the flag, and setting it as that race leaves it.
  bool OverBudgetForTest() const { return over_budget_.load(std::memory_order_acquire); }
  void SetOverBudgetForTest();
  // Compactor (compactor.cc).
  Status Compact();
  bool WaitForRecovery(std::chrono::milliseconds timeout) {
    return store_->WaitForRecovery(timeout);
  }

 private:
  friend struct SpanLocker;

  // ---- object_heap.cc, object_swap_in.cc ----
  SizeClass* ClassFor(size_t size);
  // The class a new object of `size` bytes goes to: ClassFor(size), or with encryption the class
  // with room for its GCM tag after it (span_crypto.h) unless that slot is more than 25% larger.
  SizeClass* ClassForObject(size_t size);
  Span* NewSpan(SizeClass* cls, SpanState state);
  ObjectEntry* NewEntry();
  void DeleteEntry(ObjectEntry* e);
  void AddPartial(Span* s);
  // Swaps `s` in (state kRemote). On success the span is kLocal.
  Status SwapInLocked(Span* s, bool prefetch) REQUIRES(s->mu);
  // Reads s's whole cell into `frame` (null: a fresh one) and returns the frame. On failure the
  // frame goes back and SwapInFailedLocked handles it; its status is the error.
  Result<uint8_t*> ReadSpanLocked(Span* s, uint8_t* frame = nullptr) REQUIRES(s->mu);
  // The second half of a swap-in, once `frame` holds the span's bytes.
  void FinishSwapInLocked(Span* s, uint8_t* frame, bool prefetch) REQUIRES(s->mu);
  // A demand miss on e in remote span s (docs/farptr.md, "Hot objects"). Reads s's cell and, when
  // the class is small and s was not missed just before (no sign of locality), copies only e
  // into its class's hot span: true, s stays remote without e. Otherwise (or when the hot span
  // is busy: only try-locks, s is held and the evictor takes those locks in the other order) the
  // read becomes an ordinary swap-in: false, s is kLocal.
  Result<bool> MissLocked(Span* s, ObjectEntry* e) REQUIRES(s->mu);
  // Counts a demand miss on s (Span::last_miss) and says whether it gathers its object (a small
  // class, gathering on, s not missed just before) rather than swapping s in whole.
  bool GatherOnMissLocked(Span* s) REQUIRES(s->mu);
  // Where e's bytes lie in its span's cell: what a gathering miss reads (with encryption its
  // ciphertext and the tag after it).
  RemoteStore::Piece PieceOf(Span* s, ObjectEntry* e) const;
  // The bytes at the start of e's slot (in span s) that its remote form occupies.
  uint32_t SealedBytesOf(Span* s, const ObjectEntry* e) const;
  // MissLocked's second half, once `sealed` holds e's piece of s's cell (PieceOf: its bytes as
  // they lie remote, read on their own; a slot's worth of room).
  Result<bool> GatherLocked(Span* s, ObjectEntry* e, const uint8_t* sealed) REQUIRES(s->mu);
  // Reads s's whole cell into a fresh frame and swaps s in (a gathering miss that could not
  // gather): false, or the read's error.
  Result<bool> SwapInWholeLocked(Span* s) REQUIRES(s->mu);
  // The class's hot span, locked into *lock: the current one if it is local, has room and no
  // remote copy, else a new one. With `try_only` no lock is waited for (null when one is busy).
  Span* HotSpanLocked(SizeClass* c, Span* not_this, SpanLock* lock, bool try_only) REQUIRES(c->mu);
  // Moves the object in `slot` of local span src into a free slot of local span dst (both held;
  // dst has no remote copy): the entry points to dst, its word is `present | hot` plus the dirty
  // bit of w; src releases its frame if that was its last object.
  void MoveObjectLocked(Span* src, uint32_t slot, Span* dst, uint64_t w) REQUIRES(src->mu, dst->mu);
  // The object's bytes into a free slot of dst (held, local, no remote copy), e pointing there
  // with `present | hot | flags`. Returns the slot.
  uint32_t PlaceObjectLocked(Span* dst, ObjectEntry* e, const uint8_t* bytes, uint64_t flags)
      REQUIRES(dst->mu);
  // Opens the sealed objects in `slots` of the local span s (encryption; see kLocal above): their
  // words become kPresent. Objects whose tag fails: with redundancy to spare the member is
  // reported corrupt (failed, so it is re-protected) and the cell read again from the others
  // into a scratch frame, whose ciphertext replaces that of every slot still sealed; what still
  // fails is lost, object by object (LoseObjectsLocked; a span left empty is released by the
  // evictor). OK: the slots are open or lost. Other errors: the re-read failed; the failed slots
  // stay sealed (their ciphertext is intact) for a later deref to try again.
  Status OpenSealedLocked(Span* s, std::span<const uint32_t> slots) REQUIRES(s->mu);
  // The slots of `slots` not in `failed`, opened into `plain` (same offsets), are copied into
  // the frame and become present.
  void MarkOpenedLocked(Span* s, std::span<const uint32_t> slots,
                        const std::vector<uint32_t>& failed, const uint8_t* plain) REQUIRES(s->mu);
  // Every sealed slot of s (before its cell is given up).
  Status OpenAllSealedLocked(Span* s) REQUIRES(s->mu);
  // Moves the objects in `slots` of s (remote, or local and sealed) to a new kLost span that says
  // `why`.
  void LoseObjectsLocked(Span* s, std::span<const uint32_t> slots, const Status& why)
      REQUIRES(s->mu);
  // A swap-in that failed: says which span, marks it lost on DataLoss.
  Status SwapInFailedLocked(Span* s, Status st) REQUIRES(s->mu);
  // Frees a local span that has no live object.
  void ReleaseLocalLocked(Span* s) REQUIRES(s->mu);
  // A local span is about to be written (or its row is wanted): its remote copy becomes a hole
  // (no-op without a copy).
  void DropCopyLocked(Span* s) REQUIRES(s->mu);
  // Clean local spans whose copies sit in span sets with holes give the copies up, so the
  // compactor can move those sets (takes span locks; not with other span locks held).
  void DropCopiesInHoledSets();
  // A remote span whose data cannot be produced.
  void MarkLostLocked(Span* s, const Status& why) REQUIRES(s->mu);
  // Marks a span with no live object kFree and offers it for reuse (no frame).
  void RetireLocked(Span* s) REQUIRES(s->mu);
  // Remote span s lost its last object: its cell goes back to the store and s is retired.
  void RetireRemoteLocked(Span* s) REQUIRES(s->mu);
  void AddResident(Span* s);
  void RemoveResident(Span* s);
  std::string Describe(Span* s) REQUIRES(s->mu);
  void PrefetchLoop();

  // Frames: span_size bytes of local memory each, counted against the budget.
  uint8_t* GetFrame();
  void PutFrame(uint8_t* f);
  IoContext* CheckoutIo();
  void ReturnIo(IoContext* io);

  // ---- evictor.cc ----
  void EvictorLoop();
  // Evicts until at most `target_frames` are resident (or nothing more can go). Returns spans
  // evicted.
  // `drain_limit`: how long to wait for open scopes before giving the round up (direct reclaim
  // must not wait for a scope that may be waiting for a lock its caller holds).
  size_t EvictRound(size_t target_frames, bool force,
                    std::chrono::nanoseconds drain_limit = std::chrono::nanoseconds::max());
  struct Relocation {
    Span* span;
    uint32_t slot;
    ObjectEntry* entry;
  };
  // Returns the number of frames it gave back itself: resident spans with no object left (a hot
  // span whose relocations were all called off) are released on sight.
  size_t PickVictims(size_t need, bool force, std::vector<Span*>* victims,
                     std::vector<Relocation>* relocations);
  void Relocate(const std::vector<Relocation>& relocations);
  // Writes committed spans (state kWriting) in sets of k.
  size_t WriteOut(std::vector<Span*>& spans);
  // Evicts a clean span that still has its remote copy: no I/O (state kEvicting).
  void EvictCleanLocked(Span* s) REQUIRES(s->mu);

  std::vector<uint32_t> hot_slots_;  // PickVictims scratch (evictor thread)
  // Rate limit for warnings that a struggling evictor would repeat: one per 5 s.
  bool ShouldLog();
  std::atomic<int64_t> last_warning_ms_{-100000};

  // ---- compactor.cc ----
  bool CompactionWanted() const;
  Status CompactOnce(size_t* moved);
  // A cell compaction was about to move failed its checksum: counts and logs it and reports the
  // member corrupt (RemoteStore::ReportCorrupt). True if a read now rebuilds it from the others.
  bool ReportCorruptCell(Span* s, const char* found_by) REQUIRES(s->mu);

  Runtime* rt_;
  RuntimeOptions options_;
  SpanResilience res_;
  std::unique_ptr<client::Cluster> cluster_;
  std::unique_ptr<RemoteStore> store_;
  std::unique_ptr<SpanCrypto> crypto_;  // null: encryption off
  uint32_t span_size_ = 0;
  // The frames the budget allows, and the watermarks in frames. Fixed, or with
  // RuntimeOptions::budget_includes_metadata what the budget leaves beside the metadata
  // (UpdateFrameLimits, whenever metadata grows or shrinks).
  std::atomic<size_t> budget_frames_{0}, high_frames_{0}, low_frames_{0};
  // How far the prefetcher reads ahead: halfway from the high watermark to the budget. Above the
  // high watermark the evictor runs, so read-ahead has the room between the low watermark and
  // here whatever the band, and the other half is left to misses before the budget gate closes.
  std::atomic<size_t> prefetch_frames_{0};
  size_t base_frames_ = 0;  // local_budget / span_size
  void UpdateFrameLimits();
  // Local memory the runtime holds outside the frames: entries, span structs and slot tables,
  // and the warm frame cache at its limit.
  uint64_t MetadataBytes() const;
  std::atomic<uint64_t> entry_bytes_{0}, span_structs_{0};
  std::atomic<bool> metadata_warned_{false};
  std::vector<std::unique_ptr<SizeClass>> classes_;
  std::vector<uint16_t> class_of_;  // (size + 15) / 16 -> class index

  // A live span's slot tables (owner: 8 B a slot, free_slots and sealed: a bit each); RetireLocked
  // gives them back, the struct stays (RuntimeStats::span_meta_bytes).
  static uint64_t SlotTableBytes(const SizeClass* c) {
    return c->slots * 8ull + FreeSlots::BytesFor(c->slots) + c->slots / 8 + 1;
  }
  std::atomic<uint64_t> slot_table_bytes_{0};
  static constexpr size_t kEntriesPerChunk = 4096;

  mutable Mutex spans_mu_;
  std::vector<std::unique_ptr<Span>> spans_ GUARDED_BY(spans_mu_);  // every span ever made
  std::atomic<uint64_t> next_span_id_{1};

  Mutex resident_mu_;
  std::vector<Span*> resident_ GUARDED_BY(resident_mu_);
  size_t clock_hand_ GUARDED_BY(resident_mu_) = 0;

  // Frames come from chunks mapped kFrameChunk bytes at a time (munmapped in Stop), never from
  // malloc: glibc's aligned_alloc(4096, span_size) cost about one page more per frame (~2x for
  // 4 KiB spans) and its freed frames stayed resident. A frame given back goes to warm_frames_
  // (at most warm_limit_ of them, resident: the next GetFrame takes it with no page fault);
  // beyond that its pages are handed back to the kernel (MADV_DONTNEED) and the frame, now
  // costing no memory, goes to cold_frames_. So resident frame memory is frames_in_use_ plus at
  // most warm_limit_ frames (RuntimeStats::frame_cache_bytes).
  mutable Mutex frames_mu_;
  std::vector<uint8_t*> warm_frames_ GUARDED_BY(frames_mu_);
  std::vector<uint8_t*> cold_frames_ GUARDED_BY(frames_mu_);
  std::vector<std::pair<void*, size_t>> frame_chunks_ GUARDED_BY(frames_mu_);
  size_t warm_limit_ = 0;
  std::atomic<size_t> frames_in_use_{0};
  std::atomic<bool> over_budget_{false};
  std::atomic<bool> eviction_stalled_{false};  // the last eviction attempt moved nothing

  mutable Mutex entries_mu_;
  std::vector<std::unique_ptr<ObjectEntry[]>> entry_chunks_ GUARDED_BY(entries_mu_);
  std::vector<ObjectEntry*> free_entries_ GUARDED_BY(entries_mu_);

  Mutex io_mu_;
  std::vector<std::unique_ptr<IoContext>> io_all_ GUARDED_BY(io_mu_);
  std::vector<IoContext*> io_free_ GUARDED_BY(io_mu_);

  // Evictor thread.
  Mutex evict_mu_;
  CondVar evict_cv_;
  bool stopping_ GUARDED_BY(evict_mu_) = false;
  bool evict_wanted_ GUARDED_BY(evict_mu_) = false;
  Mutex evict_round_mu_;  // one eviction or compaction at a time
  std::thread evictor_;

  // Prefetchers.
  Mutex prefetch_mu_ ACQUIRED_BEFORE(evict_mu_);
  CondVar prefetch_cv_;
  std::deque<ObjectEntry*> prefetch_queue_ GUARDED_BY(prefetch_mu_);
  std::vector<std::thread> prefetchers_;

  // Counters.
  // remote_object_bytes_: live objects with bytes in a remote cell (kRemote spans and the clean
  // copies of local spans); copy_object_bytes_: the part of it that is also local.
  std::atomic<uint64_t> objects_{0}, object_bytes_{0}, remote_object_bytes_{0};
  std::atomic<uint64_t> copy_object_bytes_{0}, clean_evictions_{0}, copies_dropped_{0};
  std::atomic<uint64_t> resident_spans_{0}, remote_spans_{0};
  std::atomic<uint64_t> swap_ins_{0}, prefetches_{0}, spans_evicted_{0}, sets_written_{0};
  std::atomic<uint64_t> eviction_cancels_{0}, objects_relocated_{0}, spans_lost_{0};
  std::atomic<uint64_t> objects_gathered_{0};
  std::atomic<uint64_t> miss_clock_{0};  // demand misses (Span::last_miss)
  std::atomic<uint64_t> compactions_{0}, compaction_spans_in_{0}, compaction_spans_out_{0};
  std::atomic<uint64_t> compaction_client_bytes_{0};
  std::atomic<uint64_t> compaction_bytes_sent_{0}, compaction_bytes_received_{0};
  std::atomic<uint64_t> compaction_cpu_ns_{0}, compaction_offloaded_sets_{0};
  std::atomic<uint64_t> compaction_offload_fallbacks_{0}, compaction_corrupt_cells_{0};
  std::atomic<uint64_t> bytes_read_{0}, bytes_written_{0};
  std::atomic<uint64_t> auth_failures_{0}, auth_failed_objects_{0}, auth_lost_objects_{0};
  std::atomic<int64_t> last_auth_log_ms_{-100000};
};

// Scopes and grace periods (scope.cc).
// Waits until every thread that was inside an outermost DerefScope when this was called has
// left it.
void WaitForScopesToDrain();
// The same, giving up after `limit`: false if some scope was still open.
bool WaitForScopesToDrainFor(std::chrono::nanoseconds limit);
// The budget gate: while any heap is over its budget, threads entering an outermost scope wait
// (up to a bound) for the evictor.
void SetOverBudget(Heap* heap, std::atomic<bool>& flag, bool over);

}  // namespace farmem::farptr_internal
