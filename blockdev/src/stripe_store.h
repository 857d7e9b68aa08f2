// StripeStore: farmem-nbd's stripe layout for ec:k+r (--ec-layout stripe, docs/nbd.md "Stripe
// layout") — a page lives whole on one daemon, so a read is one message to one daemon.
//
// What it solves: the split layout (PageStore, Hydra) cuts every 4 KiB page into k fragments on
// k + r daemons, so a 4 KiB read asks all of them and waits for k. Here pages are kept as span
// sets of the shared span-set store (spanstore::RemoteStore, Carbink's layout, also far_ptr's)
// with span_size 4096: the pages of a write batch are packed k at a time into a set — k data
// cells on k daemons plus r parity cells, written whole (no read-modify-write of parity) — and a
// page table maps each export page to its cell (set, member). An overwrite writes a new set and
// makes the old cell a hole; compaction rewrites the live cells of the emptiest sets as full sets
// so that their rows go back to the daemons — by the daemons themselves (compaction offload,
// below). A read is ReadSpans: one op to the one daemon of the
// cell while it is up; a degraded read (that daemon gone) decodes from k members. Re-protection
// of failed members, revalidation, eviction-notice moves, degraded writes: RemoteStore's.
//
// Page table: export page -> PageEntry {set, member, cell CRC-32C}, 16 bytes per 4 KiB page
// (4 MiB per GiB of export, allocated at start). A page whose entry has no set was never written
// (or was trimmed) and reads as zeroes. The entry is the cell's SpanOwner, so compaction maps a
// candidate cell back to its page without another table.
//
// Concurrency (every BlockBackend method from any thread, plus the compaction thread): the page
// table is guarded by kLockStripes striped reader/writer locks (farmem::SharedMutex; page p ->
// stripe p % kLockStripes). A batch takes the stripes of all its pages up front, in ascending
// order (one order for every thread: no deadlock), shared for reads and exclusive for anything
// that changes a page (write, trim, write-zeroes, a compaction move), and holds them until the
// batch is done, network I/O included. Why that is enough: a cell is released (RemoteStore may
// then free its row, and reuse it for another set) only by whoever changes its page's entry,
// under the page's exclusive lock; a reader holds the page shared from looking up (set, member)
// until the cell is read and opened, so the row it reads cannot be freed or reused meanwhile.
// The same lock orders the page's seal (PageCrypto::EndWrite) with readers: a reader sees the
// old entry with the old recorded seal, or the new entry with the new one. Which stripes are held
// is dynamic, so the analysis cannot follow them: LockPages/UnlockPages are the only places that
// take them (NO_THREAD_SAFETY_ANALYSIS there, the entries are not GUARDED_BY).
// Each call checks out a Worker (its own IoContext, cipher, buffers) for its duration.
//
// Writes: a write is acknowledged when its set is on the k + r members (or as many as RemoteStore
// could place, degraded, at least k). Nothing is buffered here: Flush and FUA have nothing to do
// but flush the backup file, if any. Sub-page writes read, patch and write their page under its
// exclusive lock (several of one page in one batch: one read, all patches, one write —
// MergePartialWrites); the write cache in front, on by default, turns most of them into whole
// pages, and holds small whole-page writes so that they arrive in whole stripes (TuneWriteCache).
// Trim and write-zeroes release the whole pages they cover (they read as zeroes); write-zeroes
// patches partial pages with zeroes; trim leaves partial pages alone (their content is unspecified
// after a trim anyway).
//
// Encryption (on by default): PageCrypto exactly as PageStore uses it — each page sealed before
// its cell leaves the process, AAD binding the export page number; a cell that fails to open is
// reported (RemoteStore::ReportCorrupt: its member is failed and rebuilt) and read again, rebuilt
// from the other members; with no redundancy left, an error for exactly that page. Nothing of a
// page's seal depends on where its cell lives (nonce: domain || write counter; AAD: domain ||
// export page number), so a cell moved unchanged still opens with the page's recorded seal.
//
// Compaction offload (StripeStoreOptions::compaction_offload, off by default: at 4 KiB cells it
// costs the client more CPU per page than moving the bytes itself, docs/nbd.md; the far_ptr
// compactor's, RemoteStore::WriteSetGathered): the plan — which live cell becomes which data
// member of which new set — needs only the page table. The daemons of the new set's data members
// copy the cells from their daemons themselves (GATHER_CELL) and its parity daemons compute parity
// (PARITY_ENCODE); the client sends a few hundred bytes of requests per set and then swaps the
// moved pages' entries, under their exclusive locks held for the whole pass (a write of a page
// being moved waits, then writes a new set as usual: its new value wins). The ciphertext moves
// unchanged: no key on a daemon, no new seal, no nonce used. Corruption must not ride along
// (moved unopened under new parity, with the old set freed, a flipped bit would become
// unrecoverable): each entry keeps the CRC-32C of its cell as written, the gathering daemons
// report the CRC-32C of what they read, and a mismatch is reported (ReportCorrupt: re-protected)
// and the pass falls back. Fallback, on any offload error (a degraded source, a daemon without
// these opcodes, a corrupted source): the pass undoes what it wrote and moves the bytes through
// the client as without offload — read, open (a corrupted cell is caught and rebuilt there),
// seal anew, write. Counted: compaction_offloaded_sets, compaction_offload_fallbacks, and the
// client bytes / CPU of compaction.
//
// Backup file (--backup, Infiniswap's, BackupFile as the split layout uses it): every page a
// write puts in a set also goes to the file at its export offset (the same bytes as its cell:
// ciphertext when encrypted, so the page's recorded seal opens either), trim and write-zeroes
// zero it there, Flush and FUA flush it. A page whose cell cannot be read (its members given up,
// beyond tolerance) or does not open with no redundancy left is read from the file instead, and
// is then not lost: nothing is logged LOST, it is logged as served from the backup file.
//
// Not supported (yet): none / replicate modes (CheckResilience).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "backup_file.h"
#include "farmem/blockdev/block_backend.h"
#include "farmem/blockdev/write_cache.h"
#include "farmem/client/cluster.h"
#include "farmem/client/resilience.h"
#include "farmem/common/aead.h"
#include "farmem/common/mutex.h"
#include "farmem/spanstore/remote_store.h"
#include "page_crypto.h"
#include "page_store.h"  // PageStoreStats: status and metrics read the same struct
#include "worker_pool.h"

namespace farmem::blockdev {

struct StripeStoreOptions {
  uint64_t size = 0;              // export size, a multiple of 4096
  client::Resilience resilience;  // ec:k+r with k + r <= spanstore::kMaxSetWidth
  size_t workers = 4;  // concurrent callers served without waiting (PageStoreOptions::workers)
  std::chrono::milliseconds op_timeout{5000};
  std::chrono::microseconds busy_poll{0};  // client::ChannelSet::SetBusyPoll of the workers
  std::chrono::milliseconds reconcile_interval{1000};  // RemoteStore's
  bool lease_ahead = true;  // RemoteStore::Create's: the next slab group leased in the background
  std::chrono::milliseconds startup_wait{10000};  // for k live daemons
  bool encrypt = true;
  std::optional<aead::Key> data_key;  // empty: a fresh one
  PageCrypto::SealObserver seal_observer;
  // Compaction runs while the rows in use exceed compact_trigger * (k + r) / k * live bytes (the
  // space a fully packed store would use). 0: never by itself (CompactOnce still works).
  double compact_trigger = 1.5;
  std::string backup_path;  // empty: no backup file (see the header comment)
  // The daemons move the cells that compaction moves (see the header comment); they must reach
  // each other at the addresses the cluster knows them by. Off (the default): the client moves
  // them. farmem-nbd --compaction-offload.
  bool compaction_offload = false;
};

// What only the stripe layout has (PageStoreStats has the rest).
struct StripeStoreStats {
  uint64_t live_pages = 0;    // pages with a cell
  uint64_t sets = 0;          // span sets in use
  uint64_t set_bytes = 0;     // sets * (k + r) * 4096: rows in use
  uint64_t leased_bytes = 0;  // slabs leased from the daemons
  // Slab groups placed ahead of need in the background, and by a writer that found no free row
  // (spanstore::RemoteStoreStats).
  uint64_t groups_leased_ahead = 0;
  uint64_t groups_leased_by_writers = 0;
  uint64_t sets_written = 0;  // by writes (not compaction)
  uint64_t short_sets = 0;    // of those, with fewer than k pages
  uint64_t compactions = 0;   // compaction passes that moved something
  uint64_t pages_compacted = 0;
  // Compaction offload: sets the daemons assembled, passes that fell back to moving the bytes
  // through the client, and what compaction cost the client (every byte of its data-path and
  // offload requests and replies; CPU time of the compacting thread).
  uint64_t compaction_offloaded_sets = 0;
  uint64_t compaction_offload_fallbacks = 0;
  uint64_t compaction_bytes_sent = 0;
  uint64_t compaction_bytes_received = 0;
  uint64_t compaction_cpu_ns = 0;
};

class StripeStore final : public BatchBackend {
 public:
  static Result<std::unique_ptr<StripeStore>> Create(client::Cluster* cluster,
                                                     StripeStoreOptions options);
  // The resilience this layout can serve: ec:k+r with k + r <= spanstore::kMaxSetWidth (Create
  // checks it; farmem-nbd before it connects, to fail at once).
  static Status CheckResilience(const client::Resilience& res);
  ~StripeStore() override;

  uint64_t size() const override { return options_.size; }
  // Nothing is buffered here (see above); a backup file is flushed.
  Status Flush() override { return backup_ ? backup_->Flush() : Status::Ok(); }
  void ExecuteBatch(std::span<BlockOp> ops, BatchListener* listener = nullptr) override;

  bool can_flush() const override { return true; }
  bool can_fua() const override { return true; }
  bool can_trim() const override { return true; }
  bool can_write_zeroes() const override { return true; }
  bool can_multi_conn() const override { return true; }

  // PageStoreStats where they apply (docs/nbd.md "Stripe layout" says which): "extents" are span
  // sets here (degraded_extents: sets in a group with a failed member).
  PageStoreStats stats() const;
  StripeStoreStats stripe_stats() const;
  bool encrypted() const { return crypto_ != nullptr; }
  const client::Resilience& resilience() const { return options_.resilience; }

  // What the write cache in front of this store (farmem-nbd's, on by default) should hold: a
  // write of fewer than k pages would be a short stripe here (k-1 zero holes + r parity, its
  // pages moved again by compaction), and one of a few whole stripes costs a round of its own,
  // so whole-page writes of fewer than 4k pages are held too and go back in batches of whole
  // stripes where the dirty pages allow (2026-12-05: holding the 4- and 8-page ones too, 16 KiB
  // writes at depth 1 cost 60 instead of 255 µs of CPU). docs/nbd.md "Stripe layout", "Write
  // cache".
  void TuneWriteCache(WriteCacheOptions& o) const {
    o.writeback_multiple = static_cast<size_t>(options_.resilience.k);
    o.absorb_writes_below_pages = 4 * o.writeback_multiple;
  }

  // One compaction pass over the emptiest sets; *moved gets the pages moved.
  Status CompactOnce(uint64_t* moved);
  // False if failed members still wait for re-protection after `timeout`.
  bool WaitForRecovery(std::chrono::milliseconds timeout) {
    return remote_->WaitForRecovery(timeout);
  }
  // For tests: the remote store's index of rows by live cells agrees with the rows
  // (RemoteStore::LiveIndexConsistent, O(rows)).
  bool LiveIndexConsistentForTest() const { return remote_->LiveIndexConsistent(); }
  // Where page `page`'s cell lives now: (lease, byte offset), empty if unwritten. For tests.
  std::vector<std::pair<client::Lease, uint64_t>> PagePlaces(uint64_t page);

  static constexpr uint64_t kPage = 4096;
  // A worker's buffers are sized at start for a piece of a batch: at most kPiecePages pages
  // (the NBD server's largest batch, 1 MiB of reads, plus the partial pages at its requests'
  // ends), kPieceWrites of them written (one write-back batch of the write cache, 256 KiB: the
  // ciphertext buffer) and kPiecePartials partial (read-modify-write or sub-page reads: 64 KiB of
  // scratch). ExecuteBatch runs a larger batch in pieces of that size, one after the other, so
  // the request path never allocates (swap safety; docs/nbd.md "Stripe layout").
  static constexpr size_t kPiecePages = 320;
  static constexpr size_t kPieceWrites = 64;
  static constexpr size_t kPiecePartials = 16;
  // A compaction pass moves the live cells of at most kCompactSets stripes' worth (kCompactSets *
  // k pages): the compactor's worker is sized for that.
  static constexpr size_t kCompactSets = 8;

 private:
  struct PageEntry : spanstore::SpanOwner {
    spanstore::SpanSet* set = nullptr;  // null: never written or trimmed (reads as zeroes)
    int16_t member = 0;
    // Its cell failed authentication and nothing could rebuild it: counted in lost_bytes once
    // (readers hold the page shared, hence atomic); cleared when the page gets a new cell.
    std::atomic<bool> lost_counted{false};
    // CRC-32C of the cell as written (ciphertext when encrypted), for the offload's check of the
    // cells it moves; kept only with compaction_offload.
    uint32_t cell_crc = 0;
  };
  struct Worker;
  static constexpr size_t kNoPrimary = ~size_t{0};
  // One page a batch touches.
  struct PageIo {
    uint64_t page = 0;
    size_t op = 0;
    uint8_t* buf = nullptr;  // where the page is read to: the op's buffer, or the worker's scratch
    const uint8_t* src = nullptr;  // write: the page's new plaintext (the op's data, or buf)
    bool read = false;             // read it (a read op, or the read half of a read-modify-write)
    bool write = false;            // write buf as the page's new content
    bool release = false;          // trim / write-zeroes of the whole page
    uint32_t patch_at = 0, patch_len = 0;  // read-modify-write: bytes of the op to lay over it
    const uint8_t* patch = nullptr;        // null: zeroes (write-zeroes)
    uint8_t* copy_to = nullptr;            // sub-page read: where the asked bytes go
    // Another sub-page write of the same page in this batch (pages[primary]) reads and writes
    // the page; this one only lays its patch over that buffer (MergePartialWrites).
    size_t primary = kNoPrimary;
  };
  static constexpr size_t kLockStripes = 1024;

  StripeStore(client::Cluster* cluster, StripeStoreOptions options);
  Status Init();
  // ExecuteBatch's work on ops that fit the worker's buffers (kPiecePages, kPieceWrites,
  // kPiecePartials).
  void ExecutePiece(Worker& w, std::span<BlockOp> ops);
  // Takes the stripes of `pages` in ascending order (exclusive where a page changes) / drops them.
  void LockPages(Worker& w, std::span<const PageIo> pages) NO_THREAD_SAFETY_ANALYSIS;
  void UnlockPages(Worker& w) NO_THREAD_SAFETY_ANALYSIS;
  // Sub-page writes of one page by several ops of a batch (different bytes: all must land) are
  // folded into the first: one read, every patch laid over its buffer, one write.
  void MergePartialWrites(Worker& w);
  // Reads (and opens) the pages marked `read` into their bufs; zeroes for unwritten pages. Page
  // locks held. Errors go to op_status[page.op].
  void ReadPages(Worker& w, std::span<PageIo> pages, std::span<Status> op_status);
  // After a cell of `page` read from (set, member) into buf failed to open: reports it and reads
  // it again from the other members. An error for exactly that page if nothing opens.
  Status RecoverCell(Worker& w, uint64_t page, spanstore::SpanSet* set, int member, uint8_t* buf);
  // Writes the pages marked `write` as full sets (k at a time), points the table at the new
  // cells and releases the old ones. Page locks held exclusively.
  void WritePages(Worker& w, std::span<PageIo> pages, std::span<Status> op_status);
  void ReleaseCell(uint64_t page);  // page lock held exclusively
  // Compaction offload of the pages marked `write` (locked exclusively, each with a cell): new
  // sets assembled by the daemons, the entries swapped. False (nothing changed) if the offload
  // failed and the caller must move the bytes itself.
  bool CompactOffloaded(Worker& w, std::span<PageIo> pages) REQUIRES(compact_pass_mu_);
  // Reads page `page` from the backup file into buf and opens it: the copy of a page whose cell
  // cannot be produced. Page lock held.
  Status ReadBackup(Worker& w, uint64_t page, uint8_t* buf);
  // RemoteStore gave up members of `group`: logs the export pages whose cells were there, as
  // byte ranges ("... are LOST (export bytes A..B, C..D)": tests/support/lost_ranges.h parses
  // them). The recovery thread, no lock held.
  void LogLostPages(uint32_t group, std::span<spanstore::SpanOwner* const> spans);
  // The compaction thread also runs the capacity check, every reconcile_interval.
  void CompactLoop();
  bool CompactionWanted() const;
  // The capacity check (CheckRunningCapacity) with the slabs this export still needs: the slab
  // groups a fully packed export holds that it does not lease yet, plus members to re-protect.
  void CheckCapacity();

  client::Cluster* cluster_;
  StripeStoreOptions options_;
  uint64_t pages_ = 0;
  std::unique_ptr<spanstore::RemoteStore> remote_;
  std::unique_ptr<PageCrypto> crypto_;  // null: --no-encrypt
  std::unique_ptr<BackupFile> backup_;  // null: no --backup
  // The page table: entries guarded by locks_[page % kLockStripes] (see the header comment).
  std::unique_ptr<PageEntry[]> table_;
  std::unique_ptr<SharedMutex[]> locks_;
  std::atomic<uint64_t> live_pages_{0};

  WorkerPool<Worker> workers_;  // its background worker is the compactor's

  Mutex compact_pass_mu_;  // one compaction pass at a time (held across its I/O)
  Clock::time_point last_offload_log_ GUARDED_BY(compact_pass_mu_){};
  Mutex compact_mu_;  // the compaction thread's wake-up
  CondVar compact_cv_;
  bool stopping_ GUARDED_BY(compact_mu_) = false;
  std::thread compact_thread_;

  std::atomic<uint64_t> integrity_failures_{0};
  std::atomic<uint64_t> backup_reads_{0};
  std::atomic<uint64_t> lost_pages_{0};  // pages whose cell failed to open, unrecoverable
  std::atomic<uint64_t> write_retries_{0};
  std::atomic<uint64_t> sets_written_{0};
  std::atomic<uint64_t> short_sets_{0};
  std::atomic<uint64_t> compactions_{0};
  std::atomic<uint64_t> pages_compacted_{0};
  std::atomic<uint64_t> compaction_offloaded_sets_{0};
  std::atomic<uint64_t> compaction_offload_fallbacks_{0};
  std::atomic<uint64_t> compaction_bytes_sent_{0};
  std::atomic<uint64_t> compaction_bytes_received_{0};
  std::atomic<uint64_t> compaction_cpu_ns_{0};
  std::atomic<uint64_t> cluster_free_slabs_{0};  // the last capacity check's
  std::atomic<uint64_t> slabs_needed_{0};
};

}  // namespace farmem::blockdev
