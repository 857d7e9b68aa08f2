// The page store's I/O round: many pieces' remote operations posted together, one doorbell per
// daemon, one wait (see page_store.h). A Round sees only what it needs: the store's fixed layout
// (RoundParams), the worker it runs on (its channels and staging memory) and the cluster (to
// report a failed daemon and name it in errors). It never touches the store itself. Waiting on
// the daemons is client::ChannelSet's.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "farmem/blockdev/block_backend.h"
#include "farmem/client/channel_set.h"
#include "farmem/client/cluster.h"
#include "farmem/client/resilience.h"
#include "farmem/common/aead.h"
#include "farmem/ec/reed_solomon.h"
#include "page_crypto.h"
#include "page_store_internal.h"

namespace farmem::blockdev::pagestore {

// What a round needs of the store: fixed after the store starts.
struct RoundParams {
  client::Resilience resilience;
  const ec::ReedSolomon* codec = nullptr;  // ec:k+r only
  uint32_t frag_size = kPage;              // bytes of one page on one member
  std::chrono::milliseconds op_timeout{5000};
  const PageCrypto* crypto = nullptr;  // null: pages are stored in plaintext (--no-encrypt)
  uint64_t extent_pages = 0;           // export page number = extent * extent_pages + page
};

// A page of a round's piece that failed authentication when the read finished (RunPieces looks
// for a good copy: PageStore::RecoverPage).
struct BadPage {
  size_t piece = 0;   // in the round
  uint64_t page = 0;  // within the extent
};

// What RunPieces needs to report ops early (ExecuteBatch with a listener).
struct Early {
  BatchListener* listener = nullptr;
  std::span<BlockOp> ops;
  // Per op: pieces not yet settled, or 0 if the op is not reported early (not split into pieces,
  // or a FUA write that must wait for the backup file's flush).
  std::span<uint32_t> pieces_left;
};

// The remote operations of one round (see Round).
struct RemoteOp {
  client::NodeId node = 0;
  transport::Op op;
  size_t piece = 0;
  int member = 0;
  bool done = false;  // its outcome is in (ChannelSet::RunBatch)
  Status status;
};

// Everything one caller of the store uses for its duration, allocated up front.
struct Worker {
  Worker(client::Cluster* cluster, std::chrono::milliseconds op_timeout)
      : channels(cluster, op_timeout), round_pieces(kMaxRoundPieces) {}

  // Its channels to the daemons, opened lazily; only this worker uses them.
  client::ChannelSet channels;
  std::vector<uint8_t> staging;
  // Scratch of the request path, reserved up front and reused (cleared, never shrunk), so that
  // serving a batch does not allocate: the pieces and statuses of ExecuteBatch, the extents a
  // round holds shared, and the round's remote operations.
  std::vector<Piece> pieces;
  std::vector<Piece> side_pieces;  // DoRead / DoWrite / PartialPage: one op, outside the batch
  std::vector<Status> status;
  std::vector<Extent*> locked;
  std::vector<RemoteOp> round_ops;
  // A round's pieces (Round::pieces_): kMaxRoundPieces of them, made once. A Round of its own
  // would construct and destroy all of them (≈ 9 KiB, a Status each) for every round, which was
  // ≈ 1.3 µs of a 4 KiB read at depth 1 (docs/benchmarks-nbd.md "QD1 latency").
  std::vector<Piece> round_pieces;
  std::vector<uint32_t> per_node;
  std::vector<uint32_t> pieces_left;  // per op of the batch (Early)
  // Page encryption: this worker's cipher, the ciphertext of a batch's aligned writes (grown to
  // the largest batch, then reused), which ops were sealed, and the pages that failed
  // authentication in the current round.
  std::optional<aead::Cipher> cipher;
  std::vector<uint8_t> sealed;
  std::vector<uint8_t> op_sealed;
  std::vector<BadPage> bad_pages;

  // The pieces of one group of a batch (ExecuteBatch cuts batches so that they fit): two per op
  // of a full group of single-page ops, an op splitting at most once at an extent's end.
  static constexpr size_t kGroupPieces = 512;

  // The request path's scratch; the background thread's worker (rebuilds, moves: they copy
  // ciphertext with ops of their own, RunCopyOps) needs only its channels.
  void Reserve(size_t nodes, size_t group_size) {
    pieces.reserve(kGroupPieces);
    side_pieces.reserve(64);  // one op of at most 1 MiB: a few pieces (extent, round bounds)
    status.reserve(256);
    pieces_left.reserve(256);
    locked.reserve(2 * kMaxRoundExtents);
    round_ops.reserve(kMaxRoundPieces * group_size);  // one op per member of each piece
    per_node.reserve(nodes);
    channels.Reserve(nodes);
    op_sealed.reserve(256);
    bad_pages.reserve(64);
  }
};

// The success half of a finished ec or plain read: assembles the data (ec: decodes when a data
// fragment is missing, setting *decoded), zero-fills never-written pages and, with encryption,
// opens the written ones in place: those that fail authentication are zeroed and appended to
// w.bad_pages (as piece `index` of the round) and counted in p.bad. Runs once per piece.
Status FinishRead(const RoundParams& params, Worker& w, size_t index, Piece& p, bool* decoded);

class Round {
 public:
  Round(const RoundParams& params, client::Cluster* cluster, Worker* w, std::span<Status> op_status,
        Early* early);

  // Whether the piece's operations fit this round's windows and staging.
  bool Fits(const Piece& p) const;
  bool empty() const { return count_ == 0; }
  size_t size() const { return count_; }
  Piece& piece(size_t i) { return pieces_[i]; }
  // Reads decoded while settling early (for the store's degraded_reads).
  uint64_t decoded_reads() const { return decoded_reads_; }

  // Adds a piece and prepares its operations (encodes parity for ec writes).
  Status Add(Piece p);
  // Sends everything and waits: for writes and plain reads until every op completed, for ec reads
  // until each piece has k fragments (stragglers stay outstanding; DrainStragglers reaps them).
  void Run();

 private:
  size_t StageBytes(const Piece& p) const;
  void Post(size_t piece, int member, bool write, uint64_t offset, uint8_t* local, uint32_t len);
  // Op i's outcome (once per op, from ChannelSet::RunBatch).
  void Complete(size_t i, const Status& s);
  // Settles the pieces that succeeded completely and reports the ops all of whose pieces are
  // settled. Anything short of complete success is left to RunPieces after the round.
  void SettleEarly();
  bool Satisfied() const;

  const RoundParams& params_;
  client::Cluster* const cluster_;
  Worker* const w_;
  std::span<Status> op_status_;
  Early* early_;
  Piece* const pieces_;  // the worker's round_pieces: [0, count_) are this round's
  size_t count_ = 0;
  size_t stage_used_ = 0;
  uint64_t decoded_reads_ = 0;
  std::vector<RemoteOp>& ops_;       // the worker's, reused
  std::vector<uint32_t>& per_node_;  // ops per daemon in this round
};

// One remote operation of a member copy (rebuild or move, page_store_move.cc).
struct CopyOp {
  client::NodeId node = 0;
  transport::Op op;
  Status status;
  bool done = false;
};

// Posts `ops` on the worker's channels (which must have nothing outstanding: DrainStragglers) and
// waits for every one, as a Round does: an op still waiting on a daemon the cluster declares
// down meanwhile fails within kDownCheck (Unavailable) instead of at op_timeout, so a rebuild
// whose source or target is partitioned or paused is abandoned as soon as that is known. Failures
// are reported to the cluster. Returns the first error.
Status RunCopyOps(const RoundParams& params, client::Cluster* cluster, Worker& w,
                  std::span<CopyOp> ops);

}  // namespace farmem::blockdev::pagestore
