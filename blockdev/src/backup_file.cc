#include "backup_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

namespace farmem::blockdev {

Result<std::unique_ptr<BackupFile>> BackupFile::Open(const std::string& path, uint64_t size,
                                                     size_t buffer_bytes) {
  std::unique_ptr<BackupFile> b(new BackupFile());
  b->path_ = path;
  b->size_ = size;
  b->fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_DIRECT, 0600);
  b->direct_ = b->fd_ >= 0;
  if (b->fd_ < 0 && errno == EINVAL) {  // e.g. tmpfs: no O_DIRECT
    b->fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    spdlog::warn("backup file {}: the file system refuses O_DIRECT; using the page cache", path);
  }
  if (b->fd_ < 0) {
    return Err(ErrnoStatus(StatusCode::kIoError, fmt::format("open backup file {}", path), errno));
  }
  if (::ftruncate(b->fd_, static_cast<off_t>(size)) != 0) {
    return Err(ErrnoStatus(StatusCode::kIoError, fmt::format("size backup file {}", path), errno));
  }
  if (::fallocate(b->fd_, 0, 0, static_cast<off_t>(size)) != 0 && errno != EOPNOTSUPP) {
    return Err(ErrnoStatus(StatusCode::kResourceExhausted,
                           fmt::format("preallocate {} bytes for backup file {}", size, path),
                           errno));
  }
  b->nslots_ = std::max<size_t>(4, buffer_bytes / kSlot);
  void* mem = ::mmap(nullptr, b->nslots_ * kSlot, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (mem == MAP_FAILED) {
    return Err(ErrnoStatus(StatusCode::kResourceExhausted, "backup staging buffers", errno));
  }
  b->slots_mem_ = static_cast<uint8_t*>(mem);
  const int rc = io_uring_queue_init(static_cast<unsigned>(b->nslots_ * 2), &b->ring_, 0);
  if (rc < 0) {
    return Err(
        ErrnoStatus(StatusCode::kUnavailable, "io_uring_queue_init for the backup file", -rc));
  }
  b->ring_ok_ = true;
  std::vector<iovec> iov(b->nslots_);
  for (size_t i = 0; i < b->nslots_; ++i) iov[i] = {b->slots_mem_ + i * kSlot, kSlot};
  const int reg =
      io_uring_register_buffers(&b->ring_, iov.data(), static_cast<unsigned>(iov.size()));
  if (reg < 0) {
    return Err(ErrnoStatus(StatusCode::kUnavailable, "io_uring_register_buffers", -reg));
  }
  {
    MutexLock lock(&b->mu_);  // not shared yet: uncontended, taken for the analysis
    b->inflight_.resize(b->nslots_);
    for (size_t i = b->nslots_; i > 0; --i) b->free_slots_.push_back(i - 1);
  }
  spdlog::info("backup file {}: {} bytes{}, {} x {} KiB registered buffers", path, size,
               b->direct_ ? ", O_DIRECT" : "", b->nslots_, kSlot >> 10);
  return b;
}

BackupFile::~BackupFile() {
  if (ring_ok_) {
    (void)Flush();
    io_uring_queue_exit(&ring_);
  }
  if (slots_mem_ != nullptr) ::munmap(slots_mem_, nslots_ * kSlot);
  if (fd_ >= 0) ::close(fd_);
}

Status BackupFile::ReapLocked(bool wait) {
  if (wait && reaping_) {  // another thread is in io_uring_wait_cqe: let it tell us
    cv_.Wait(&mu_);
    return error_;
  }
  io_uring_cqe* cqe = nullptr;
  bool got = false;
  if (wait) {
    reaping_ = true;
    mu_.Unlock();
    const int rc = io_uring_wait_cqe(&ring_, &cqe);
    mu_.Lock();
    reaping_ = false;
    if (rc < 0) {
      cv_.SignalAll();
      return ErrnoStatus(StatusCode::kIoError, "io_uring_wait_cqe on the backup file", -rc);
    }
  }
  while (io_uring_peek_cqe(&ring_, &cqe) == 0 && cqe != nullptr) {
    const size_t slot = static_cast<size_t>(io_uring_cqe_get_data64(cqe));
    InFlight& f = inflight_[slot];
    if (cqe->res < 0 || static_cast<uint64_t>(cqe->res) != f.length) {
      if (error_.ok()) {
        error_ = cqe->res < 0
                     ? ErrnoStatus(StatusCode::kIoError,
                                   fmt::format("backup write of {} bytes at {} to {}", f.length,
                                               f.offset, path_),
                                   -cqe->res)
                     : IoError(fmt::format("short backup write at {} to {}", f.offset, path_));
        spdlog::error("{}", error_.ToString());
      }
    }
    f.busy = false;
    free_slots_.push_back(slot);
    io_uring_cqe_seen(&ring_, cqe);
    got = true;
  }
  if (got || wait) cv_.SignalAll();
  return error_;
}

bool BackupFile::OverlapsInFlightLocked(uint64_t offset, uint64_t length) const {
  for (const InFlight& f : inflight_) {
    if (f.busy && f.offset < offset + length && offset < f.offset + f.length) return true;
  }
  return false;
}

Status BackupFile::Write(uint64_t offset, std::span<const uint8_t> data) {
  if (offset > size_ || data.size() > size_ - offset) {
    return OutOfRange(
        fmt::format("backup write at {} of {} bytes past {}", offset, data.size(), size_));
  }
  MutexLock lock(&mu_);
  size_t done = 0;
  while (done < data.size()) {
    const size_t n = std::min(kSlot, data.size() - done);
    const uint64_t off = offset + done;
    FARMEM_RETURN_IF_ERROR(ReapLocked(false));
    while (free_slots_.empty() || OverlapsInFlightLocked(off, n)) {
      FARMEM_RETURN_IF_ERROR(ReapLocked(true));
    }
    const size_t slot = free_slots_.back();
    free_slots_.pop_back();
    std::memcpy(slots_mem_ + slot * kSlot, data.data() + done, n);
    inflight_[slot] = {off, n, true};
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    io_uring_prep_write_fixed(sqe, fd_, slots_mem_ + slot * kSlot, static_cast<unsigned>(n), off,
                              static_cast<int>(slot));
    io_uring_sqe_set_data64(sqe, slot);
    const int rc = io_uring_submit(&ring_);
    if (rc < 0) {
      inflight_[slot].busy = false;
      free_slots_.push_back(slot);
      return ErrnoStatus(StatusCode::kIoError, "io_uring_submit to the backup file", -rc);
    }
    done += n;
  }
  return Status::Ok();
}

Status BackupFile::Zero(uint64_t offset, uint64_t length) {
  {
    MutexLock lock(&mu_);
    while (OverlapsInFlightLocked(offset, length)) FARMEM_RETURN_IF_ERROR(ReapLocked(true));
  }
  if (::fallocate(fd_, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                  static_cast<off_t>(length)) == 0) {
    return Status::Ok();
  }
  // No ZERO_RANGE here: write zeroes through the ring like any write.
  static const std::vector<uint8_t> zeros(kSlot, 0);
  for (uint64_t done = 0; done < length;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kSlot, length - done));
    FARMEM_RETURN_IF_ERROR(Write(offset + done, {zeros.data(), n}));
    done += n;
  }
  return Status::Ok();
}

Status BackupFile::Read(uint64_t offset, std::span<uint8_t> out) {
  {
    MutexLock lock(&mu_);
    while (OverlapsInFlightLocked(offset, out.size())) {
      FARMEM_RETURN_IF_ERROR(ReapLocked(true));
    }
  }
  // O_DIRECT needs aligned memory: read through an aligned bounce buffer when out is not.
  const bool aligned = (reinterpret_cast<uintptr_t>(out.data()) % 4096) == 0;
  std::unique_ptr<uint8_t, decltype(&free)> bounce(nullptr, &free);
  uint8_t* dst = out.data();
  if (direct_ && !aligned) {
    void* p = nullptr;
    if (posix_memalign(&p, 4096, out.size()) != 0) return ResourceExhausted("backup read buffer");
    bounce.reset(static_cast<uint8_t*>(p));
    dst = bounce.get();
  }
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n =
        ::pread(fd_, dst + done, out.size() - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(StatusCode::kIoError,
                         fmt::format("backup read at {} from {}", offset, path_), errno);
    }
    if (n == 0) return IoError(fmt::format("backup file {} ends before {}", path_, offset + done));
    done += static_cast<size_t>(n);
  }
  if (bounce) std::memcpy(out.data(), dst, out.size());
  return Status::Ok();
}

Status BackupFile::Flush() {
  {
    MutexLock lock(&mu_);
    while (free_slots_.size() != nslots_) FARMEM_RETURN_IF_ERROR(ReapLocked(true));
    FARMEM_RETURN_IF_ERROR(error_);
  }
  if (::fdatasync(fd_) != 0) {
    return ErrnoStatus(StatusCode::kIoError, fmt::format("fdatasync {}", path_), errno);
  }
  return Status::Ok();
}

}  // namespace farmem::blockdev
