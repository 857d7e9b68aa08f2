// BackupFile: Infiniswap's local backup — every write of an export also goes to a local file,
// asynchronously, so that data survives the loss of every remote copy.
//
// Writes are copied into buffers registered with io_uring up front (the caller's buffer is free
// again as soon as Write returns) and submitted as fixed-buffer writes; the file is opened with
// O_DIRECT where the file system allows it. Completions are reaped by whichever thread next
// submits or waits: there is no thread of its own and no hand-off between threads. Flush waits
// for every write submitted before it and then fdatasyncs. Two writes to the same offset are never
// in flight together (the second waits for the first), so the file never ends up with the older
// of two writes.
//
// Thread-safety: all methods may be called from any thread; one mutex guards the ring.
#pragma once

#include <liburing.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "farmem/common/mutex.h"
#include "farmem/common/status.h"

namespace farmem::blockdev {

class BackupFile {
 public:
  // Creates or opens `path`, sized to `size` bytes (preallocated). `buffer_bytes` of registered
  // staging memory bound how much may be in flight.
  static Result<std::unique_ptr<BackupFile>> Open(const std::string& path, uint64_t size,
                                                  size_t buffer_bytes = 16 << 20);
  ~BackupFile();

  // Queues a write of `data` at `offset` (multiples of 512). Returns once the data is copied and
  // submitted; waits only when the staging buffers are all in flight.
  Status Write(uint64_t offset, std::span<const uint8_t> data);
  // Zeroes a range (TRIM / WRITE_ZEROES), synchronously.
  Status Zero(uint64_t offset, uint64_t length);
  // Reads from the file after every queued write overlapping the range has landed.
  Status Read(uint64_t offset, std::span<uint8_t> out);
  // Every write queued before the call is on stable storage when it returns.
  Status Flush();

  const std::string& path() const { return path_; }
  bool direct() const { return direct_; }

 private:
  static constexpr size_t kSlot = 128 << 10;  // one registered buffer; larger writes are split

  BackupFile() = default;
  // Reaps completions; with wait, blocks for at least one (mu_ is released while it blocks).
  Status ReapLocked(bool wait) REQUIRES(mu_);
  bool OverlapsInFlightLocked(uint64_t offset, uint64_t length) const REQUIRES(mu_);

  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  uint64_t size_ = 0;
  io_uring ring_{};
  bool ring_ok_ = false;
  uint8_t* slots_mem_ = nullptr;
  size_t nslots_ = 0;

  struct InFlight {
    uint64_t offset = 0;
    uint64_t length = 0;
    bool busy = false;
  };
  Mutex mu_;
  CondVar cv_;
  std::vector<InFlight> inflight_ GUARDED_BY(mu_);  // one per slot
  std::vector<size_t> free_slots_ GUARDED_BY(mu_);
  bool reaping_ GUARDED_BY(mu_) = false;  // a thread waits in io_uring_wait_cqe
  Status error_ GUARDED_BY(mu_);          // first failed write, sticky
};

}  // namespace farmem::blockdev
