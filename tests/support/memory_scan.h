// Another process's memory through /proc/PID/mem: scans for a plaintext marker, for the tests
// that check that lenders hold no plaintext (tests/pagestore/page_store_crypto_test,
// tests/farptr/far_encryption_test), and bit flips in a daemon's slab pool from outside, for the
// chaos suite's `flip` fault (tests/chaos). The caller must be allowed to read (and, to flip,
// write) /proc/PID/mem: root, or the parent of `pid` under ptrace's rules.
#pragma once

#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "farmem/common/status.h"
#include "support/sanitizer.h"

namespace farmem::testing {

// Under ASan or TSan a process maps the sanitizer's shadow memory (tens of GiB to TiB, readable),
// which no scan through /proc/PID/mem reads within a timeout: tests skip their scans there.
// (kSanitized: support/sanitizer.h.)
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

// One mapping of /proc/PID/maps (and its VmFlags from /proc/PID/smaps).
struct Mapping {
  uint64_t begin = 0, end = 0;
  std::string perms;     // "rw-p"
  std::string path;      // empty for anonymous memory
  std::string vm_flags;  // smaps' VmFlags ("rd wr mr mw me ac hg"); empty if not read
};

// Every mapping of process `pid`; with `flags`, each with its VmFlags (reads smaps: slower).
inline Result<std::vector<Mapping>> ReadMappings(pid_t pid, bool flags = false) {
  const std::string file = "/proc/" + std::to_string(pid) + (flags ? "/smaps" : "/maps");
  std::ifstream in(file);
  if (!in) return Err(Internal("cannot open " + file));
  std::vector<Mapping> out;
  std::string line;
  while (std::getline(in, line)) {
    if (flags && line.starts_with("VmFlags:")) {
      if (!out.empty()) out.back().vm_flags = line.substr(8);
      continue;
    }
    unsigned long long lo = 0, hi = 0;
    char perms[8] = {};
    int path_at = -1;
    if (std::sscanf(line.c_str(), "%llx-%llx %7s %*s %*s %*s %n", &lo, &hi, perms, &path_at) < 3) {
      continue;
    }
    Mapping m{lo, hi, perms, path_at > 0 ? line.substr(static_cast<size_t>(path_at)) : "", ""};
    out.push_back(std::move(m));
  }
  return out;
}

// Occurrences of `marker` in every readable mapping of process `pid` — the whole address space,
// not only a slab pool: no copy anywhere may hold it. *scanned gets the bytes read.
inline Result<size_t> CountMarkerInProcess(pid_t pid, std::string_view marker, uint64_t* scanned) {
  *scanned = 0;
  FARMEM_ASSIGN_OR_RETURN(std::vector<Mapping> maps, ReadMappings(pid));
  const int fd = ::open(("/proc/" + std::to_string(pid) + "/mem").c_str(), O_RDONLY);
  if (fd < 0) {
    return Err(ErrnoStatus(StatusCode::kInternal,
                           "open /proc/" + std::to_string(pid) + "/mem (this test needs root)",
                           errno));
  }
  constexpr size_t kChunk = 1 << 20;
  size_t found = 0;
  std::vector<char> buf;
  for (const Mapping& m : maps) {
    if (m.perms[0] != 'r' || m.path == "[vvar]" || m.path == "[vsyscall]") continue;
    for (uint64_t at = m.begin; at < m.end; at += kChunk) {
      // Each chunk read with the marker's length beyond it, and a marker counted only where it
      // starts inside the chunk: one across two chunks is seen once.
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk + marker.size(), m.end - at));
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

// The slab pool of farmemd `pid`: slab_pool.cc maps it as one private anonymous region of
// `pool_bytes` (--capacity rounded down to whole slabs, MAP_NORESERVE: VmFlags "nr") and marks
// it MADV_NOHUGEPAGE ("nh"; MADV_HUGEPAGE, "hg", with --populate-at-start, and a slab while it
// is collapsed into huge pages); mlock of single slabs splits it into several mappings, so
// adjacent anonymous mappings are joined, and the run of exactly `pool_bytes` is the pool (among
// the runs so flagged first).
inline Result<std::pair<uint64_t, uint64_t>> FindSlabPool(pid_t pid, uint64_t pool_bytes) {
  FARMEM_ASSIGN_OR_RETURN(std::vector<Mapping> maps, ReadMappings(pid, /*flags=*/true));
  for (const bool need_flag : {true, false}) {
    uint64_t begin = 0, end = 0;
    for (const Mapping& m : maps) {
      // Thread stacks are "nh" too, glibc's arenas "nr": the pool is both (MAP_NORESERVE).
      const bool flagged = (m.vm_flags.find(" hg") != std::string::npos ||
                            m.vm_flags.find(" nh") != std::string::npos) &&
                           m.vm_flags.find(" nr") != std::string::npos;
      const bool anon = m.path.empty() && m.perms.starts_with("rw");
      if (!anon || (need_flag && !flagged)) {
        if (end - begin == pool_bytes) return std::pair{begin, end};
        begin = end = 0;
        continue;
      }
      if (m.begin != end) {
        if (end - begin == pool_bytes) return std::pair{begin, end};
        begin = m.begin;
      }
      end = m.end;
    }
    if (end - begin == pool_bytes && end != 0) return std::pair{begin, end};
  }
  return Err(NotFound("process " + std::to_string(pid) + " has no anonymous mapping of exactly " +
                      std::to_string(pool_bytes) +
                      " bytes (the slab pool of a farmemd with that --capacity)"));
}

// Flips one bit in each of up to `pages` distinct 4 KiB pages of [begin, end) of process `pid`
// that hold data: at a random non-zero byte of a random non-zero page. In a slab pool only leased
// and written memory is non-zero (a slab never leased, or freed, reads as zeros: MADV_DONTNEED),
// so every flip lands on data a client wrote. Returns the addresses flipped (fewer than `pages`
// when fewer pages hold data). The bytes are read and written back through /proc/PID/mem while
// the process runs: a write of the process to that byte in between is lost, which is corruption
// too.
inline Result<std::vector<uint64_t>> FlipBitsInWrittenPages(pid_t pid, uint64_t begin, uint64_t end,
                                                            size_t pages, uint64_t seed) {
  constexpr size_t kPage = 4096;
  const std::string mem = "/proc/" + std::to_string(pid) + "/mem";
  const int fd = ::open(mem.c_str(), O_RDWR);
  if (fd < 0)
    return Err(ErrnoStatus(StatusCode::kInternal, "open " + mem + " (needs root)", errno));
  std::vector<uint64_t> written;
  std::vector<uint8_t> buf(1 << 20);
  for (uint64_t at = begin; at < end; at += buf.size()) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), end - at));
    const ssize_t got = ::pread(fd, buf.data(), n, static_cast<off_t>(at));
    if (got <= 0) continue;
    for (size_t p = 0; p + kPage <= static_cast<size_t>(got); p += kPage) {
      const uint8_t* q = buf.data() + p;
      if (std::any_of(q, q + kPage, [](uint8_t b) { return b != 0; })) written.push_back(at + p);
    }
  }
  std::mt19937_64 rng(seed);
  std::shuffle(written.begin(), written.end(), rng);
  written.resize(std::min(written.size(), pages));
  std::vector<uint64_t> flipped;
  Status failed;
  for (const uint64_t page : written) {
    uint8_t bytes[kPage];
    if (::pread(fd, bytes, kPage, static_cast<off_t>(page)) != static_cast<ssize_t>(kPage)) {
      continue;
    }
    std::vector<size_t> nonzero;
    for (size_t i = 0; i < kPage; ++i) {
      if (bytes[i] != 0) nonzero.push_back(i);
    }
    if (nonzero.empty()) continue;  // freed meanwhile
    const size_t i = nonzero[rng() % nonzero.size()];
    const uint8_t flipped_byte = bytes[i] ^ static_cast<uint8_t>(1u << (rng() % 8));
    if (::pwrite(fd, &flipped_byte, 1, static_cast<off_t>(page + i)) != 1) {
      failed = ErrnoStatus(StatusCode::kInternal, "write " + mem, errno);
      break;
    }
    flipped.push_back(page + i);
  }
  ::close(fd);
  if (!failed.ok()) return Err(failed);
  return flipped;
}

}  // namespace farmem::testing
