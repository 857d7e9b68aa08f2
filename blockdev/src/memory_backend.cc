// MemoryBackend: an NBD export in this process's RAM. See block_backend.h.
#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "farmem/blockdev/block_backend.h"

namespace farmem::blockdev {

Result<std::unique_ptr<MemoryBackend>> MemoryBackend::Create(uint64_t size) {
  if (size == 0 || size % 512 != 0) {
    return Err(InvalidArgument(
        fmt::format("memory backend size {} is not a non-zero multiple of 512 bytes", size)));
  }
  // MAP_POPULATE: allocate every page now, so that serving a request never takes a page fault
  // that needs free memory (the kernel may be swapping to us because there is none).
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED) {
    return Err(ErrnoStatus(StatusCode::kResourceExhausted,
                           fmt::format("cannot map {} bytes for the memory backend", size), errno));
  }
  return std::unique_ptr<MemoryBackend>(new MemoryBackend(static_cast<uint8_t*>(p), size));
}

MemoryBackend::~MemoryBackend() { ::munmap(base_, size_); }

Status MemoryBackend::CheckRange(uint64_t offset, uint64_t length, const char* what) const {
  if (length > size_ || offset > size_ - length) {
    return OutOfRange(fmt::format("{} of {} bytes at offset {} is beyond the end ({} bytes)", what,
                                  length, offset, size_));
  }
  return Status::Ok();
}

template <bool kExclusive, typename Fn>
void MemoryBackend::ForEachRegion(uint64_t offset, uint64_t length, Fn&& fn) {
  while (length > 0) {
    const uint64_t region_end = ((offset >> kRegionShift) + 1) << kRegionShift;
    const uint64_t n = std::min(length, region_end - offset);
    SharedMutex& mu = StripeFor(offset);
    if constexpr (kExclusive) {
      WriterLock lock(&mu);
      fn(offset, n);
    } else {
      ReaderLock lock(&mu);
      fn(offset, n);
    }
    offset += n;
    length -= n;
  }
}

Status MemoryBackend::Read(uint64_t offset, std::span<uint8_t> buf) {
  FARMEM_RETURN_IF_ERROR(CheckRange(offset, buf.size(), "read"));
  uint8_t* dst = buf.data();
  ForEachRegion<false>(offset, buf.size(), [&](uint64_t off, uint64_t n) {
    std::memcpy(dst, base_ + off, n);
    dst += n;
  });
  return Status::Ok();
}

Status MemoryBackend::Write(uint64_t offset, std::span<const uint8_t> data, bool /*fua*/) {
  FARMEM_RETURN_IF_ERROR(CheckRange(offset, data.size(), "write"));
  const uint8_t* src = data.data();
  ForEachRegion<true>(offset, data.size(), [&](uint64_t off, uint64_t n) {
    std::memcpy(base_ + off, src, n);
    src += n;
  });
  return Status::Ok();
}

Status MemoryBackend::Trim(uint64_t offset, uint64_t length, bool fua) {
  // Zeroing (rather than ignoring the hint) keeps what a client reads back deterministic. The
  // pages are not given back (madvise would fail on mlock'ed memory anyway): the memory was
  // allocated up front on purpose.
  return WriteZeroes(offset, length, /*may_trim=*/true, fua);
}

Status MemoryBackend::WriteZeroes(uint64_t offset, uint64_t length, bool /*may_trim*/,
                                  bool /*fua*/) {
  FARMEM_RETURN_IF_ERROR(CheckRange(offset, length, "write zeroes"));
  ForEachRegion<true>(offset, length,
                      [&](uint64_t off, uint64_t n) { std::memset(base_ + off, 0, n); });
  return Status::Ok();
}

}  // namespace farmem::blockdev
