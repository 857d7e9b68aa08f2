// BlockBackend: the storage behind an NBD export, and MemoryBackend, a plain in-RAM one.
//
// What it solves: the NBD server (nbd_server.h) knows the protocol and nothing about where bytes
// live; a backend knows where bytes live and nothing about the protocol. farmem-nbd's real backend
// is the remote page store (slabs on farmemd daemons via client/); MemoryBackend serves tests and
// benchmarks, like nbdkit's memory plugin.
//
// Contract for implementations:
//  - The server validates every request before calling: offset + length <= size(), offsets and
//    lengths are multiples of 512, read/write buffers are at most 32 MiB, and an operation is only
//    called if its can_*() said yes. Implementations still check bounds (cheaply) and return
//    OutOfRange rather than touching memory they do not own.
//  - Thread safety: every method may be called concurrently from several connection threads (one
//    per NBD connection), also for overlapping ranges. What overlapping concurrent writes leave
//    behind is unspecified (as in NBD), but it must not be a data race or a crash.
//  - Errors are Status values; the server maps their codes to NBD errors (OutOfRange and
//    ResourceExhausted -> ENOSPC, InvalidArgument -> EINVAL, Aborted -> ESHUTDOWN, anything else
//    -> EIO). Messages are logged, never sent to the client.
//  - Durability: a successful Write/Trim/WriteZeroes with fua=true, and a successful Flush(), mean
//    the data survives whatever the backend promises to survive (for the remote page store: the
//    loss of as many nodes as its resilience mode allows). can_multi_conn() may only be true if
//    that promise holds across connections, i.e. there is no per-connection cache.
//  - The request path must not allocate in the common case (swap safety: the kernel may be
//    swapping to us because memory is short).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "farmem/common/mutex.h"
#include "farmem/common/status.h"

namespace farmem::blockdev {

// One operation of a batch handed to BlockBackend::ExecuteBatch.
struct BlockOp {
  enum class Kind : uint8_t { kRead, kWrite, kFlush, kTrim, kWriteZeroes };

  Kind kind = Kind::kRead;
  bool fua = false;       // write / trim / write-zeroes: durable before completion
  bool may_trim = false;  // write-zeroes: the range may be deallocated (NBD: NO_HOLE not set)
  uint64_t offset = 0;
  uint64_t length = 0;            // bytes; for read/write equal to the buffer's size
  std::span<uint8_t> read_into;   // read: where the data goes
  std::span<const uint8_t> data;  // write: the data
  Status status;                  // result, filled in by ExecuteBatch
};

// Hears about the ops of a batch that finish before the whole batch does, so that their replies
// can go out early (the client reuses those slots while the rest is still in flight).
// Implementations never block in OpDone or Progress (the NBD connection only queues replies and
// offers them to the socket without waiting): the backend calls them while it holds locks and has
// remote operations in flight, and must not be held up by a client that stops reading.
class BatchListener {
 public:
  virtual ~BatchListener() = default;
  // ops[i] is final: its status is set and the backend no longer touches its buffers. Called on
  // the thread running ExecuteBatch, at most once per op, never after ExecuteBatch returned.
  virtual void OpDone(size_t i) = 0;
  // The backend is about to wait for more: a good moment to send what OpDone collected.
  virtual void Progress() = 0;
};

class BlockBackend {
 public:
  virtual ~BlockBackend() = default;

  // Export size in bytes, fixed for the backend's lifetime; a multiple of 512.
  virtual uint64_t size() const = 0;

  // Reads exactly buf.size() bytes at offset.
  [[nodiscard]] virtual Status Read(uint64_t offset, std::span<uint8_t> buf) = 0;
  // Writes data at offset; with fua, durable before returning.
  [[nodiscard]] virtual Status Write(uint64_t offset, std::span<const uint8_t> data, bool fua) = 0;
  // Makes every write that completed before this call durable.
  [[nodiscard]] virtual Status Flush() = 0;
  // The range is no longer needed; its contents are unspecified until written again.
  [[nodiscard]] virtual Status Trim(uint64_t offset, uint64_t length, bool fua) = 0;
  // The range reads back as zeroes. may_trim: the backend may deallocate it to get there.
  [[nodiscard]] virtual Status WriteZeroes(uint64_t offset, uint64_t length, bool may_trim,
                                           bool fua) = 0;

  // Which operations exist; advertised to clients exactly as answered here.
  virtual bool can_flush() const = 0;
  virtual bool can_fua() const = 0;
  virtual bool can_trim() const = 0;
  virtual bool can_write_zeroes() const = 0;
  // True if Flush/FUA on one connection make data durable for all (no per-connection cache).
  virtual bool can_multi_conn() const = 0;

  // Runs every op of a batch and sets each op's status. The ops are independent requests that were
  // in flight together on one connection: a backend may run them in any order or all at once (a
  // remote backend posts them together and waits once). A kFlush in a batch only has to cover
  // writes that completed before ExecuteBatch was called. The default runs them one by one.
  // A listener, if given, may be told of ops that finished early (see BatchListener); the ops it
  // was not told of are final when ExecuteBatch returns.
  virtual void ExecuteBatch(std::span<BlockOp> ops, BatchListener* listener = nullptr);
};

// A backend whose one implementation of every operation is ExecuteBatch (the page store, the
// write cache): Read, Write, Trim and WriteZeroes run as batches of one op.
class BatchBackend : public BlockBackend {
 public:
  [[nodiscard]] Status Read(uint64_t offset, std::span<uint8_t> buf) override;
  [[nodiscard]] Status Write(uint64_t offset, std::span<const uint8_t> data, bool fua) override;
  [[nodiscard]] Status Trim(uint64_t offset, uint64_t length, bool fua) override;
  [[nodiscard]] Status WriteZeroes(uint64_t offset, uint64_t length, bool may_trim,
                                   bool fua) override;
  void ExecuteBatch(std::span<BlockOp> ops, BatchListener* listener = nullptr) override = 0;

 private:
  Status RunOne(BlockOp op);
};

// An export held in this process's memory, allocated (and, under mlockall, locked) up front.
// Contents start as zeroes. Trim and WriteZeroes zero the range. Flush and FUA have nothing to do:
// there is nothing more durable than this memory. Thread-safe; ranges are guarded by striped
// reader/writer locks so that concurrent overlapping requests are not data races.
class MemoryBackend final : public BlockBackend {
 public:
  // size must be a non-zero multiple of 512. Fails if the memory cannot be mapped.
  static Result<std::unique_ptr<MemoryBackend>> Create(uint64_t size);
  ~MemoryBackend() override;

  MemoryBackend(const MemoryBackend&) = delete;
  MemoryBackend& operator=(const MemoryBackend&) = delete;

  uint64_t size() const override { return size_; }
  Status Read(uint64_t offset, std::span<uint8_t> buf) override;
  Status Write(uint64_t offset, std::span<const uint8_t> data, bool fua) override;
  Status Flush() override { return Status::Ok(); }
  Status Trim(uint64_t offset, uint64_t length, bool fua) override;
  Status WriteZeroes(uint64_t offset, uint64_t length, bool may_trim, bool fua) override;

  bool can_flush() const override { return true; }
  bool can_fua() const override { return true; }
  bool can_trim() const override { return true; }
  bool can_write_zeroes() const override { return true; }
  bool can_multi_conn() const override { return true; }

 private:
  // Locks are striped by 1 MiB region: a request takes one region's lock at a time.
  static constexpr uint64_t kRegionShift = 20;
  static constexpr size_t kStripes = 64;

  MemoryBackend(uint8_t* base, uint64_t size) : base_(base), size_(size) {}
  Status CheckRange(uint64_t offset, uint64_t length, const char* what) const;
  SharedMutex& StripeFor(uint64_t offset) { return stripes_[(offset >> kRegionShift) % kStripes]; }
  // Calls fn(offset, length) for each piece of [offset, offset+length) inside one region, holding
  // that region's lock (shared for reads, exclusive for writes).
  template <bool kExclusive, typename Fn>
  void ForEachRegion(uint64_t offset, uint64_t length, Fn&& fn);

  uint8_t* const base_;  // mmap'ed, size_ bytes, owned
  const uint64_t size_;
  SharedMutex stripes_[kStripes];  // guard the bytes of base_, not members
};

}  // namespace farmem::blockdev
