#!/usr/bin/env bash
# Builds (if needed) and runs the libFuzzer targets over the frame parsers (fuzz_frame_parser) and
# the daemon's handshake parser (fuzz_handshake) for SECONDS each.
#
#   tests/fuzz/run_fuzz.sh BUILD_DIR SECONDS [extra libFuzzer flags...]
#
# BUILD_DIR is a clang fuzz build dir (-DFARMEM_FUZZ=ON), configured here if it does not exist,
# with $CC/$CXX if set, else the newest clang-19..16 installed: clang 14 and 15 cannot compile
# libstdc++'s std::expected (README.md). If BUILD_DIR already exists but cannot build this target
# (another fuzz script configured it with clang-14, or it is not a fuzz build), the target is
# built in BUILD_DIR/frame_parser instead. The committed seeds (tests/fuzz/corpus) are read, never
# written; what libFuzzer learns goes to BUILD_DIR/fuzz-corpus/frame_parser, crashes and their
# reproducers to BUILD_DIR/fuzz-artifacts/frame_parser/. Exit status 0: nothing found.
set -euo pipefail

if [[ $# -lt 2 || ! $2 =~ ^[0-9]+$ ]]; then
  echo "usage: $0 BUILD_DIR SECONDS [libFuzzer flags...]" >&2
  exit 2
fi
build_dir=$1
seconds=$2
shift 2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source_dir=$(cd "$here/../.." && pwd)

configure() {  # configure DIR with clang >= 16
  local dir=$1
  if [[ -z "${CXX:-}" ]]; then
    local v
    for v in 19 18 17 16 none; do
      if [[ $v != none ]] && command -v "clang++-$v" >/dev/null && command -v "clang-$v" >/dev/null
      then break; fi
    done
    if [[ $v == none ]]; then
      echo "run_fuzz.sh: needs clang 16 or newer (clang 14/15 cannot compile std::expected from" \
        "libstdc++ 12): apt-get install clang-16 libclang-rt-16-dev" >&2
      exit 1
    fi
    local CC=clang-$v CXX=clang++-$v
    export CC CXX
  fi
  mkdir -p "$dir"
  cmake -S "$source_dir" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFARMEM_FUZZ=ON \
    -DFARMEM_BUILD_BENCH=OFF -DFARMEM_WITH_VERBS=OFF >"$dir/configure.log" 2>&1 ||
    { cat "$dir/configure.log" >&2; exit 1; }
}

has_target() {
  # Not `ninja ... | grep -q`: under pipefail, grep -q leaving at the first match gives ninja a
  # SIGPIPE (its list is long) and the pipeline "fails" — a fuzz build that has the targets was
  # taken for one that has not (a local fresh-clone CI run failed so).
  local targets
  targets=$(ninja -C "$1" -t targets all 2>/dev/null) || return 1
  grep -q '^fuzz_frame_parser:' <<<"$targets" && grep -q '^fuzz_handshake:' <<<"$targets"
}

target_dir=$build_dir
if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
  configure "$build_dir"
elif ! has_target "$build_dir"; then
  target_dir=$build_dir/frame_parser
  [[ -f "$target_dir/CMakeCache.txt" ]] || configure "$target_dir"
fi
if ! has_target "$target_dir"; then
  echo "run_fuzz.sh: $target_dir cannot build fuzz_frame_parser; see $target_dir/configure.log" >&2
  grep -A3 "fuzz_frame_parser" "$target_dir/configure.log" >&2 || true
  exit 1
fi
cmake --build "$target_dir" --target fuzz_frame_parser fuzz_handshake

# Symbolized stack traces in crash reports: the llvm-symbolizer next to the compiler, else any.
if [[ -z "${ASAN_SYMBOLIZER_PATH:-}" ]]; then
  cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$target_dir/CMakeCache.txt")
  for symbolizer in "$(dirname "$(readlink -f "$cxx")")/llvm-symbolizer" \
      "$(command -v llvm-symbolizer || true)" /usr/lib/llvm-*/bin/llvm-symbolizer; do
    if [[ -x $symbolizer ]]; then
      export ASAN_SYMBOLIZER_PATH=$symbolizer
      break
    fi
  done
fi

status=0
# run_target NAME SEEDS_DIR MAX_LEN [what to say after "FAILED; reproducer in ARTIFACTS/"]
run_target() {
  local name=$1 seeds=$2 max_len=$3 hint=${4:-}
  local corpus=$build_dir/fuzz-corpus/$name artifacts=$build_dir/fuzz-artifacts/$name
  mkdir -p "$corpus" "$artifacts"
  echo "== fuzz_$name for ${seconds}s"
  # -rss_limit_mb: every length is checked before anything is allocated; a parser that allocates
  # much is a bug.
  if ! "$target_dir/bin/fuzz_$name" -max_total_time="$seconds" -max_len="$max_len" \
      -rss_limit_mb=1024 -timeout=10 -print_final_stats=1 -artifact_prefix="$artifacts/" \
      "${fuzz_flags[@]}" "$corpus" "$seeds"; then
    echo "fuzz_$name FAILED; reproducer in $artifacts/$hint" >&2
    status=1
  fi
}
fuzz_flags=("$@")
# -max_len: a full BATCH descriptor table (8 + 1024 * 24 bytes) plus headers fits.
run_target frame_parser "$here/corpus" 32768
# -max_len: two handshake buffers' worth (a frame is at most 24 + 1024 bytes) plus the mode bytes.
run_target handshake "$here/handshake_corpus" 4200 \
  " (commit it under tests/fuzz/handshake_regressions/ once fixed)"
exit $status
