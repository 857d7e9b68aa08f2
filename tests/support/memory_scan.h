// Scans of another process's memory for a plaintext marker, for the tests that check that
// lenders hold no plaintext (tests/pagestore/page_store_crypto_test, tests/farptr/
// far_encryption_test). The caller must be allowed to read /proc/PID/mem (root, or the parent
// of `pid` under ptrace's rules).
#pragma once

#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "farmem/common/status.h"

namespace farmem::testing {

// Under ASan or TSan a process maps the sanitizer's shadow memory (tens of GiB to TiB, readable),
// which no scan through /proc/PID/mem reads within a timeout: tests skip their scans there.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif
inline constexpr char kNoScanUnderSanitizer[] =
    "a sanitizer build: scanning the daemons' memory through /proc/PID/mem would read the "
    "sanitizer's shadow memory (tens of GiB to TiB); run this case in the RelWithDebInfo build";

// Occurrences of `marker` in `hay`.
inline size_t CountMarker(std::string_view hay, std::string_view marker) {
  size_t n = 0;
  for (size_t at = hay.find(marker); at != std::string_view::npos; at = hay.find(marker, at + 1)) {
    ++n;
  }
  return n;
}

// Occurrences of `marker` in every readable mapping of process `pid` — the whole address space,
// not only a slab pool: no copy anywhere may hold it. *scanned gets the bytes read.
inline Result<size_t> CountMarkerInProcess(pid_t pid, std::string_view marker, uint64_t* scanned) {
  *scanned = 0;
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  if (!maps) return Err(Internal("cannot open /proc/" + std::to_string(pid) + "/maps"));
  const int fd = ::open(("/proc/" + std::to_string(pid) + "/mem").c_str(), O_RDONLY);
  if (fd < 0) {
    return Err(ErrnoStatus(StatusCode::kInternal,
                           "open /proc/" + std::to_string(pid) + "/mem (this test needs root)",
                           errno));
  }
  constexpr size_t kChunk = 1 << 20;
  size_t found = 0;
  std::string line;
  std::vector<char> buf;
  while (std::getline(maps, line)) {
    unsigned long long lo = 0, hi = 0;
    char perms[8] = {};
    if (std::sscanf(line.c_str(), "%llx-%llx %7s", &lo, &hi, perms) != 3) continue;
    if (perms[0] != 'r' || line.find("[vvar]") != std::string::npos ||
        line.find("[vsyscall]") != std::string::npos) {
      continue;
    }
    for (unsigned long long at = lo; at < hi; at += kChunk) {
      // Each chunk read with the marker's length beyond it, and a marker counted only where it
      // starts inside the chunk: one across two chunks is seen once.
      const size_t n =
          static_cast<size_t>(std::min<unsigned long long>(kChunk + marker.size(), hi - at));
      buf.resize(n);
      const ssize_t got = ::pread(fd, buf.data(), n, static_cast<off_t>(at));
      if (got <= 0) continue;  // e.g. a guard page
      *scanned += std::min<uint64_t>(static_cast<uint64_t>(got), kChunk);
      const char* p = buf.data();
      const char* end = buf.data() + got;
      while (p < end) {
        const void* hit = ::memmem(p, static_cast<size_t>(end - p), marker.data(), marker.size());
        if (hit == nullptr) break;
        const char* h = static_cast<const char*>(hit);
        if (h - buf.data() < static_cast<ptrdiff_t>(kChunk)) ++found;
        p = h + 1;
      }
    }
  }
  ::close(fd);
  return found;
}

}  // namespace farmem::testing
