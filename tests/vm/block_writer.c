/* block_writer: rewrite random blocks of a block device with O_DIRECT until told to stop, read each
 * one back at once, and keep a mirror file of what the device must hold. Used by the kmod guest
 * test (tests/vm/kmod_smoke.sh) to keep writes landing in slabs while their copies are rebuilt:
 * a shell loop of dd forks got ~5 blocks through a rebuild under TCG, this gets hundreds.
 *
 *   block_writer DEV MIRROR FIRST NBLOCKS BS STOPFILE
 *
 * Blocks FIRST .. FIRST+NBLOCKS-1 of BS bytes (a multiple of 4096) are chosen at random; each gets
 * fresh pseudo-random bytes, is written to DEV, then to MIRROR at the same offset, then read back
 * from DEV and compared. Runs until STOPFILE exists. Prints the number of blocks written on exit.
 * Exit 0 when every read-back matched, 1 on a mismatch or an I/O error (printed), 2 on usage. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static uint64_t next(uint64_t *s) {
  uint64_t x = *s;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return *s = x;
}

static int full_io(int fd, void *buf, size_t len, off_t off, int write_it) {
  size_t done = 0;
  while (done < len) {
    ssize_t n = write_it ? pwrite(fd, (char *)buf + done, len - done, off + (off_t)done)
                         : pread(fd, (char *)buf + done, len - done, off + (off_t)done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return -1;
    done += (size_t)n;
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 7) {
    fprintf(stderr, "usage: %s DEV MIRROR FIRST NBLOCKS BS STOPFILE\n", argv[0]);
    return 2;
  }
  const char *dev = argv[1], *mirror = argv[2], *stop = argv[6];
  long first = strtol(argv[3], NULL, 10), nblocks = strtol(argv[4], NULL, 10);
  long bs = strtol(argv[5], NULL, 10);
  if (first < 0 || nblocks <= 0 || bs <= 0 || bs % 4096 != 0) {
    fprintf(stderr, "block_writer: FIRST >= 0, NBLOCKS > 0 and BS a multiple of 4096, please\n");
    return 2;
  }
  int dfd = open(dev, O_RDWR | O_DIRECT);
  int mfd = open(mirror, O_WRONLY);
  if (dfd < 0 || mfd < 0) {
    fprintf(stderr, "block_writer: open %s: %s\n", dfd < 0 ? dev : mirror, strerror(errno));
    return 1;
  }
  void *buf, *back;
  if (posix_memalign(&buf, 4096, (size_t)bs) || posix_memalign(&back, 4096, (size_t)bs)) {
    fprintf(stderr, "block_writer: out of memory\n");
    return 1;
  }
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  uint64_t seed = ((uint64_t)ts.tv_nsec << 20) ^ (uint64_t)getpid() ^ 0x9E3779B97F4A7C15ull;
  long n = 0;
  while (access(stop, F_OK) != 0) {
    long blk = first + (long)(next(&seed) % (uint64_t)nblocks);
    off_t off = (off_t)blk * bs;
    for (long i = 0; i < bs / 8; i++) ((uint64_t *)buf)[i] = next(&seed);
    if (full_io(dfd, buf, (size_t)bs, off, 1) != 0) {
      fprintf(stderr, "block_writer: write of block %ld failed: %s\n", blk, strerror(errno));
      return 1;
    }
    if (full_io(mfd, buf, (size_t)bs, off, 1) != 0) {
      fprintf(stderr, "block_writer: write of the mirror failed: %s\n", strerror(errno));
      return 1;
    }
    if (full_io(dfd, back, (size_t)bs, off, 0) != 0) {
      fprintf(stderr, "block_writer: read of block %ld failed: %s\n", blk, strerror(errno));
      return 1;
    }
    if (memcmp(buf, back, (size_t)bs) != 0) {
      fprintf(stderr, "block_writer: block %ld read back differs after %ld writes\n", blk, n);
      return 1;
    }
    n++;
  }
  printf("block_writer: %ld blocks of %ld bytes written and read back\n", n, bs);
  return 0;
}
