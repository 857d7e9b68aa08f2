// PageStore: the export's address space kept in remote slabs — farmem-nbd's real backend.
//
// The export is cut into extents. An extent is mapped to a group of leases on first write
// (Infiniswap's lazy mapping), placed by the client core on distinct daemons:
//   none          1 lease;   extent = 1 slab of export space
//   replicate:N   N leases;  each a full copy
//   ec:k+r        k+r leases; every 4 KiB page is split into k fragments of 4096/k bytes plus r
//                 parity fragments; member j holds fragment j of every page of the extent, so a
//                 run of pages is one contiguous range on every member (Hydra)
// A per-extent bitmap records which pages hold data: pages never written (or trimmed) read as
// zeroes without a remote read; an extent whose pages are all trimmed gives its leases back.
//
// Reads: none reads its one copy; replicate reads one replica and falls back to the others; ec
// asks all live members and finishes a page as soon as any k fragments arrived (late binding),
// decoding only when a data fragment is missing. Fragments land in per-worker staging memory so
// that stragglers never write into a buffer the caller got back.
// Writes are acknowledged when every live member of the group has them and the group is whole, or
// no daemon is left to make it whole (then the log says the group runs degraded). A member whose
// daemon failed is rebuilt on another daemon from the survivors: in the background when the
// client core reports the failure, synchronously when a write finds it (unless a copy of that
// extent already runs: it copies that write too).
// Eviction notices: a member whose daemon sends EVICT_NOTICE (memory pressure, a drain) is
// "leaving", not lost: it stays live for reads and writes while the rebuild thread, in deadline
// order, copies it to a new lease on another daemon (never the one that sent the notice, nor one
// draining or under pressure), from the leaving member itself (the only copy in none; the
// cheapest in replicate and ec, which fall back to the other members if it fails), swaps the new
// lease in and frees the old one (FREE is the acknowledgement). Nothing runs degraded and, in
// every mode, nothing is lost when the move beats the deadline. When no daemon has room the log
// names the extents; at the deadline the member becomes a lost member as below (re-protected from
// the others or the backup file; in none without a backup its pages read as IoError).
// Member copies (a rebuild or a move) hold the extent shared while they copy, so I/O goes on:
// writes meanwhile mark their pages dirty, and the copy redoes those pages, exclusively only at
// the very end, just before it swaps the member in. A copy whose source or target daemon is
// declared down is abandoned within client::kDownCheckInterval, not at op_timeout.
// Re-protection: a degraded extent (a member lost, or mapped on fewer daemons than its group
// needs because not enough were up) gets its missing members back as soon as a daemon that is up,
// has room and holds no other member of the group is reachable: the rebuild thread tries when a
// member fails, when the client core reports a daemon up (returning, restarted empty, or new from
// DNS), and every reconcile_interval (room freed on a daemon, a rebuild that failed earlier).
// New extents are mapped degraded when fewer daemons than the group size can take a slab, as
// long as the mode can still read them back (k members for ec:k+r, one otherwise).
// With a backup file (Infiniswap), every write also goes to the file; reads fall back to it when
// no remote copy can produce the data, and writes whose remote copies all failed complete from it.
// Data that truly cannot be produced is an IoError naming the pages.
//
// Threading: every BlockBackend method may be called concurrently. Each call checks out a Worker
// (channels to the daemons + staging memory, all allocated up front) for its duration, so no two
// threads share a channel and the request path does not allocate. Extents are guarded by
// reader/writer locks: I/O takes them shared for a round, and so does a member copy while it
// copies; unmap, and a member copy's last pages and swap, take one exclusively. One member copy
// per extent at a time (Extent::copy_mu).
// Read-modify-writes of partly written pages are serialized by their own lock (partial_mu_).
// The locks are farmem::Mutex / SharedMutex, checked by clang's thread-safety analysis.
//
// Files: page_store.cc (setup, the BlockBackend entry points, splitting requests into pieces),
// page_store_extents.cc (the extent map), page_store_round.{h,cc} (the I/O round: a worker's
// channels, Round, RunPieces), page_store_rebuild.cc (failures, rebuild, re-protection, the
// capacity check), page_store_move.cc (member copies, eviction moves), page_store_internal.h (the
// types they share); resilience parsing is client/resilience.h, shared with far_ptr.
#pragma once

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "backup_file.h"
#include "farmem/blockdev/block_backend.h"
#include "farmem/blockdev/write_cache.h"
#include "farmem/client/cluster.h"
#include "farmem/client/resilience.h"
#include "farmem/common/aead.h"
#include "farmem/common/mutex.h"
#include "farmem/ec/reed_solomon.h"
#include "page_crypto.h"
#include "worker_pool.h"

namespace farmem::blockdev {

namespace pagestore {  // page_store_internal.h, page_store_round.h
struct Extent;
struct Piece;
struct Worker;
struct Early;
struct RoundParams;
}  // namespace pagestore

// How the page store protects an extent: client::Resilience, the one parser and meaning of none /
// replicate:N / ec:k+r shared with far_ptr (k = 1, r = N - 1 for replicate), plus one rule of the
// page store's own: ec:k+r cuts a 4 KiB page into k equal fragments, so k must divide 4096.
struct Resilience : client::Resilience {
  Resilience() = default;
  Resilience(const client::Resilience& r) : client::Resilience(r) {}  // NOLINT: same value
  // client::Resilience::Parse, then Check.
  static Result<Resilience> Parse(std::string_view text);
  // The page store's own rule (PageStore::Create checks it too, for options built in code).
  static Status Check(const client::Resilience& res);
};

struct PageStoreOptions {
  uint64_t size = 0;  // export size, a multiple of 4096
  Resilience resilience;
  std::string backup_path;  // empty: no backup file
  // Concurrent callers served without waiting: connection threads and the write cache's flusher.
  // Each worker's buffers are allocated at start and locked in swap-safe mode (its ciphertext
  // buffer, 256 KiB, and with ec:k+r its round's staging, 384 KiB for ec:4+2), so this is a
  // footprint figure (docs/nbd.md "Memory footprint"): 4 serve three busy connections and the
  // flusher; a swap device has one connection. It was 8 until 2026-12-03.
  size_t workers = 4;
  std::chrono::milliseconds op_timeout{5000};
  // How long a request waiting for one daemon spins before it sleeps (client::ChannelSet::
  // SetBusyPoll; at most ChannelSet::kMaxBusyPoll). Not for the rebuild thread.
  std::chrono::microseconds busy_poll{0};  // checked by CheckBusyPoll
  // How often the rebuild thread looks for degraded extents that events did not bring up (a
  // daemon freed memory, a rebuild failed for lack of room) and checks the cluster's capacity.
  std::chrono::milliseconds reconcile_interval{3000};
  // At start, how long to wait for the minimum number of live daemons (k for ec:k+r, else 1)
  // before Create fails.
  std::chrono::milliseconds startup_wait{10000};
  // Every page is sealed with AES-256-GCM before it leaves the process (remote members, parity
  // and the backup file hold ciphertext) and authenticated when read (page_crypto.h,
  // docs/security.md). `data_key`: the export's key (a data key file); empty: a fresh one.
  bool encrypt = true;
  std::optional<aead::Key> data_key;
  PageCrypto::SealObserver seal_observer;  // tests: every (domain, counter, page) sealed
};

// A store's busy-poll option (PageStoreOptions, StripeStoreOptions): 0 (off) to
// client::ChannelSet::kMaxBusyPoll.
Status CheckBusyPoll(std::chrono::microseconds busy_poll);

struct PageStoreStats {
  uint64_t extents_mapped = 0;
  uint64_t degraded_reads = 0;  // reads that needed decoding, another replica or the backup
  uint64_t backup_reads = 0;
  uint64_t rebuilds = 0;  // members rebuilt on another daemon
  uint64_t write_retries = 0;
  // Re-protection (see "Re-protection" above, page_store_rebuild.cc and docs/nbd.md).
  uint64_t degraded_extents = 0;     // now: mapped extents with a member missing
  uint64_t degraded_maps = 0;        // extents mapped on fewer daemons than their group needs
  uint64_t reprotected_extents = 0;  // degraded extents made whole again
  uint64_t rebuilt_bytes = 0;        // bytes written to replacement members
  uint64_t degraded_episodes = 0;    // times the store went from whole to degraded
  // Eviction notices (see "Eviction notices" above).
  uint64_t moved_members = 0;  // leaving members copied to another daemon and freed in time
  uint64_t moved_bytes = 0;
  // Leaving members not moved: their deadline passed, or they failed first. Handled as lost
  // members (re-protected from the others, or lost).
  uint64_t moves_missed = 0;
  // From the first notice of a burst until its last leaving member was moved, and how much.
  uint64_t last_move_ms = 0;
  uint64_t last_move_bytes = 0;
  // Member copies (rebuilds and moves) given up on: a source or the target failed or was
  // declared down, or the extent changed under them. Retried later.
  uint64_t copies_abandoned = 0;
  // The last time the store became whole again: how long it had been degraded (first member
  // lost, or first degraded mapping), and how long the re-protection itself took (from the start
  // of the first rebuild that found a daemon to take a member).
  uint64_t last_degraded_ms = 0;
  uint64_t last_reprotect_ms = 0;
  uint64_t last_reprotect_bytes = 0;
  // The last capacity check (every reconcile_interval): free slabs on the live daemons, and the
  // slabs this export still needs to map everything it does not hold yet and re-protect what is
  // degraded.
  uint64_t cluster_free_slabs = 0;
  uint64_t slabs_needed = 0;
  // Since start: bytes of written pages declared lost (their only copies died and nothing could
  // rebuild them). Must stay 0 within the resilience's tolerance.
  uint64_t lost_bytes = 0;
  // Since start: reads of a page whose copy failed authentication (a lender or the network
  // changed it), each served from the other members or the backup file, or answered with an
  // error for exactly that page; never returned.
  uint64_t integrity_failures = 0;
  // Members that failed (their daemon declared down, or a data-path error) and were used again
  // as they were: the same daemon process answered with their lease, and no write went past
  // them meanwhile. A false down costs no rebuild for them.
  uint64_t revalidated_members = 0;
  // Now (read-only view for status and metrics): the rebuild thread is running a pass or has
  // extents queued; and, in the current degraded episode, how many extents were made whole so far,
  // for how long re-protection has been running and the store degraded (0: not degraded).
  bool rebuild_running = false;
  uint64_t rebuild_queued = 0;
  uint64_t episode_reprotected_extents = 0;
  uint64_t episode_reprotect_ms = 0;
  uint64_t episode_degraded_ms = 0;
};

class PageStore final : public BatchBackend {
 public:
  static Result<std::unique_ptr<PageStore>> Create(client::Cluster* cluster,
                                                   PageStoreOptions options);
  ~PageStore() override;

  uint64_t size() const override { return options_.size; }
  Status Flush() override;
  void ExecuteBatch(std::span<BlockOp> ops, BatchListener* listener = nullptr) override;

  bool can_flush() const override { return true; }
  bool can_fua() const override { return true; }
  bool can_trim() const override { return true; }
  bool can_write_zeroes() const override { return true; }
  bool can_multi_conn() const override { return true; }  // no per-connection cache

  // The write cache in front of the store (farmem-nbd's default) holds whole-page writes of
  // fewer than kHeldWritePages pages too, and sends them in its write-back batches of 64 pages:
  // per page, a share of one message per daemon instead of one per NBD batch. Measured with
  // `none` (docs/benchmarks-nbd.md, 2026-12-05): 4 KiB random writes at depth 16 cost 16.4
  // instead of 20.3 µs of CPU (farmem-nbd and daemons), at depth 1 28.9 instead of 73.0.
  static constexpr size_t kHeldWritePages = 16;
  void TuneWriteCache(WriteCacheOptions& o) const { o.absorb_writes_below_pages = kHeldWritePages; }

  PageStoreStats stats() const EXCLUDES(stats_mu_);
  const Resilience& resilience() const { return options_.resilience; }
  bool encrypted() const { return crypto_ != nullptr; }
  // The export's page encryption (null with encrypt off), for tests.
  const PageCrypto* crypto() const { return crypto_.get(); }
  uint64_t extent_bytes() const { return extent_bytes_; }
  // Waits until no rebuild is queued or running (for tests and the demo).
  void WaitForRebuilds() EXCLUDES(rebuild_mu_);
  // The leases extent `index` is mapped to now (empty when unmapped), for tests and tools.
  std::vector<client::Lease> extent_members(uint64_t index) const;

 private:
  using Extent = pagestore::Extent;
  using Piece = pagestore::Piece;
  using Worker = pagestore::Worker;
  using Early = pagestore::Early;

  PageStore(client::Cluster* cluster, PageStoreOptions options);
  Status Init();
  // ExecuteBatch's work on a group of ops that fits the worker's buffers (kBatchOps ops,
  // Worker::kGroupPieces pieces, kSealedReserve bytes of aligned writes with encryption).
  void ExecuteGroup(Worker& w, std::span<BlockOp> ops, BatchListener* listener);
  // The most pieces SplitPieces can make of `op` in ExecuteGroup (0: it is not split).
  size_t MaxPiecesOf(const BlockOp& op) const;

  // One read or write, split into pieces that each stay inside one extent and one round.
  Status DoRead(Worker& w, uint64_t offset, std::span<uint8_t> buf);
  Status DoWrite(Worker& w, uint64_t offset, std::span<const uint8_t> data, bool fua);
  Status DoZero(Worker& w, uint64_t offset, uint64_t length, bool may_trim, bool fua);

  // Runs page-aligned pieces in rounds (page_store_round.cc); sets the status of the ops they came
  // from. With `early`, ops whose pieces all succeed are reported to its listener while the round
  // still waits.
  void RunPieces(Worker& w, std::vector<Piece>& pieces, std::span<Status> op_status, int attempt,
                 Early* early = nullptr);
  // Handles one page that an op covers only partly: read, patch, write back (exclusive lock).
  Status PartialPage(Worker& w, uint64_t page_offset, uint64_t at, std::span<uint8_t> read_into,
                     std::span<const uint8_t> write_from);
  // ---- page encryption (page_store_integrity.cc) ----
  // Seals the pages of [offset, offset + len) (page multiples) from `plain` into `out` and writes
  // `out` to the backup file, if any. On success the pages count as written in flight until
  // EndWrites; on failure nothing is left in flight.
  Status SealPages(Worker& w, uint64_t offset, const uint8_t* plain, uint64_t len, uint8_t* out);
  // Ends the sealed writes of [offset, offset + len): `ok` when the members acknowledged them
  // (their seals become the pages' recorded ones; PageCrypto::EndWrite).
  void EndWrites(uint64_t offset, uint64_t len, bool ok);
  // Opens the written pages of a piece read from the backup file in place.
  Status OpenFromBackup(Worker& w, Piece& p);
  // A page of a piece of the round that just ran failed authentication (held shared, channels
  // idle): finds a copy that opens — another replica, a decode without the bad members, the
  // backup file — into the piece's buffer, marks the members that gave a bad copy failed (they
  // are re-protected), counts and logs it. An error for exactly that page when no copy opens.
  Status RecoverPage(Worker& w, Piece& p, uint64_t page);
  // Candidates for RecoverPage: reads every live member's copy of the page and looks for one
  // that opens (replicas one by one; ec: each k-subset of the fragments read). On success the
  // plaintext is in `out` and *bad has the members whose copy disagrees with it.
  bool FindGoodCopy(Worker& w, Extent& e, uint64_t index, uint64_t page, uint8_t* out,
                    uint32_t* bad);
  // A page that no copy opens (RecoverPage's error) while the integrity log is rate-limited: it
  // is kept, merged into ranges, and named by FlushLostPages — every such page is named, in
  // lines the rate limit allows (one per range of consecutive pages of an extent).
  void NoteLostPage(uint64_t global_page) EXCLUDES(lost_pages_mu_);
  // Logs the pages NoteLostPage kept ("N pages of extent E (export bytes A..B) are LOST ...", the
  // format of every lost range) if the last such flush was `kLostPagesPeriod` ago, or `force`
  // (shutdown). Called by the rebuild thread on each periodic tick.
  void FlushLostPages(bool force) EXCLUDES(lost_pages_mu_);
  // Appends the page-aligned pieces of [offset, offset+len) (both page multiples).
  void SplitPieces(uint64_t offset, uint64_t len, uint8_t* buf, bool write, size_t op,
                   std::vector<Piece>* out);

  // The extent map (page_store_extents.cc).
  Status MapExtent(uint64_t index) EXCLUDES(map_mu_);
  void UnmapIfEmpty(uint64_t index) EXCLUDES(map_mu_);
  // The fewest members an extent can live with: k for ec:k+r, one otherwise.
  int MinMembers() const;
  // Leases of `members` that are real (not placeholders of a degraded mapping), to be freed.
  static std::vector<client::Lease> HeldLeases(std::span<const client::Lease> members);

  // ---- failures, rebuild and re-protection (page_store_rebuild.cc) ----
  // Rebuilds the extent's failed members on other daemons (CopyMember). With !wait (a request
  // path), returns at once if another member copy of the extent is running: that copy redoes
  // what the caller wrote.
  Status RebuildExtent(Worker& w, uint64_t index, bool wait = true);
  // The extent (e.mu held) has too few live members to serve a piece, but a failed member may
  // still come back as it was: its daemon was declared down and may answer again as the same
  // process within its lease TTL (kRetained), or it failed on the data path of a daemon still up
  // and has missed no write (the reconcile pass revalidates it, or the daemon is declared down).
  bool MembersMayReturn(const Extent& e) const;
  // Waits (no extent lock held) until each of these extents can serve again or none of its
  // failed members may come back, at most until `deadline`. Woken by what can change the answer
  // (NoteMembersChanged). True if none still waits.
  bool WaitForMembers(std::span<Extent* const> extents, Clock::time_point deadline) const
      EXCLUDES(rebuild_mu_);
  // Something that can end a WaitForMembers happened: a cluster event (a lease came back or was
  // given up, a daemon came up or went down), a rebuild pass ended (members revalidated or
  // rebuilt), an extent was unmapped.
  void NoteMembersChanged() EXCLUDES(rebuild_mu_);
  // How long a request may wait for members to come back: the longest lease TTL of the daemons
  // (a retained lease is resolved by then), plus the reconcile interval.
  std::chrono::milliseconds MemberReturnWait() const;
  void OnClusterEvent(const client::Event& ev) EXCLUDES(rebuild_mu_);
  void HandleClusterEvent(const client::Event& ev) EXCLUDES(rebuild_mu_);
  // ---- member copies, shared by rebuild and moves (page_store_move.cc) ----
  // Reads [offset, offset+len) of the members `which` at once (one op on each member's channel,
  // all in flight together); member m's bytes land at base + m * len.
  Status ReadMembers(Worker& w, Extent& e, std::span<const int> which, uint64_t offset,
                     uint8_t* base, size_t len);
  // Member j's bytes of pages [first, first + npages) of extent `index` (e.mu held): from member
  // j itself while it is live (a leaving member), else from the other members (replica / decode),
  // else from the backup file. *out points into `buf`.
  Status ProduceMember(Worker& w, uint64_t index, Extent& e, size_t j, uint64_t first,
                       uint64_t npages, std::vector<uint8_t>& buf, uint8_t** out);
  // Copies member j (now the lease `old`) of extent `index` to `fresh` and swaps `fresh` in (see
  // "Member copies" above). Caller holds e.copy_mu. Adds the bytes written to *bytes.
  Status CopyMember(Worker& w, uint64_t index, size_t j, const client::Lease& old,
                    const client::Lease& fresh, uint64_t* bytes);
  // Copies the runs of `pages` (ascending) of member j to `fresh`; with skip_unwritten, pages
  // that hold no data are left out. e.mu held (shared or exclusive).
  Status CopyPages(Worker& w, uint64_t index, Extent& e, size_t j, const client::Lease& fresh,
                   std::span<const uint64_t> pages, bool skip_unwritten, std::vector<uint8_t>& buf,
                   uint64_t* bytes);
  // ---- eviction notices (page_store_move.cc) ----
  struct NoticedLease {
    client::NodeId node;
    uint64_t id;
    Clock::time_point deadline;
    Clock::time_point noticed;
  };
  struct Move {
    uint64_t index;
    size_t member;
    client::Lease lease;  // the leaving member
    Clock::time_point deadline;
    Clock::time_point noticed;
  };
  // Marks the members the notices name as leaving and queues their moves (rebuild thread).
  void MarkLeaving(std::span<const NoticedLease> noticed);
  // Moves what is queued, earliest deadline first (rebuild thread). True if moves are left that
  // may still succeed before their deadline (no room yet, a copy failed).
  bool MoveLeaving(Worker& w) EXCLUDES(stats_mu_, rebuild_mu_);
  // What became of one move.
  struct MoveOutcome {
    enum class Kind {
      kMoved,  // copied to a new lease and the old one freed (or no longer a member: nothing to do)
      kLost,   // lost before it could be moved (a missed move): rebuilt like any lost member
      kNoRoom,  // no daemon could take the member now (status says why)
      kFailed,  // the copy failed (status): retried until the deadline
    };
    Kind kind = Kind::kMoved;
    Status status;
    uint64_t bytes = 0;  // copied to the new member
  };
  // One move: a new lease elsewhere, CopyMember, FREE of the old lease.
  MoveOutcome MoveMember(Worker& w, const Move& m);
  // Nodes that must not take a new member now: draining or under pressure (their last STAT).
  std::vector<client::NodeId> NodesNotTaking() const;
  void RebuildLoop() EXCLUDES(rebuild_mu_);
  void QueueRebuild(uint64_t index) EXCLUDES(rebuild_mu_);
  // Asks the rebuild thread for a pass over every degraded extent now.
  void RequestReconcile() EXCLUDES(rebuild_mu_);
  struct LostLease {
    client::NodeId node;
    uint64_t id;
  };
  // kLeasesReturned: uses again the members those leases are that are still failed, not stale
  // and not replaced (rebuild thread).
  void Revalidate(std::span<const LostLease> returned) EXCLUDES(stats_mu_);
  // Clears the failed bit of every member of `e` (only those `only` names, unless empty) that
  // MayRevalidate; takes e.mu exclusively. Returns how many.
  uint64_t RevalidateExtent(Extent& e, std::span<const LostLease> only);
  // Member j (e.mu held) failed, missed no write, and its lease is held on a daemon that is up
  // and not suspect: it can be used again as it is.
  bool MayRevalidate(const Extent& e, size_t j) const;
  // Marks the members `lost` names failed. With !wait (the cluster's event thread, which must not
  // block) extents locked exclusively now are left to a later pass with wait, which also queues
  // their rebuilds.
  void MarkLost(std::span<const LostLease> lost, bool wait) EXCLUDES(rebuild_mu_);
  // One rebuild-thread pass: rebuilds the members missing in `todo` (or in every degraded extent
  // with `all`) wherever a daemon is eligible; then, if the store is whole again, ends the
  // degraded episode (stats, log line).
  void Reprotect(Worker& w, std::vector<uint64_t> todo, bool all) EXCLUDES(rebuild_mu_, stats_mu_);
  // Warns (rate-limited) when the live daemons' free slabs fall short of what the export still
  // needs: unmapped extents at full group size plus missing members.
  void CheckCapacity() EXCLUDES(stats_mu_);
  // Bookkeeping of degraded episodes (stats_mu_): the store lost redundancy / rebuilt a member.
  void NoteDegraded() EXCLUDES(stats_mu_);
  void NoteRebuilt(uint64_t bytes, bool extent_whole, Clock::time_point started)
      EXCLUDES(stats_mu_);
  uint64_t CountDegraded() const;

  void CountStat(uint64_t PageStoreStats::*field, uint64_t n = 1) EXCLUDES(stats_mu_);

  client::Cluster* cluster_;
  PageStoreOptions options_;
  std::unique_ptr<ec::ReedSolomon> codec_;
  // What a Round needs of the store (codec_, resilience, frag_size_, op_timeout), set by Init.
  std::unique_ptr<pagestore::RoundParams> round_params_;
  std::unique_ptr<BackupFile> backup_;
  std::unique_ptr<PageCrypto> crypto_;  // null: --no-encrypt
  uint64_t slab_size_ = 0;
  uint64_t extent_bytes_ = 0;
  uint64_t max_piece_ = 0;     // export data of one piece: kMaxPiece, or kRoundBytes with ec (Init)
  uint32_t frag_size_ = 4096;  // bytes of one page on one member
  std::vector<std::unique_ptr<Extent>> extents_;
  client::SubscriptionId subscription_ = 0;

  // Serializes mapping/unmapping decisions (it guards the decision, not a member: an extent's
  // members are published by Extent::mapped). A leaf lock: taken after an extent's lock, never
  // waits on one.
  Mutex map_mu_;
  // Serializes read-modify-write of partly written pages (guards the pages' contents, not a
  // member). Taken before any extent lock.
  Mutex partial_mu_;

  WorkerPool<Worker> workers_;  // filled by Init; its background worker is the rebuild thread's

  mutable Mutex rebuild_mu_;
  CondVar rebuild_cv_;
  std::deque<uint64_t> rebuild_queue_ GUARDED_BY(rebuild_mu_);
  std::vector<LostLease> lost_leases_ GUARDED_BY(rebuild_mu_);      // from cluster events
  std::vector<LostLease> returned_leases_ GUARDED_BY(rebuild_mu_);  // kLeasesReturned
  std::vector<NoticedLease> noticed_ GUARDED_BY(rebuild_mu_);       // EVICT_NOTICE events
  // The rebuild thread's own: moves still to do, and the burst they belong to (for the stats).
  std::vector<Move> moves_;
  Clock::time_point move_burst_since_ = Clock::time_point::max();
  uint64_t move_burst_bytes_ = 0;
  bool reconcile_requested_ GUARDED_BY(rebuild_mu_) = false;  // a daemon came up
  bool rebuilding_ GUARDED_BY(rebuild_mu_) = false;
  bool stopping_ GUARDED_BY(rebuild_mu_) = false;
  // WaitForMembers' wake-up: member_changes_ counts NoteMembersChanged calls, so that a change
  // between a waiter's look at the extents and its wait is not missed.
  mutable CondVar members_cv_;
  uint64_t member_changes_ GUARDED_BY(rebuild_mu_) = 0;
  std::thread rebuild_thread_;

  // Pages that failed authentication on every copy and are not named in the log yet (first page
  // -> one past the last, consecutive pages merged), and when they were last named.
  Mutex lost_pages_mu_;
  std::map<uint64_t, uint64_t> lost_pages_ GUARDED_BY(lost_pages_mu_);
  Clock::time_point lost_pages_logged_ GUARDED_BY(lost_pages_mu_){};

  mutable Mutex stats_mu_;
  PageStoreStats stats_ GUARDED_BY(stats_mu_);
  // The current degraded episode: since when, and since when a rebuild has been making progress;
  // max() when none.
  Clock::time_point degraded_since_ GUARDED_BY(stats_mu_) = Clock::time_point::max();
  Clock::time_point reprotect_since_ GUARDED_BY(stats_mu_) = Clock::time_point::max();
  uint64_t episode_bytes_ GUARDED_BY(stats_mu_) = 0;
  uint64_t episode_extents_ GUARDED_BY(stats_mu_) = 0;
  // stats_.revalidated_members when the episode began: the members it used again as they were.
  uint64_t episode_revalidated_from_ GUARDED_BY(stats_mu_) = 0;
};

}  // namespace farmem::blockdev
