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
// client core reports the failure, synchronously when a write finds it.
// With a backup file (Infiniswap), every write also goes to the file; reads fall back to it when
// no remote copy can produce the data, and writes whose remote copies all failed complete from it.
// Data that truly cannot be produced is an IoError naming the pages.
//
// Threading: every BlockBackend method may be called concurrently. Each call checks out a Worker
// (channels to the daemons + staging memory, all allocated up front) for its duration, so no two
// threads share a channel and the request path does not allocate. Extents are guarded by
// reader/writer locks: I/O takes them shared; rebuild, unmap and partial-page erasure-coded writes
// take what they need exclusively.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "backup_file.h"
#include "farmem/blockdev/block_backend.h"
#include "farmem/client/cluster.h"
#include "farmem/ec/reed_solomon.h"

namespace farmem::blockdev {

struct Resilience {
  enum class Mode { kNone, kReplicate, kErasure };
  Mode mode = Mode::kErasure;
  int copies = 1;    // replicate
  int k = 4, r = 2;  // erasure

  // "none", "replicate:N", "ec:k+r"
  static Result<Resilience> Parse(std::string_view text);
  std::string ToString() const;
  int group_size() const;
  int data_width() const { return mode == Mode::kErasure ? k : 1; }
};

struct PageStoreOptions {
  uint64_t size = 0;  // export size, a multiple of 4096
  Resilience resilience;
  std::string backup_path;  // empty: no backup file
  size_t workers = 8;       // concurrent callers served without waiting
  std::chrono::milliseconds op_timeout{5000};
};

struct PageStoreStats {
  uint64_t extents_mapped = 0;
  uint64_t degraded_reads = 0;  // reads that needed decoding, another replica or the backup
  uint64_t backup_reads = 0;
  uint64_t rebuilds = 0;  // members rebuilt on another daemon
  uint64_t write_retries = 0;
};

class PageStore final : public BlockBackend {
 public:
  static Result<std::unique_ptr<PageStore>> Create(client::Cluster* cluster,
                                                   PageStoreOptions options);
  ~PageStore() override;

  uint64_t size() const override { return options_.size; }
  Status Read(uint64_t offset, std::span<uint8_t> buf) override;
  Status Write(uint64_t offset, std::span<const uint8_t> data, bool fua) override;
  Status Flush() override;
  Status Trim(uint64_t offset, uint64_t length, bool fua) override;
  Status WriteZeroes(uint64_t offset, uint64_t length, bool may_trim, bool fua) override;
  void ExecuteBatch(std::span<BlockOp> ops, BatchListener* listener = nullptr) override;

  bool can_flush() const override { return true; }
  bool can_fua() const override { return true; }
  bool can_trim() const override { return true; }
  bool can_write_zeroes() const override { return true; }
  bool can_multi_conn() const override { return true; }  // no per-connection cache

  PageStoreStats stats() const;
  const Resilience& resilience() const { return options_.resilience; }
  uint64_t extent_bytes() const { return extent_bytes_; }
  // Waits until no rebuild is queued or running (for tests and the demo).
  void WaitForRebuilds();

 private:
  struct Extent;
  struct Worker;
  struct Piece;
  struct RemoteOp;
  class Round;

  PageStore(client::Cluster* cluster, PageStoreOptions options);
  Status Init();

  Worker* Checkout();
  void Return(Worker* w);

  // One read or write, split into pieces that each stay inside one extent and one round.
  Status DoRead(Worker& w, uint64_t offset, std::span<uint8_t> buf);
  Status DoWrite(Worker& w, uint64_t offset, std::span<const uint8_t> data, bool fua);
  Status DoZero(Worker& w, uint64_t offset, uint64_t length, bool may_trim, bool fua);
  // Everything in [offset, offset+len) of one extent; the caller holds the extent shared.
  Status ReadPiece(Worker& w, Extent& e, uint64_t offset, std::span<uint8_t> buf);
  Status WritePiece(Worker& w, Extent& e, uint64_t offset, std::span<const uint8_t> data,
                    bool* member_failed);

  // Runs page-aligned pieces in rounds; sets the status of the ops they came from. With `early`,
  // ops whose pieces all succeed are reported to its listener while the round still waits.
  struct Early;
  void RunPieces(Worker& w, std::vector<Piece>& pieces, std::span<Status> op_status, int attempt,
                 Early* early = nullptr);
  // The success half of a finished piece: marks written pages (writes), or assembles the data
  // (ec reads: decode when a data fragment is missing) and zero-fills never-written pages.
  void MarkWritten(Piece& p);
  Status FinishRead(Piece& p);
  // Handles one page that an op covers only partly: read, patch, write back (exclusive lock).
  Status PartialPage(Worker& w, uint64_t page_offset, uint64_t at, std::span<uint8_t> read_into,
                     std::span<const uint8_t> write_from);
  // Appends the page-aligned pieces of [offset, offset+len) (both page multiples).
  void SplitPieces(uint64_t offset, uint64_t len, uint8_t* buf, bool write, size_t op,
                   std::vector<Piece>* out);

  Status MapExtent(uint64_t index);
  void UnmapIfEmpty(uint64_t index);
  Status RebuildExtent(Worker& w, uint64_t index);  // takes the extent exclusively
  void OnClusterEvent(const client::Event& ev);
  void RebuildLoop();
  void QueueRebuild(uint64_t index);
  void MarkLost(std::span<const uint64_t> lease_ids);

  transport::Channel* ChannelFor(Worker& w, client::NodeId node, Status* error);
  // Waits for completions on every channel with outstanding operations; false on deadline.
  template <typename Fn>
  bool PollChannels(Worker& w, Deadline deadline, Fn&& on_completion);
  void ResetStuckChannels(Worker& w);
  void DrainStragglers(Worker& w);
  void CountStat(uint64_t PageStoreStats::*field, uint64_t n = 1);

  client::Cluster* cluster_;
  PageStoreOptions options_;
  std::unique_ptr<ec::ReedSolomon> codec_;
  std::unique_ptr<BackupFile> backup_;
  uint64_t slab_size_ = 0;
  uint64_t extent_bytes_ = 0;
  uint32_t frag_size_ = 4096;  // bytes of one page on one member
  std::vector<std::unique_ptr<Extent>> extents_;
  client::SubscriptionId subscription_ = 0;

  std::mutex map_mu_;      // serializes mapping/unmapping decisions; a leaf lock
  std::mutex partial_mu_;  // serializes read-modify-write of partly written pages

  std::mutex workers_mu_;
  std::condition_variable workers_cv_;
  std::vector<std::unique_ptr<Worker>> all_workers_;
  std::vector<Worker*> free_workers_;  // GUARDED_BY(workers_mu_)

  std::mutex rebuild_mu_;
  std::condition_variable rebuild_cv_;
  std::deque<uint64_t> rebuild_queue_;  // GUARDED_BY(rebuild_mu_)
  std::vector<uint64_t> lost_leases_;   // GUARDED_BY(rebuild_mu_): from cluster events
  bool rebuilding_ = false;             // GUARDED_BY(rebuild_mu_)
  bool stopping_ = false;               // GUARDED_BY(rebuild_mu_)
  std::thread rebuild_thread_;

  mutable std::mutex stats_mu_;
  PageStoreStats stats_;  // GUARDED_BY(stats_mu_)
};

}  // namespace farmem::blockdev
