/* swap_workload: touch a working set larger than the memory it is allowed, so the kernel must swap,
 * and check every byte comes back. Used by the vm tests (tests/vm/nbd_swap_smoke.sh) inside a
 * cgroup with a small memory.max.
 *
 *   swap_workload [-m MiB] [-p passes] [-r]
 *
 * Maps MiB of anonymous memory, writes a pattern that depends on the page, the word and a pass seed,
 * then re-reads and verifies it `passes` times (with -r every verify pass also rewrites the pages
 * with the next seed, so dirty pages keep going out). Exit 0 when all matched, 1 on the first
 * mismatch (printed), 2 on usage or mapping errors. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static uint64_t word_value(uint64_t page, uint64_t word, uint64_t seed) {
  uint64_t x = (page << 12) ^ (word * 0x9E3779B97F4A7C15ull) ^ (seed * 0xD1B54A32D192ED03ull);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return x;
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
  long mib = 256, passes = 2;
  int rewrite = 0, opt;
  while ((opt = getopt(argc, argv, "m:p:r")) != -1) {
    switch (opt) {
      case 'm': mib = strtol(optarg, NULL, 10); break;
      case 'p': passes = strtol(optarg, NULL, 10); break;
      case 'r': rewrite = 1; break;
      default:
        fprintf(stderr, "usage: %s [-m MiB] [-p passes] [-r]\n", argv[0]);
        return 2;
    }
  }
  if (mib <= 0 || passes < 0) {
    fprintf(stderr, "swap_workload: bad -m or -p\n");
    return 2;
  }
  const long page_size = sysconf(_SC_PAGESIZE);
  const uint64_t bytes = (uint64_t)mib << 20;
  const uint64_t pages = bytes / (uint64_t)page_size;
  const uint64_t words = (uint64_t)page_size / sizeof(uint64_t);
  uint64_t *mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    perror("swap_workload: mmap");
    return 2;
  }

  uint64_t seed = 1;
  double t = now();
  for (uint64_t p = 0; p < pages; ++p)
    for (uint64_t w = 0; w < words; ++w) mem[p * words + w] = word_value(p, w, seed);
  printf("swap_workload: wrote %ld MiB in %.2f s\n", mib, now() - t);
  fflush(stdout);

  for (long pass = 1; pass <= passes; ++pass) {
    t = now();
    for (uint64_t p = 0; p < pages; ++p) {
      uint64_t *pg = mem + p * words;
      for (uint64_t w = 0; w < words; ++w) {
        uint64_t want = word_value(p, w, seed);
        if (pg[w] != want) {
          printf("swap_workload: MISMATCH pass %ld page %llu word %llu: got %016llx want %016llx\n",
                 pass, (unsigned long long)p, (unsigned long long)w, (unsigned long long)pg[w],
                 (unsigned long long)want);
          return 1;
        }
      }
      if (rewrite)
        for (uint64_t w = 0; w < words; ++w) pg[w] = word_value(p, w, seed + 1);
    }
    if (rewrite) ++seed;
    printf("swap_workload: pass %ld verified %ld MiB%s in %.2f s\n", pass, mib,
           rewrite ? " and rewrote it" : "", now() - t);
    fflush(stdout);
  }
  munmap(mem, bytes);
  printf("swap_workload: OK\n");
  return 0;
}
