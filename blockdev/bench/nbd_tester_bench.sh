#!/usr/bin/env bash
# nbd_tester_bench.sh: the NBD project's own test client, nbd-tester-client (NetworkBlockDevice/nbd,
# tests/run), against farmem-nbd and against `nbdkit memory` in ONE run — the client issue 13
# measured sub-page writes with (1 KiB requests; its integrity test replays a transaction log of
# mixed-size reads and writes, 68,990 requests, and checks every byte it reads back).
#
#   tests    tput       read throughput (nbd-tester-client with no flag)
#            write      write throughput (-w)
#            flush      read throughput with flushes (-f)
#            wflush     write throughput with flushes (-w -f)
#            integrity  the integrity test (-i -t tests/run/integrity-test.tr)
#   targets  nbdkit-mem        nbdkit memory
#            farmem-ec         farmem-nbd --resilience ec:4+2 (the default stripe layout)
#            farmem-none       farmem-nbd --resilience none
#            (both: write cache and encryption on, the defaults; six loopback daemons, tcp)
#
#   blockdev/bench/nbd_tester_bench.sh --tester PATH [--build-dir DIR] [--repeat N]
#                                      [--targets "a b ..."] [--tests "tput write ..."]
#
# nbd-tester-client is not packaged in Debian; build it from the upstream repository (needs
# libglib2.0-dev, autoconf, automake, libtool, autoconf-archive, bison, flex, pkg-config):
#   git clone https://github.com/NetworkBlockDevice/nbd && cd nbd && ./autogen.sh &&
#   ./configure --disable-manpages --without-gnutls && make && make -C tests/run nbd-tester-client
# --tester is then nbd/tests/run/nbd-tester-client; integrity-test.tr (made by that make) is taken
# from the same directory.
#
# Every test runs on a fresh server (the integrity test needs a fresh export: it checks what it
# reads against what it wrote), each test on every target back to back, the order rotated every
# repetition. Reported: the time nbd-tester-client prints for each test ("Took N seconds"), the
# median per target and the ratio to nbdkit-mem. A test that fails (a wrong byte, a bad reply)
# is printed and makes the script exit 1.
# Defaults: build dir ./build, 3 repetitions, all tests, all targets, 256M exports.
set -euo pipefail

build=build
repeat=3
tester=''
targets="nbdkit-mem farmem-ec farmem-none"
tests="tput write flush wflush integrity"
while [ $# -gt 0 ]; do
  case $1 in
    --build-dir) build=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --tester) tester=$2; shift 2 ;;
    --targets) targets=$2; shift 2 ;;
    --tests) tests=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
done
[ -x "$tester" ] || { echo "--tester: an nbd-tester-client binary is needed (see --help for how to build one)" >&2; exit 2; }
trlog=$(dirname "$tester")/integrity-test.tr
case " $tests " in
  *" integrity "*) [ -f "$trlog" ] || { echo "$trlog is missing (make -C tests/run nbd-tester-client makes it)" >&2; exit 2; } ;;
esac
bin=$build/bin
# bench_require, wait_file, start_farmemds (six farmemd on loopback), bench_cleanup
# shellcheck source=blockdev/bench/bench_lib.sh
source "$(dirname "$0")/bench_lib.sh"
bench_require nbdkit python3
work=$(mktemp -d /tmp/nbd-tester-bench.XXXXXX)
pids=()
trap bench_cleanup EXIT
peers=''
# shellcheck disable=SC2034  # filled by start_farmemds (a nameref)
daemon_pids=()
start_farmemds peers daemon_pids d 6 --capacity 512M --slab-size 64M

# start_server TARGET: a fresh server for one test on $work/TARGET.sock; its pid in $spid.
start_server() {
  rm -f "$work/$1.sock"
  case $1 in
    nbdkit-mem) nbdkit --foreground --unix "$work/$1.sock" -e t1 memory 256M 2>>"$work/$1.log" & ;;
    farmem-ec | farmem-none)
      local res=none
      [ "$1" = farmem-ec ] && res=ec:4+2
      "$bin/farmem-nbd" --backend farmem --peers "$peers" --secret-file "$work/secret" \
        --resilience "$res" --transport tcp --size 256M --unix "$work/$1.sock" --export-name t1 \
        --log-level warn --no-swap-safe 2>>"$work/$1.log" & ;;
    *) echo "unknown target $1" >&2; exit 2 ;;
  esac
  spid=$!
  pids+=("$spid")
  wait_file -S "$work/$1.sock"
}
tester_args() {
  case $1 in
    tput) ;;
    write) echo "-w" ;;
    flush) echo "-f" ;;
    wflush) echo "-w -f" ;;
    integrity) echo "-i -t $trlog" ;;
    *) echo "unknown test $1" >&2; exit 2 ;;
  esac
}

echo "nbd-tester-client $tester, nbdkit $(nbdkit --version | awk '{print $2}'), $(nproc) CPUs," \
  "export 256M, $repeat repetitions, uptime: $(uptime)"
read -r -a tlist <<<"$targets"
n=${#tlist[@]}
failed=0
: >"$work/results"
for rep in $(seq "$repeat"); do
  for test in $tests; do
    for ((i = 0; i < n; i++)); do
      t=${tlist[$(((i + rep) % n))]}
      start_server "$t"
      # shellcheck disable=SC2046  # the test's flags are words
      if "$tester" -u "$work/$t.sock" -N t1 $(tester_args "$test") >"$work/out" 2>&1; then
        took=$(grep -o "Took [0-9.]* seconds" "$work/out" | tail -1 | awk '{print $2}')
        echo "$test $t $rep ${took:?nbd-tester-client printed no time}" >>"$work/results"
      else
        echo "FAILED: $test on $t (repetition $rep):" >&2
        tail -3 "$work/out" >&2
        failed=1
      fi
      kill "$spid"
      wait "$spid" 2>/dev/null || true
    done
  done
done
echo "uptime at the end: $(uptime)"
python3 - "$work/results" "$targets" "$tests" <<'EOF'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    test, target, _, took = line.split()
    runs[(test, target)].append(float(took))
targets, tests = sys.argv[2].split(), sys.argv[3].split()
print()
print(f"{'test':<11}{'target':<14}{'median s':>9}{'x nbdkit':>10}   seconds per run")
for test in tests:
    base = runs.get((test, "nbdkit-mem"))
    for t in targets:
        r = runs.get((test, t))
        if not r:
            print(f"{test:<11}{t:<14}{'-':>9}{'-':>10}   (no run passed)")
            continue
        ratio = f"{statistics.median(r) / statistics.median(base):.2f}" if base else "-"
        print(f"{test:<11}{t:<14}{statistics.median(r):>9.2f}{ratio:>10}   "
              + " ".join(f"{x:.2f}" for x in r))
EOF
exit "$failed"
