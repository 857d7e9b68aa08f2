// How a lender takes and gives back one slab's memory (issue 12, docs/benchmarks.md):
// lease = map the pages in (mlock, MADV_POPULATE_WRITE or touching), unlease = give them back
// and make the next lease read zeros. Compared in the same run:
//   prefaulted  today's pool before memory on demand: memory stays, unlease = memset to zero
//   dontneed    populate/mlock at lease, munlock + MADV_DONTNEED at unlease (what farmemd does)
//   munmap      mmap(MAP_FIXED) + populate at lease, munmap at unlease
//   free        populate at lease, MADV_FREE + memset at unlease (memory returned lazily only)
// For each: mean lease and unlease time, and RSS right after the unlease.
// Usage: slab_memory_bench [slab MiB=64] [rounds=20] [--mlock]
#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "farmem/common/command_line.h"

namespace {

using Clock = std::chrono::steady_clock;

long RssKiB() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::strtol(line.c_str() + 6, nullptr, 10);
  }
  return -1;
}

bool g_mlock = false;

void Populate(uint8_t* p, size_t len) {
  if (g_mlock) {
    if (::mlock(p, len) != 0) std::perror("mlock");
    return;
  }
#ifdef MADV_POPULATE_WRITE
  if (::madvise(p, len, MADV_POPULATE_WRITE) == 0) return;
#endif
  for (size_t off = 0; off < len; off += 4096) p[off] = 0;
}

void Use(uint8_t* p, size_t len) {  // a client writes the slab (not timed)
  for (size_t off = 0; off < len; off += 4096) p[off] = 0x5a;
}

struct Result {
  double lease_ms = 0, unlease_ms = 0;
  long rss_after_kib = 0;
};

template <typename Lease, typename Unlease>
Result Run(int rounds, uint8_t* p, size_t len, Lease lease, Unlease unlease) {
  Result r;
  for (int i = 0; i < rounds; ++i) {
    auto t0 = Clock::now();
    lease(p, len);
    auto t1 = Clock::now();
    Use(p, len);
    auto t2 = Clock::now();
    unlease(p, len);
    auto t3 = Clock::now();
    r.lease_ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
    r.unlease_ms += std::chrono::duration<double, std::milli>(t3 - t2).count();
    r.rss_after_kib = RssKiB();
  }
  r.lease_ms /= rounds;
  r.unlease_ms /= rounds;
  return r;
}

void Print(const char* name, const Result& r, long base_kib) {
  std::printf("%-12s lease %8.2f ms   unlease %8.2f ms   RSS after unlease +%ld MiB\n", name,
              r.lease_ms, r.unlease_ms, (r.rss_after_kib - base_kib) / 1024);
}

}  // namespace

int main(int argc, char** argv) {
  size_t mib = 64;
  int rounds = 20;
  CLI::App app{"how a lender takes and gives back one slab's memory"};
  farmem::cli::AddVersionOption(app, "slab_memory_bench");
  app.add_option("slab-mib", mib, "slab size in MiB")->capture_default_str();
  app.add_option("rounds", rounds, "lease/unlease rounds per method")->capture_default_str();
  app.add_flag("--mlock", g_mlock, "populate by mlock (as farmemd without --no-mlock)");
  CLI11_PARSE(app, argc, argv);
  const size_t len = mib << 20;
  auto* p = static_cast<uint8_t*>(::mmap(nullptr, len, PROT_READ | PROT_WRITE,
                                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  if (p == MAP_FAILED) return 1;
  ::madvise(p, len, MADV_HUGEPAGE);
  const long base = RssKiB();
  std::printf("slab %zu MiB, %d rounds, populate by %s\n", mib, rounds,
              g_mlock ? "mlock" : "MADV_POPULATE_WRITE");

  // Baseline: the pool before memory on demand (prefaulted and kept; zeroed at unlease).
  Populate(p, len);
  Print("prefaulted",
        Run(
            rounds, p, len, [](uint8_t*, size_t) {},
            [](uint8_t* q, size_t n) { std::memset(q, 0, n); }),
        base);
  if (g_mlock) ::munlock(p, len);
  ::madvise(p, len, MADV_DONTNEED);

  Print("dontneed",
        Run(rounds, p, len, Populate,
            [](uint8_t* q, size_t n) {
              if (g_mlock) ::munlock(q, n);
              ::madvise(q, n, MADV_DONTNEED);
            }),
        base);
  Print("munmap",
        Run(
            rounds, p, len,
            [](uint8_t* q, size_t n) {
              void* m = ::mmap(q, n, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
              if (m == MAP_FAILED) std::abort();
              ::madvise(q, n, MADV_HUGEPAGE);
              Populate(q, n);
            },
            [](uint8_t* q, size_t n) {
              if (g_mlock) ::munlock(q, n);
              ::munmap(q, n);
            }),
        base);
  // munmap left a hole: map it again for the next method.
  ::mmap(p, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
         -1, 0);
  ::madvise(p, len, MADV_HUGEPAGE);
  Print("free",
        Run(rounds, p, len, Populate,
            [](uint8_t* q, size_t n) {
              if (g_mlock) ::munlock(q, n);
              std::memset(q, 0, n);  // MADV_FREE does not zero: the next lease must
              ::madvise(q, n, MADV_FREE);
            }),
        base);
  return 0;
}
