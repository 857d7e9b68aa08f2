// RemoteStore: where swapped-out spans live — span sets in rows of slab groups on the daemons.
// One owner of the span-set layout for both borrowers: far_ptr (spans of objects, farptr/) and
// farmem-nbd's stripe layout (4 KiB pages, blockdev/src/stripe_store.h). A span is span_size
// bytes the borrower hands over whole; what it means is the borrower's (SpanOwner).
//
// A group is k + r slabs on k + r distinct daemons (one client::Cluster::AllocateGroup). A slab
// is cut into rows of span_size bytes; row i of member j is the j-th cell of the span set that
// owns row i. Members 0..k-1 hold data spans, members k..k+r-1 parity (erasure) or copies
// (replicate: k = 1, every member holds the same bytes; none: k = 1, r = 0).
//
//   WriteSet   k spans (fewer: the rest are zero and born as holes) + their parity, written to
//              the k + r members in one batch (one doorbell per daemon).
//   ReadSpan   one read of one cell from its one daemon; no decode. If that daemon is gone:
//              read k survivors (holes included: their bytes stay on the daemon until the row is
//              freed, so parity still covers them) and rebuild the cell (degraded read).
//   Release    a data cell whose span was swapped in or died becomes a hole; a row whose k data
//              cells are all holes is freed; a group with no rows in use goes back to the
//              daemons.
// Leaving members (an EVICT_NOTICE: the daemon needs the slab back, by a deadline) are still read
// and are moved, in every resilience mode including none (remote_store_move.cc): their rows are
// copied to a new slab on another daemon with room (never the one that noticed, nor a draining
// or pressed one), the member is swapped and the old lease freed, earliest deadline first.
// Failed members (node down, leases lost, I/O error) are re-protected in the
// background: a new slab on any live daemon with room that holds none of the group's surviving
// members (a daemon that came back — restarted empty on its port, or that lost its leases —
// qualifies), each used row's cell rebuilt from survivors and written there. A group that finds
// no such daemon waits for the next node-up event from the cluster, or for the periodic
// reconcile (which also catches members whose daemon went down or restarted without an event
// reaching us, and daemons that freed memory). With none, a failed member's spans are lost:
// ReadSpan says which.
//
// Degraded writes: when k + r daemons cannot be had (some are down or still starting, or full),
// a group is made of as many as can (at least k for erasure, one for replicate); the members it
// lacks are vacant (lease id 0) and counted failed from the start, so re-protection places them
// like any lost member once a daemon appears. Below that minimum WriteSet fails.
//
// Rows are placed in the fullest group that has room, so groups left sparse by swap-ins drain
// and return to the daemons once compaction moves their last sets.
//
// Threads: every method may be called from any thread. mu_ guards the group/set bookkeeping and
// is never held across network I/O; each caller brings its own IoContext (channels are
// single-threaded).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <thread>
#include <unordered_map>
#include <vector>

#include "farmem/client/channel_set.h"
#include "farmem/client/cluster.h"
#include "farmem/client/resilience.h"
#include "farmem/common/mutex.h"
#include "farmem/ec/reed_solomon.h"

namespace farmem::spanstore {

struct Group;

// A span set is spread over at most this many daemons (k + r): its members are kept in fixed
// arrays on the request path. Each borrower's resilience parser enforces it (far_ptr's
// SpanResilience, farmem-nbd's stripe layout); Create checks it too.
inline constexpr int kMaxSetWidth = 16;
// At most this many reads go out together in one round (one ReadSpans: one doorbell per daemon,
// the round trips overlapping), and RunOps runs that many at once; a caller with more cuts them
// into rounds of this size. It is sized for the largest batch a borrower reads at once:
// farmem-nbd's write cache fills a write-back batch of 64 pages in one round; far_ptr's
// Heap::FetchMany takes the misses of far_hash_map::get_many's 32-key slices in one.
inline constexpr int kMaxReadRound = 64;
static_assert(kMaxReadRound >= kMaxSetWidth);

// What a data cell holds, as its borrower knows it: an opaque owner the store only keeps and
// hands back (SpanSet::spans, CompactionCandidates), never dereferences. A borrower's own type
// derives from it (far_ptr's Span, farmem-nbd's page-table entry) and casts back.
struct SpanOwner {};

// True for the codes after which a member's slab is taken to be gone (its daemon died, restarted,
// or dropped the lease): the member is then failed and re-protected.
bool NodeGone(const Status& s);

// One span set: a row of one group. Made with its group, one per row, and kept while the group
// lives: a row taken for a new set reuses it (32 bytes + 8 per data member, so that a group of
// 64 MiB slabs of 4 KiB cells costs 1 MiB at ec:4+2, where a fixed array of kMaxSetWidth owners
// cost 2.5 MiB: 10 MiB per GiB of data stored).
struct SpanSet {
  Group* group = nullptr;  // null while the row is free
  uint32_t row = 0;
  uint32_t live_mask = 0;  // data members whose span still lives here (not holes)
  uint32_t id = 0;         // for messages
  bool writing = true;     // reserved, its cells not all written yet: re-protection skips it
  // Data member -> its owner (null: hole): the row's k entries of Group::owners.
  SpanOwner** spans = nullptr;
};

// A member that was never placed (a degraded group made with fewer daemons than k + r).
inline bool Vacant(const client::Lease& l) { return l.grant.lease_id == 0; }

// A group's members as a writer or a reader saw them under the lock (the first k + r entries):
// a copy on the caller's stack, so the request path copies no std::vector (swap safety).
using SetMembers = std::array<client::Lease, kMaxSetWidth>;

struct Group {
  uint32_t id = 0;
  std::vector<client::Lease> members;  // k + r; Vacant() ones were never placed (failed)
  std::vector<uint64_t> daemon_ids;    // each member's daemon incarnation (HELLO id) when placed
  std::vector<Clock::time_point> failed_since;  // when each failed member failed (or was vacant)
  uint32_t failed_mask = 0;   // members whose slab is gone (or vacant), not yet re-protected
  uint32_t lost_mask = 0;     // members given up for good (none, or too many failures)
  uint32_t evicted_mask = 0;  // noticed for eviction: not re-placed on that daemon
  uint32_t leaving_mask = 0;  // noticed, still readable, waiting to be moved (no new rows here)
  // Failed members that missed a span set written degraded meanwhile: rebuilt, never used
  // again as they are even if their daemon answers again with the lease (kLeasesReturned).
  uint32_t stale_mask = 0;
  // One span set per row (RemoteStore::rows_per_group_), made with the group (the slabs' rows bound
  // the sets that can live here): taking and freeing a row allocates nothing (swap safety,
  // docs/nbd.md). Row i is used while sets[i].group is set.
  std::unique_ptr<SpanSet[]> sets;
  std::unique_ptr<SpanOwner*[]> owners;  // k per row: sets[i].spans is owners + i * k
  // The rows by live data members: bitmap c - 1 (RemoteStore::live_words_ words each, k in all)
  // has bit r set when row r holds a committed set with c live members (c >= 1). The compactor
  // finds the emptiest sets there without reading every row (RemoteStore::SetLiveLocked keeps
  // it; 2 KiB per bitmap for a group of 16,384 rows).
  std::unique_ptr<uint64_t[]> by_live;
  uint32_t used_rows = 0;
  // Every row below it is used: where the search for a free row starts (the stripe layout takes
  // and frees a row per stripe written, scattered over a group of thousands of rows).
  uint32_t first_free = 0;
  bool rebuilding = false;       // a member's cells are being rebuilt: no new rows are placed here
  bool in_recovery = false;      // the recovery thread holds it (it is not freed meanwhile)
  bool release_wanted = false;   // emptied while rebuilding / in recovery: free it after
  bool queued = false;           // in the recovery queue
  uint64_t epoch = 0;            // bumped whenever a member is replaced
  bool degraded_logged = false;  // recovery thread only: say "runs degraded" once

  // members as a reader or writer takes them under the store's lock.
  void CopyMembers(SetMembers* out) const {
    std::copy(members.begin(), members.end(), out->begin());
  }
  // Takes rows for complete sets (writers look here first): every member live, none leaving,
  // no rebuild running. Under the store's lock.
  bool TakesCompleteSets() const {
    return !rebuilding && leaving_mask == 0 && failed_mask == 0 && lost_mask == 0;
  }
};

// Per-thread I/O state: channels by node, scratch for parity and degraded reads. Made by
// RemoteStore::NewIoContext (or with the store's cluster and op timeout).
struct IoContext {
  IoContext(client::Cluster* cluster, std::chrono::milliseconds op_timeout)
      : channels(cluster, op_timeout, 64) {}

  client::ChannelSet channels;
  std::vector<uint8_t> scratch;  // (k + r) spans
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  // Parity offload: control connections by node (PARITY_ENCODE) and the frame bytes they moved.
  std::vector<std::unique_ptr<transport::TcpConnection>> calls;
  uint64_t offload_bytes_sent = 0;
  uint64_t offload_bytes_received = 0;
  std::vector<client::NodeId> open_scratch;  // RemoteStore::OpenChannels
  uint64_t channels_epoch = 0;               // the store's member epoch it last opened for
};

struct RemoteStoreStats {
  uint64_t sets = 0;
  uint64_t set_bytes = 0;
  uint64_t leased_bytes = 0;
  uint64_t degraded_reads = 0;
  uint64_t members_reprotected = 0;
  uint64_t rebuilt_bytes = 0;     // cells written to replacement members
  uint64_t sets_reprotected = 0;  // sets of groups made whole again (all their members back)
  // Data cells that lived (not holes) on members given up for good (nothing could rebuild them),
  // span_size bytes each, counted once when the member is given up.
  uint64_t lost_bytes = 0;
  uint64_t groups = 0;
  // Of those, groups with no set: the one leased ahead (lease_ahead) — a group is freed when its
  // last set is. Held, but nothing compaction could give back.
  uint64_t empty_groups = 0;
  uint64_t degraded_sets = 0;       // in groups with a failed member that can still be rebuilt
  uint64_t unrecoverable_sets = 0;  // in groups that lost more members than they survive
  uint64_t degraded_sets_written = 0;
  uint64_t reprotect_last_ms = 0;
  uint64_t reprotect_max_ms = 0;
  uint64_t members_failed = 0;   // members marked failed (each a degraded episode, or a loss)
  uint64_t members_moved = 0;    // noticed members copied to another daemon before the deadline
  uint64_t moved_bytes = 0;      // cells those moves copied
  uint64_t move_last_ms = 0;     // the last move: from the notice until the old lease was freed
  uint64_t move_last_bytes = 0;  // and the cells it copied
  uint64_t move_max_ms = 0;
  uint64_t move_min_slack_ms = 0;  // the least time left before a deadline when a move finished
  uint64_t moves_pending = 0;      // now: noticed members not moved yet
  // Noticed members that were not moved but marked failed (re-protected from the others, or
  // lost): the deadline passed, their daemon failed first, or no daemon had room and the group
  // could spare them (given up at once).
  uint64_t moves_missed = 0;
  // Member copies (re-protections and moves) given up on: a survivor, the source or the target
  // failed, or the group changed under them. Retried.
  uint64_t copies_abandoned = 0;
  // Now: failed members that re-protection still has to place (vacant ones included; members
  // given up for good are not placed again).
  uint64_t members_missing = 0;
  // Failed members used again as they were: their daemon was declared down (or failed an op)
  // but the same process answered again with the lease, and no set was written past them.
  uint64_t members_revalidated = 0;
  // Degraded episodes: from the store going from whole (no group missing a member that
  // re-protection still has to place) to degraded — a member failed, or a group was placed with
  // members missing — until it is whole again (re-protected, revalidated, given up for good, or
  // the degraded groups emptied). `degraded_episodes` counts them; the current one (0 when
  // whole): how long it has lasted, since when re-protection has been making progress (the start
  // of the first copy that succeeded), the sets made whole and the cells written so far; the
  // last one that ended: the same, final.
  uint64_t degraded_episodes = 0;
  uint64_t episode_degraded_ms = 0;
  uint64_t episode_reprotect_ms = 0;
  uint64_t episode_sets_reprotected = 0;
  uint64_t episode_rebuilt_bytes = 0;
  uint64_t last_episode_degraded_ms = 0;
  uint64_t last_episode_reprotect_ms = 0;
  uint64_t last_episode_rebuilt_bytes = 0;
  // Groups placed: by the recovery thread ahead of need (lease_ahead), and by a writer that
  // found no free row and placed one itself (the first group always; with lease_ahead, only
  // when writes outran the lease ahead or it failed).
  uint64_t groups_leased_ahead = 0;
  uint64_t groups_leased_by_writers = 0;
};

class RemoteStore {
 public:
  // `reconcile_interval`: how often the recovery thread looks for degraded groups and failed
  // members by itself (RuntimeOptions::reconcile_interval).
  // `lease_ahead`: when the complete groups' free rows fall below half a group, the recovery
  // thread leases the next group in the background, so that a writer finds rows waiting rather
  // than placing k + r slabs itself (one ALLOC after another, each populating a slab on its
  // daemon: tens of milliseconds at 64 MiB). It costs at most one group leased before it is
  // needed; off, a writer that runs out of rows places the next group itself.
  static Result<std::unique_ptr<RemoteStore>> Create(
      client::Cluster* cluster, client::Resilience res, uint32_t span_size,
      std::chrono::milliseconds op_timeout,
      std::chrono::milliseconds reconcile_interval = std::chrono::milliseconds(1000),
      bool lease_ahead = true);
  ~RemoteStore();

  const client::Resilience& resilience() const { return res_; }
  uint32_t span_size() const { return span_size_; }
  int k() const { return res_.k; }
  uint64_t slab_size() const { return slab_size_; }  // the daemons' (the first to answer STAT)

  // Writes data[0..n) (n <= k; null entries are zero spans that start as holes) as one span
  // set holding spans[i] at member i. `data` must stay unchanged until it returns. Retries on
  // other daemons when a write fails. Returns the set; live_mask has a bit per non-null entry.
  // Written degraded (members missing, re-protected later) when fewer than k + r daemons can
  // take it; fails when fewer than the minimum (k, or 1 for replicate) can.
  Result<SpanSet*> WriteSet(IoContext& io, std::span<const uint8_t* const> data,
                            std::span<SpanOwner* const> spans);
  // Several WriteSets at once (farmem-nbd's write batches): set i is data[i] / spans[i]. Every
  // set's row is reserved and its parity computed first, then all their cells go out in one batch
  // (one doorbell per daemon, kMaxBatchSets sets at a time), so their round trips overlap; a set
  // whose write failed is written again alone through WriteSet (retries included). out[i]: set i
  // or why it could not be written. io.scratch holds every set's parity meanwhile. 16: a write
  // cache write-back of 64 pages at k = 4 is one round (it was two at 8).
  static constexpr size_t kMaxBatchSets = 16;
  void WriteSets(IoContext& io, std::span<const std::span<const uint8_t* const>> data,
                 std::span<const std::span<SpanOwner* const>> spans,
                 std::span<Result<SpanSet*>> out);
  // WriteSet with parity offload (remote_store_offload.cc): the client writes only the k data
  // cells; each parity member's daemon reads them from their daemons and computes its own cell
  // (PARITY_ENCODE, docs/wire-protocol.md), so r spans are neither encoded nor sent here. If
  // anything in that fails (a daemon too old for PARITY_ENCODE, a peer it cannot reach, a member
  // lost meanwhile), the set is written the ordinary way (WriteSet) and *offload_error says why;
  // it stays OK when the offload worked.
  Result<SpanSet*> WriteSetOffloaded(IoContext& io, std::span<const uint8_t* const> data,
                                     std::span<SpanOwner* const> spans, Status* offload_error);
  // Compaction offload (remote_store_offload.cc): writes a new span set whose data cells the
  // daemons assemble themselves from pieces of existing cells (GATHER_CELL), and whose parity
  // they compute (PARITY_ENCODE): no span crosses the client. cells[i] lists the pieces of data
  // member i (spans[i]); members past cells.size() are zero. The source cells must not change
  // meanwhile (the compactor holds their spans' locks). Any error: nothing is committed, the
  // caller falls back to moving the bytes itself.
  // Each gathering daemon answers with the CRC-32C of every source cell as it read it and of the
  // cell it stored (farmem/common/wire_gather.h): a source whose checksum differs from the one
  // it was written with (GatherPiece::cell_crc) was corrupted on its daemon (a bit flip). Then
  // nothing is committed, the error is DataLoss, and *corrupt gets each such source (set,
  // member), for the caller to report (ReportCorrupt) and read rebuilt from the other members:
  // moved unopened, the corruption would become consistent with the new set's parity and the
  // old set, its good copy, would be freed. On success cell_crcs[i] is the checksum of data
  // cell i as stored. A daemon that sends no checksums (older) fails the call (Unimplemented).
  struct GatherPiece {
    SpanSet* set = nullptr;  // source: data member `member` of `set`
    int member = 0;
    uint32_t cell_crc = 0;  // CRC-32C of that whole source cell as it was written
    uint32_t src_offset = 0;
    uint32_t dst_offset = 0;
    uint32_t length = 0;
  };
  Result<SpanSet*> WriteSetGathered(IoContext& io, std::span<const std::vector<GatherPiece>> cells,
                                    std::span<SpanOwner* const> spans,
                                    std::span<uint32_t> cell_crcs,
                                    std::vector<std::pair<SpanSet*, int>>* corrupt);
  // A part of a cell: bytes [offset, offset + length). Length 0 (Piece{}): the whole cell.
  struct Piece {
    uint32_t offset;
    uint32_t length;
  };
  // Reads data member `member` of `set` into dst (span_size bytes); degraded if needed. Errors
  // say where the span lived; the caller adds what it was. With a `piece` (an object, not its
  // whole span: far_ptr's gathering miss), only that part of the cell is read, into dst[0,
  // piece.length) — so dst need not be a whole frame: a batch of pieces packs into one small
  // scratch area. A degraded read rebuilds the whole cell in io.scratch and copies the piece
  // out. A piece beyond the cell is InvalidArgument.
  Status ReadSpan(IoContext& io, SpanSet* set, int member, uint8_t* dst, Piece piece = {});
  // Several ReadSpans at once (the prefetcher's batch, FetchMany's round): up to kMaxReadRound
  // plain reads are posted together, one doorbell per daemon, so their round trips overlap
  // (beyond that, one by one: callers cut their batches into rounds); any that fails is retried
  // alone through ReadSpan (degraded if needed). results[i] is the status of read i.
  // With `pieces` (one per read, or empty for whole cells) read i fetches only its piece into
  // dsts[i] (piece.length bytes), as ReadSpan does.
  void ReadSpans(IoContext& io, std::span<SpanSet* const> sets, std::span<const int> members,
                 std::span<uint8_t* const> dsts, std::span<Status> results,
                 std::span<const Piece> pieces = {});
  // A cell read from data member `member` of `set` failed authentication or its checksum
  // (remote_store_integrity.cc). If the group can lose that member and still produce the span, the
  // member is marked failed — re-protected like a lost one — and true returned: ReadSpan then
  // rebuilds the cell from the other members. True also when the member is failed already (the
  // cell was read before that, e.g. a span swapped in whose objects are opened lazily): ReadSpan
  // rebuilds it all the same. False (none, or no redundancy left): the caller loses what failed.
  bool ReportCorrupt(SpanSet* set, int member, const Status& why);
  // Told the spans that were lost when a group's members are given up for good (more failed
  // than the resilience survives, their leases gone): every live data cell on those members,
  // by its owner, once. far_ptr learns it on deref; farmem-nbd's stripe layout has no deref to
  // wait for and names the export pages at once (a user must learn which bytes are gone before
  // reading them). Called from the recovery thread with no lock held; the owners are the ones
  // the cells had when they were given up (a borrower that rewrote a span meanwhile sees it
  // here all the same). Set it before the first WriteSet.
  using LostObserver = std::function<void(uint32_t group, std::span<SpanOwner* const> spans)>;
  void SetLostObserver(LostObserver observer);
  // Where data member `member` of `set` lies: (lease, byte offset of the cell) for the member
  // and, with replicate, for every copy. For tests (LocateObjectForTest).
  std::vector<std::pair<client::Lease, uint64_t>> CellPlaces(const SpanSet* set, int member) const;
  // Makes data member `member` a hole; frees the row / group when nothing is left.
  void Release(SpanSet* set, int member);
  // True if `set`'s group has no failed or lost member: a clean local span whose copy is cell
  // `member` of `set` may then be evicted by just dropping its frame.
  bool Healthy(const SpanSet* set) const;

  // For the compactor: the spans of sets that have holes, emptiest sets first, and then the
  // spans of the emptiest group when leased slabs exceed the rows in use by more than a group.
  // Snapshots: the caller locks each span and checks it still lives in a set.
  // Into `candidates` (cleared), which allocates nothing when it has room for max_spans. Reads
  // the groups' by_live bitmaps, not every row: O(groups x rows / 64) words at most.
  void CompactionCandidates(size_t max_spans, std::vector<SpanOwner*>* candidates);
  // For tests: every group's by_live bitmaps agree with its rows' live masks (O(rows)).
  bool LiveIndexConsistent() const;
  std::vector<SpanOwner*> CompactionCandidates(size_t max_spans) {
    std::vector<SpanOwner*> out;
    out.reserve(max_spans);
    CompactionCandidates(max_spans, &out);
    return out;
  }

  RemoteStoreStats stats() const;
  // Each slab group's daemons in member order (k data members, then parity / copies).
  std::vector<std::vector<Endpoint>> GroupLayout() const;
  // False if members still wait for re-protection or a move after `timeout` (groups beyond
  // tolerance do not count: nothing can rebuild them).
  bool WaitForRecovery(std::chrono::milliseconds timeout);
  void Shutdown();

  // Opens (once) the control connection to `node` in `io` that PARITY_ENCODE requests use.
  transport::TcpConnection* CallConnectionFor(IoContext& io, client::NodeId node, Status* error);
  // A thread's I/O state for this store.
  std::unique_ptr<IoContext> NewIoContext() const {
    return std::make_unique<IoContext>(cluster_, op_timeout_);
  }
  // Opens (once) the channel to `node` in `io`.
  transport::Channel* ChannelFor(IoContext& io, client::NodeId node, Status* error) {
    return io.channels.Get(node, error);
  }
  // Opens io's channels to every daemon that holds a member of this store's groups (those its
  // next reads and writes go to), where not open yet. For a caller about to hold locks across
  // its I/O (a compaction pass holds the pages or spans it moves): a channel opened there, under
  // load, costs a connect and a HELLO per daemon, tens of ms each, with everyone who wants those
  // locks waiting. Failures are left to the I/O that follows. Cheap when no group was placed and
  // no member replaced since io's last call (one atomic load): a request path may call it.
  void OpenChannels(IoContext& io);
  // True if a failure seen through io's channel to `node` is the channel's own: it was opened to
  // an earlier incarnation of the daemon (which restarted since) and broke. That says nothing of
  // members placed on the daemon there now; the channel is dropped, so a retry reopens it.
  bool StaleChannel(IoContext& io, client::NodeId node) { return io.channels.DropIfStale(node); }

 private:
  RemoteStore(client::Cluster* cluster, client::Resilience res, uint32_t span_size,
              std::chrono::milliseconds op_timeout, std::chrono::milliseconds reconcile_interval,
              bool lease_ahead);
  Status Init();

  // Members a span set needs to be written (and read) at all: k for erasure, else 1.
  int MinMembers() const { return res_.mode == client::Resilience::Mode::kErasure ? res_.k : 1; }
  // Reserves a free row in a healthy group (allocating a group if none has room); `members` and
  // `epoch` get the group's members and epoch as they were when the row was taken. With
  // `allow_degraded`, when no complete group can be had, a row of a group missing members (but
  // holding at least MinMembers()) instead; *absent gets the members not to write (failed or
  // vacant). Without it *absent is always 0.
  Result<SpanSet*> ReserveRow(bool allow_degraded, SetMembers* members, uint64_t* epoch,
                              uint32_t* absent);
  // A free row of a group that has room and no rebuild running: a healthy one, or (degraded) one
  // whose missing members still leave at least MinMembers(). Null if none.
  SpanSet* TakeRowLocked(bool degraded, SetMembers* members, uint64_t* epoch, uint32_t* absent)
      REQUIRES(mu_);
  // Adds a group over `leases` (k + r of them; Vacant() ones are failed from the start).
  void AddGroup(std::vector<client::Lease> leases);
  // lease_ahead: places the next complete group if the complete groups still have fewer than
  // half a group of free rows and no writer is placing one (recovery thread).
  void LeaseAhead();
  // Free rows in the groups a writer takes rows from first (Group::TakesCompleteSets).
  uint64_t FreeCompleteRowsLocked() const REQUIRES(mu_);
  // As many slabs on distinct daemons as can be had, at least MinMembers(): a degraded group.
  // `full_error` is why a complete group could not be had (quoted when this fails too).
  Result<std::vector<client::Lease>> AllocateDegraded(const Status& full_error);
  // cells[m] = data[m], or zeros_ where there is no span, for the k data members; returns the
  // mask of members that hold a span.
  uint32_t DataCells(std::span<const uint8_t* const> data, const uint8_t** cells) const;
  // DataCells, then parity (computed into `parity`, r spans) or copies: cells[0..k+r); *live gets
  // DataCells' mask.
  Status SetCells(std::span<const uint8_t* const> data, uint8_t* parity, const uint8_t** cells,
                  uint32_t* live) const;
  // After a reserved row's cells were written (results[m] per member): commits the set (true;
  // data member i's owner spans[i] where bit i of `live` is set), or notes the failed members and
  // frees the row (false, *last says why).
  bool FinishSetWrite(IoContext& io, SpanSet* set, std::span<const client::Lease> members,
                      uint64_t epoch, uint32_t absent, const Status* results, uint32_t live,
                      std::span<SpanOwner* const> spans, Status* last);
  void FreeRowLocked(SpanSet* set) REQUIRES(mu_);
  // Writes cells[m] (span_size bytes) at `off` of member m's slab, for every m not in `skip`;
  // results[m] (OK for skipped members).
  void WriteCells(IoContext& io, std::span<const client::Lease> members, uint64_t off,
                  std::span<const uint8_t* const> cells, Status* results, uint32_t skip = 0);
  // Runs `ops` on `nodes` as one batch (ChannelSet::RunBatch); results[i] = status of op i.
  void RunOps(IoContext& io, std::span<transport::Op> ops, std::span<const client::NodeId> nodes,
              std::span<Status> results);
  // Notes that member `m` of `g` failed (if it still holds `lease_id`), queues re-protection.
  void MarkFailed(Group* g, int m, uint64_t lease_id, const Status& why);
  // MarkFailed with mu_ held; true if it marked the member (then signal recovery_cv_ after
  // releasing mu_).
  bool MarkFailedLocked(Group* g, int m, uint64_t lease_id, const Status& why) REQUIRES(mu_);
  // Uses failed member m of g again as it is (mu_ held) if it missed no span set, is not being
  // rebuilt, and (with `lease_state`, else the cluster is asked) its lease is held on a daemon
  // that is up and not suspect. Bumps the epoch: a set being written degraded past it now is
  // placed elsewhere. True if it did.
  bool RevalidateLocked(Group* g, int m) REQUIRES(mu_);
  // The member that lease `id` of daemon `node` is (an event names leases of one daemon; a lease
  // id known here under another daemon is not the one meant), or nullopt.
  std::optional<std::pair<Group*, int>> MemberOfLocked(uint64_t id, client::NodeId node)
      REQUIRES(mu_);
  // Makes `fresh` (on the daemon `daemon_id`) member j of g in place of the one there (a move's
  // or a re-protection's copy, complete): the lease index, the daemon id, the member epoch that
  // OpenChannels watches, the member's failed / stale / evicted / leaving marks cleared and g's
  // epoch bumped. The one place that replaces a member.
  void InstallMemberLocked(Group* g, int j, const client::Lease& fresh, uint64_t daemon_id)
      REQUIRES(mu_);
  // Sets `set`'s live_mask (its group set) and keeps its group's by_live bitmaps in step: the
  // one writer of live_mask.
  void SetLiveLocked(SpanSet* set, uint32_t live) REQUIRES(mu_);
  // Commits a reserved row: writing done, live_mask `live`, data member i's owner spans[i] where
  // bit i of live is set (holes null).
  void CommitRowLocked(SpanSet* set, uint32_t live, std::span<SpanOwner* const> spans)
      REQUIRES(mu_);
  // Marks g as having a member rebuilt or moved (no new rows are placed in it from here) and
  // returns the rows committed in it now: the ones to copy.
  std::vector<uint32_t> StartRebuildLocked(Group* g) REQUIRES(mu_);
  // Sends bodies[i] as `op` to nodes[i] on the offload connections, all before waiting for any
  // reply, then collects every reply. Returns the first error (replies to the others are still
  // read, so the connections stay in step).
  // Asks the r parity members of a row at `off` to compute their cells from its k data cells
  // (PARITY_ENCODE); OK once every parity cell is in place.
  Status EncodeParityRemotely(IoContext& io, std::span<const client::Lease> members, uint64_t off,
                              uint32_t timeout_ms);
  // `replies` (if given): the body of each successful reply (at most kMaxCallReply bytes).
  Status CallAll(IoContext& io, wire::Opcode op, std::span<const client::NodeId> nodes,
                 std::span<const std::vector<uint8_t>> bodies,
                 std::vector<std::vector<uint8_t>>* replies = nullptr);
  void OnClusterEvent(const client::Event& ev);
  // ---- moving noticed members (remote_store_move.cc) ----
  // One noticed member to move: member `member` of `group`, still holding lease `lease`.
  struct PendingMove {
    Group* group = nullptr;
    int member = 0;
    uint64_t lease = 0;
    Clock::time_point noticed{};
    Clock::time_point deadline{};
    Clock::time_point next_try{};  // not before (no daemon had room: retried)
    bool no_room_logged = false;
  };
  // Records the noticed members of an kEvictNotice (moved by the recovery thread).
  void OnEvictNotice(const client::Event& ev);
  // The due move with the earliest deadline, taken out of moves_; nullopt if none is due.
  std::optional<PendingMove> TakeDueMoveLocked(Clock::time_point now) REQUIRES(mu_);
  // When the next move that is not due yet is; time_point::max() if none.
  Clock::time_point NextMoveTryLocked() const REQUIRES(mu_);
  // Copies the leaving member's rows to a new slab elsewhere, swaps it in, frees the old lease.
  // Runs on the recovery thread with g->in_recovery set.
  void Move(IoContext& io, PendingMove mv);
  // The nodes a moved member must not go to: the group's other live members, the noticing one,
  // and every daemon that says it is draining or short of memory.
  std::vector<client::NodeId> MoveExclusions(const std::vector<client::Lease>& members,
                                             uint32_t live, client::NodeId from) const;
  // Drops pending moves of g (it is being removed).
  void ForgetMovesLocked(const Group* g) REQUIRES(mu_);
  void RecoveryLoop();
  // Puts g in the recovery queue unless it is there already.
  void QueueLocked(Group* g) REQUIRES(mu_);
  // The periodic half of failure handling: marks failed the members whose daemon the cluster
  // says is down or restarted (in case an event did not reach us).
  void ReconcileMembers();
  void Reprotect(IoContext& io, Group* g);
  // Runs `work` (a move or a re-protection of g) with mu_ released and g marked in recovery; then
  // frees g if it was emptied meanwhile, and wakes the waiters.
  void RecoverGroupLocked(Group* g, const std::function<void()>& work) REQUIRES(mu_);
  // Takes g out of the store and returns its placed leases, to be freed (g has no rows).
  std::vector<client::Lease> RemoveGroupLocked(Group* g) REQUIRES(mu_);
  // Degraded-episode bookkeeping (RemoteStoreStats::degraded_episodes): the store lost redundancy
  // / may be whole again (ends the episode if no group misses a member to place).
  void NoteDegradedLocked() REQUIRES(mu_);
  void EndEpisodeIfWholeLocked() REQUIRES(mu_);
  // Endpoint of member m's daemon, or "(never placed)".
  std::string MemberName(const client::Lease& l) const;

  client::Cluster* cluster_;
  const client::Resilience res_;
  const uint32_t span_size_;
  const std::chrono::milliseconds op_timeout_;
  const std::chrono::milliseconds reconcile_interval_;
  const bool lease_ahead_;
  uint64_t slab_size_ = 0;
  uint32_t rows_per_group_ = 0;
  size_t live_words_ = 0;  // words per by_live bitmap: rows_per_group_ / 64, rounded up
  std::unique_ptr<ec::ReedSolomon> codec_;
  std::vector<uint8_t> zeros_;
  client::SubscriptionId subscription_ = 0;

  mutable Mutex mu_;
  CondVar recovery_cv_;
  LostObserver lost_observer_ GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Group>> groups_ GUARDED_BY(mu_);
  std::unordered_map<uint64_t, std::pair<Group*, int>> by_lease_ GUARDED_BY(mu_);
  std::deque<Group*> recovery_queue_ GUARDED_BY(mu_);
  bool recovering_ GUARDED_BY(mu_) = false;
  // A node came up (or restarted): every degraded group is worth another try now.
  bool retry_all_ GUARDED_BY(mu_) = false;
  // A complete group could not be had lately: degraded groups with room take rows first. Cleared
  // by node-up events and reconcile ticks.
  bool full_alloc_failed_ GUARDED_BY(mu_) = false;
  // lease_ahead: a writer left the complete groups with fewer than half a group of free rows;
  // the recovery thread leases the next group (LeaseAhead). lease_ahead_failed_: the last try
  // found no room; not tried again until a node-up event or a reconcile tick.
  bool lease_ahead_wanted_ GUARDED_BY(mu_) = false;
  bool lease_ahead_failed_ GUARDED_BY(mu_) = false;
  uint64_t groups_leased_ahead_ GUARDED_BY(mu_) = 0;
  // Bumped (under mu_) whenever a group is placed or a member replaced: OpenChannels then looks
  // again.
  std::atomic<uint64_t> members_epoch_{1};
  uint64_t groups_leased_by_writers_ GUARDED_BY(mu_) = 0;
  bool stopping_ GUARDED_BY(mu_) = false;
  uint32_t next_group_id_ GUARDED_BY(mu_) = 1;
  uint32_t next_set_id_ GUARDED_BY(mu_) = 1;
  uint64_t sets_ GUARDED_BY(mu_) = 0;
  uint64_t degraded_reads_ GUARDED_BY(mu_) = 0;
  uint64_t reprotected_ GUARDED_BY(mu_) = 0;
  uint64_t rebuilt_bytes_ GUARDED_BY(mu_) = 0;
  uint64_t sets_reprotected_ GUARDED_BY(mu_) = 0;
  uint64_t lost_bytes_ GUARDED_BY(mu_) = 0;
  uint64_t degraded_sets_written_ GUARDED_BY(mu_) = 0;
  uint64_t reprotect_last_ms_ GUARDED_BY(mu_) = 0;
  uint64_t reprotect_max_ms_ GUARDED_BY(mu_) = 0;
  uint64_t members_failed_ GUARDED_BY(mu_) = 0;
  uint64_t members_revalidated_ GUARDED_BY(mu_) = 0;
  uint64_t moved_ GUARDED_BY(mu_) = 0;
  uint64_t moves_missed_ GUARDED_BY(mu_) = 0;
  uint64_t copies_abandoned_ GUARDED_BY(mu_) = 0;
  uint64_t move_last_ms_ GUARDED_BY(mu_) = 0;
  uint64_t moved_bytes_ GUARDED_BY(mu_) = 0;
  uint64_t move_last_bytes_ GUARDED_BY(mu_) = 0;
  // The current degraded episode (max(): none / no re-protection progress yet) and the last.
  Clock::time_point degraded_since_ GUARDED_BY(mu_) = Clock::time_point::max();
  Clock::time_point reprotect_since_ GUARDED_BY(mu_) = Clock::time_point::max();
  uint64_t degraded_episodes_ GUARDED_BY(mu_) = 0;
  uint64_t episode_sets_ GUARDED_BY(mu_) = 0;
  uint64_t episode_bytes_ GUARDED_BY(mu_) = 0;
  uint64_t episode_revalidated_ GUARDED_BY(mu_) = 0;  // members used again as they were
  uint64_t last_episode_degraded_ms_ GUARDED_BY(mu_) = 0;
  uint64_t last_episode_reprotect_ms_ GUARDED_BY(mu_) = 0;
  uint64_t last_episode_bytes_ GUARDED_BY(mu_) = 0;
  uint64_t move_max_ms_ GUARDED_BY(mu_) = 0;
  uint64_t move_min_slack_ms_ GUARDED_BY(mu_) = 0;
  std::vector<PendingMove> moves_ GUARDED_BY(mu_);
  std::vector<uint8_t> move_buffer_;     // recovery thread only
  Mutex alloc_mu_ ACQUIRED_BEFORE(mu_);  // one group allocation at a time
  std::thread recovery_thread_;
};

}  // namespace farmem::spanstore
