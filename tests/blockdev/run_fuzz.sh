#!/usr/bin/env bash
# Builds and runs the NBD libFuzzer targets (tests/blockdev/fuzz/) for SECONDS each.
#
#   tests/blockdev/run_fuzz.sh BUILD_DIR SECONDS
#
# BUILD_DIR is a clang build: if it does not exist yet it is configured here with
# CC=clang-14 CXX=clang++-14 -DFARMEM_FUZZ=ON (only the fuzz targets are built in it; the rest of
# farmem needs GCC 12, whose std::expected clang-14 cannot compile). New interesting inputs go to
# BUILD_DIR/fuzz-corpus/<target>, crashes to BUILD_DIR/fuzz-artifacts/<target>/; the seed corpus
# in tests/blockdev/fuzz_corpus/ is read, never written. Exits non-zero if a target finds a crash.
set -euo pipefail

usage() { echo "usage: $0 BUILD_DIR SECONDS" >&2; exit 2; }
[ $# -eq 2 ] || usage
build=$1
seconds=$2
[[ $seconds =~ ^[0-9]+$ ]] || usage
src=$(cd "$(dirname "$0")/../.." && pwd)

if [ ! -f "$build/CMakeCache.txt" ]; then
  CC=${CC:-clang-14} CXX=${CXX:-clang++-14} cmake -S "$src" -B "$build" -G Ninja \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFARMEM_FUZZ=ON -DFARMEM_BUILD_BENCH=OFF >/dev/null
fi
if ! grep -q '^FARMEM_FUZZ:BOOL=ON' "$build/CMakeCache.txt"; then
  echo "$build was not configured with -DFARMEM_FUZZ=ON (and clang); use a fresh directory" >&2
  exit 2
fi
cmake --build "$build" --target nbd_request_fuzzer nbd_handshake_fuzzer

status=0
for target in request handshake; do
  corpus=$build/fuzz-corpus/nbd_$target
  artifacts=$build/fuzz-artifacts/nbd_$target
  mkdir -p "$corpus" "$artifacts"
  echo "== nbd_${target}_fuzzer for ${seconds}s"
  if ! "$build/bin/nbd_${target}_fuzzer" -max_total_time="$seconds" -max_len=12000 \
      -print_final_stats=1 -artifact_prefix="$artifacts/" \
      "$corpus" "$src/tests/blockdev/fuzz_corpus/$target"; then
    echo "nbd_${target}_fuzzer FAILED; reproducer in $artifacts/" >&2
    status=1
  fi
done
exit $status
