// WriteCache: a small, bounded write-back page cache in front of a BlockBackend, so that writes
// smaller than a 4 KiB page do not each cost a read-modify-write of the page on the backend.
//
// What it solves: the remote page store stores whole 4 KiB pages (sealed with AES-GCM, and with
// ec:k+r cut into fragments), so a 512 B or 1 KiB NBD write used to read the page, patch it and
// write it back before replying — two round trips, serialized with every other partial write.
// Clients with 512-byte sectors (filesystems, VM images, nbd-tester-client) meet that path all the
// time. The cache keeps a bounded number of pages in this process:
//  - A write that covers part of a page lands in the cached copy of that page, which records the
//    512-byte sectors it holds; nothing is read. The rest of a partly written page is read from
//    the backend when the page goes back (for all such pages of a write-back batch together), and
//    not at all if later writes filled it (sequential small writes).
//  - A write of whole pages under absorb_writes_below_pages pages (what the page stores set: 16
//    pages for a page store, 4k for the stripe layout) is held like a partial one, so that it goes
//    back in write-back batches (the stripe layout: k pages at a time, full stripes). A larger
//    whole-page write, or any whole-page write when the threshold is 0, updates the pages it finds
//    cached and sends the rest straight to the backend (the cache adds only a lookup there).
//  - Reads see the cache (read-your-writes, also for reads that overlap cached pages partly);
//    what is not cached, and sectors a cached page lacks, are read from the backend (the page's
//    sectors are then laid over that; the page is pinned meanwhile).
//  - A request of a batch that the cache serves whole (a held write, a read of cached sectors)
//    is reported done (BatchListener) as soon as the batch is planned, before the backend ops of
//    the others run (a large write passing through, a read of pages not cached): the NBD
//    connection sends its reply meanwhile. A held FUA write is reported after its write-back.
//  - Dirty pages go back to the backend, as whole-page writes in batches: ahead of need, by the
//    flusher thread, once half the cache (or all but two batches, if more) is dirty (least
//    recently used dirty pages first, a batch at a time, so that requests keep finding clean or
//    free pages while a batch is in flight); when a slot is needed and no clean page is left (the
//    request's own thread, when the flusher has fallen behind); on Flush() (NBD_CMD_FLUSH,
//    answered only once every page that was dirty when it arrived is durable in the backend, and
//    the backend's own Flush() ran); for a FUA write, before it completes (its pages, topped up to
//    whole groups of writeback_multiple with other dirty pages); when they have been dirty for
//    max_dirty_age (the flusher thread); and on destruction.
//  - Trim and write-zeroes drop or patch the cached pages they cover and go to the backend.
// This is the contract of a disk's volatile write cache: a write is acknowledged before it is
// durable, Flush and FUA make it durable. The cache is shared by all connections, so a Flush on
// any connection covers every connection's writes (can_multi_conn() stays the backend's).
//
// Errors. A write-back that fails leaves its pages cached and dirty (never silently dropped):
// reads keep returning the data, the flusher and every later Flush retry them. The failure is
// latched and the next Flush() returns an error (once, like fsync after a failed write-back on
// Linux), as does a Flush whose own write-backs fail; a FUA write whose pages cannot be written
// back fails. When every page of the cache holds data that failed to go back, writes that need a
// new page fail with an error that says so. Pages still dirty when the cache is destroyed are
// written back one last time; what cannot be is named in the log.
//
// Threading: every BlockBackend method may be called from any number of threads (one per NBD
// connection), plus the flusher thread. One mutex (mu_) guards the cache's map and lists; backend
// I/O never runs under it. A page being written back is busy: writes to it (and a trim or
// write-zeroes that would drop it, or drop a pinned page) wait for that I/O, which itself never
// waits on anything, so there is no deadlock: a batch first sends what it has planned before it
// waits. The request path does not allocate in the common case (pages are allocated up front; the
// per-thread scratch vectors keep their capacity).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include "farmem/blockdev/block_backend.h"
#include "farmem/common/mutex.h"
#include "farmem/common/status.h"

namespace farmem::blockdev {

struct WriteCacheOptions {
  // Pages (4 KiB) the cache holds at most; kMinPages to 2^24. 256 pages = 1 MiB, allocated at
  // start (locked in swap-safe mode): four write-back batches, one going back while the others
  // fill; random sub-page writes seldom hit a cached page again at any size that fits in locked
  // memory, and sequential ones fill a page within a few writes (docs/nbd.md "Memory footprint").
  size_t pages = 256;
  // A dirty page goes back to the backend once it has been dirty this long (the flusher thread).
  std::chrono::milliseconds max_dirty_age{100};
  // Dirty pages written back together when a slot is needed (one batch on the backend).
  size_t writeback_batch = 64;
  // The backend stores pages in groups of this many (the stripe layout's k: a stripe of k pages
  // plus parity, docs/nbd.md). Write-backs then take a multiple of it where the dirty pages allow
  // (one that a deadline, a flush or an eviction starts is topped up with other dirty pages).
  // 1: no groups.
  size_t writeback_multiple = 1;
  // Writes of whole pages are held in the cache too (not only partial pages) when they cover
  // fewer than this many pages. Written through, such a write costs a message per NBD batch to
  // each daemon it touches (and with groups, unless it is whole groups, a short group: the
  // stripe layout's stripe of 1 page + k-1 zero holes + r parity, rewritten by compaction
  // later). Held, it is answered from memory and goes back in a write-back batch of 64 pages (of
  // whole groups): the page stores' setting (PageStore / StripeStore::TuneWriteCache). A FUA
  // write is held too and goes back before its reply (topped up with other dirty pages to a
  // whole group). 0: whole pages always pass straight through. At most pages / 4 (Create clamps
  // it).
  size_t absorb_writes_below_pages = 0;
  // Run the flusher thread. Tests that drive the clock themselves call WriteBackExpired() instead.
  bool flusher_thread = true;
  // The clock that ages dirty pages; null: steady_clock. Tests inject a fake one.
  std::function<std::chrono::steady_clock::time_point()> now;
};

struct WriteCacheStats {
  uint64_t pages = 0;   // capacity
  uint64_t cached = 0;  // now: pages holding data
  uint64_t dirty = 0;   // now: pages not yet written back
  // Partly written pages whose other sectors were read from the backend to write them back
  // (pages that later writes filled whole need no read).
  uint64_t fills = 0;
  uint64_t writebacks = 0;  // pages written back
  uint64_t writeback_failures = 0;
  uint64_t expired = 0;  // of the write-backs: by the flusher (max_dirty_age)
  uint64_t waits = 0;    // requests that waited for a page's write-back (or pin)
};

class WriteCache final : public BatchBackend {
 public:
  static constexpr uint64_t kPage = 4096;
  static constexpr size_t kMinPages = 8;

  // Takes ownership of `inner` (its size must be a multiple of 4096). Fails on bad options.
  static Result<std::unique_ptr<WriteCache>> Create(std::unique_ptr<BlockBackend> inner,
                                                    WriteCacheOptions options);
  // Stops the flusher and writes back every dirty page (logging what cannot be) before the inner
  // backend is destroyed.
  ~WriteCache() override;
  WriteCache(const WriteCache&) = delete;
  WriteCache& operator=(const WriteCache&) = delete;

  uint64_t size() const override { return inner_->size(); }
  Status Flush() override EXCLUDES(mu_);
  void ExecuteBatch(std::span<BlockOp> ops, BatchListener* listener = nullptr) override
      EXCLUDES(mu_);

  bool can_flush() const override { return true; }
  bool can_fua() const override { return true; }
  bool can_trim() const override { return inner_->can_trim(); }
  bool can_write_zeroes() const override { return inner_->can_write_zeroes(); }
  // One cache for all connections: a Flush anywhere writes back everything.
  bool can_multi_conn() const override { return inner_->can_multi_conn(); }

  // Writes back the dirty pages that have been dirty for max_dirty_age by the options' clock (and
  // whose last failed write-back, if any, is that old). The flusher thread's pass; tests with a
  // fake clock call it themselves. Returns the first write-back error.
  Status WriteBackExpired() EXCLUDES(mu_);
  // While at least ahead_dirty_pages() pages are dirty, writes back the least recently used dirty
  // pages that are not going back, a batch at a time, until fewer are dirty or none is left to
  // send. The flusher thread's other pass (woken when a write makes that many dirty); tests
  // without the thread call it themselves. Returns the first write-back error.
  Status WriteBackAhead() EXCLUDES(mu_);
  // max(pages / 2, pages - 2 * writeback_batch).
  size_t ahead_dirty_pages() const { return ahead_dirty_pages_; }
  WriteCacheStats stats() const EXCLUDES(mu_);
  BlockBackend* inner() const { return inner_.get(); }

 private:
  struct Slot;
  struct List {
    int32_t head = -1, tail = -1;
    size_t size = 0;
  };
  struct Scratch;
  class Translator;
  static Scratch* ThreadScratch();  // the calling thread's
  enum class Plan { kPlanned, kWait, kNeedSlots };

  WriteCache(std::unique_ptr<BlockBackend> inner, WriteCacheOptions options);
  std::chrono::steady_clock::time_point Now() const;

  // ---- the request path ----
  // Plans op i of the current sub-batch (mu_ held): copies from/to cached pages now, queues
  // backend ops and overlays in `s`. kWait / kNeedSlots: nothing was planned.
  Plan PlanOp(BlockOp& op, size_t i, Scratch& s) REQUIRES(mu_);
  Plan PlanReadWrite(BlockOp& op, size_t i, Scratch& s) REQUIRES(mu_);
  Plan PlanZero(BlockOp& op, size_t i, Scratch& s) REQUIRES(mu_);
  // Lays the pinned pages of a sub-batch whose backend ops have run over its reads; unpins them.
  void FinishSubBatch(std::span<BlockOp> ops, Scratch& s) REQUIRES(mu_);
  // Makes room when an op needs pages and none is free or clean: writes back the least recently
  // used dirty pages, or waits for write-backs in flight. An error when no page can be freed.
  // [lo, hi]: the pages of the op that needs `need` pages (evicting those would not help it).
  Status Reclaim(uint64_t lo, uint64_t hi, size_t need) EXCLUDES(mu_);
  // Writes back the dirty pages in [offset, offset + length) (a FUA write's), waiting for those
  // already going back.
  Status WriteBackRange(uint64_t offset, uint64_t length) EXCLUDES(mu_);
  // Writes the slots (marked writeback by the caller) to the backend as one batch, after reading
  // the sectors that partly written ones lack (one batch too); then marks them clean, or failed
  // (still dirty, error latched). Returns the first error.
  Status WriteBackSlots(std::span<const int32_t> slots, bool fua, bool to_lru_tail) EXCLUDES(mu_);
  void FlusherLoop() EXCLUDES(mu_);
  // Adds dirty pages that are not going back or failed (least recently used first) to `sel`,
  // marked writeback, until its size is a multiple of writeback_multiple or none is left.
  void TopUpLocked(std::vector<int32_t>& sel) REQUIRES(mu_);
  // WriteBackAhead's batch: the least recently used dirty pages not going back and not failed,
  // up to writeback_batch (topped up), marked writeback; none while fewer than
  // ahead_dirty_pages_ are dirty.
  void SelectAheadLocked(std::vector<int32_t>& sel) REQUIRES(mu_);
  // What both of those take: dirty pages not going back and not failed, least recently used
  // first, marked writeback and added to `sel` until it holds `until` or none is left.
  void TakeLruDirtyLocked(std::vector<int32_t>& sel, size_t until) REQUIRES(mu_);

  // ---- the map and the lists (mu_ held) ----
  int32_t Lookup(uint64_t page) const REQUIRES(mu_);
  // The index in buckets_ of `page`'s hash chain (Fibonacci hashing).
  size_t BucketOf(uint64_t page) const {
    return (page * 0x9E3779B97F4A7C15ull >> 20) & bucket_mask_;
  }
  void Insert(int32_t slot) REQUIRES(mu_);
  void Erase(int32_t slot) REQUIRES(mu_);
  void PushFront(List& l, int32_t slot) REQUIRES(mu_);
  void PushBack(List& l, int32_t slot) REQUIRES(mu_);
  void Unlink(List& l, int32_t slot) REQUIRES(mu_);
  List& ListOf(const Slot& s) REQUIRES(mu_);
  void Touch(int32_t slot) REQUIRES(mu_);      // most recently used in its list
  void MarkDirty(int32_t slot) REQUIRES(mu_);  // written: into (the front of) dirty_
  void Drop(int32_t slot) REQUIRES(mu_);       // forgotten (not busy): back to free_
  // A slot for a new page: a free one, else the least recently used clean page that is not in
  // [lo, hi] (the pages of the op being planned); -1 if none.
  int32_t AllocSlot(uint64_t lo, uint64_t hi) REQUIRES(mu_);
  uint8_t* Buf(int32_t slot) const { return buffers_.get() + static_cast<size_t>(slot) * kPage; }

  const std::unique_ptr<BlockBackend> inner_;
  const WriteCacheOptions options_;
  const uint64_t pages_in_export_;
  const size_t ahead_dirty_pages_;  // WriteBackAhead's threshold
  // Page contents, options_.pages * kPage bytes. A slot's bytes are guarded by mu_ while it is
  // not busy; while it is written back the thread doing that I/O owns the bytes (readers may still
  // copy its valid sectors under mu_: nobody else writes it meanwhile).
  std::unique_ptr<uint8_t[]> buffers_;

  mutable Mutex mu_;
  CondVar changed_;     // a fill or write-back finished, a page was freed
  CondVar flusher_cv_;  // the flusher: a first dirty page, or stop
  std::vector<Slot> slots_ GUARDED_BY(mu_);
  std::vector<int32_t> buckets_ GUARDED_BY(mu_);  // hash of page -> first slot of its chain
  uint64_t bucket_mask_ = 0;
  std::vector<int32_t> free_ GUARDED_BY(mu_);
  List clean_ GUARDED_BY(mu_);  // ready, not dirty; front = most recently used
  List dirty_ GUARDED_BY(mu_);  // dirty (some may be going back); front = most recently used
  uint64_t dirty_seq_ GUARDED_BY(mu_) = 0;    // counts pages becoming dirty
  uint64_t flush_epoch_ GUARDED_BY(mu_) = 0;  // counts Flush() calls
  // The first write-back failure since the last Flush() reported one.
  Status latched_error_ GUARDED_BY(mu_);
  uint64_t latched_failures_ GUARDED_BY(mu_) = 0;
  WriteCacheStats stats_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  size_t pinned_ GUARDED_BY(mu_) = 0;  // pages with pins > 0
  std::thread flusher_;
};

}  // namespace farmem::blockdev
