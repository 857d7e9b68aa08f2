#!/usr/bin/env bash
# nbd_bench.sh: farmem-nbd against the other ways to get a swap-like block device, in ONE run, with
# fio: 4 KiB random reads and writes at queue depth 1 and 16, one connection / one job each.
#
#   target        what                                                        how fio reaches it
#   nbdkit-mem    `nbdkit memory`: the local-RAM ceiling of an NBD server       nbd engine, Unix socket
#   nbdkit-nbd    `nbdkit nbd` forwarding over loopback TCP to an `nbdkit        nbd engine, Unix socket
#                 memory` on another port (remote memory behind NBD today)
#   farmem-mem    farmem-nbd --backend memory (the NBD server path alone)       nbd engine, Unix socket
#   farmem-none   farmem-nbd --backend farmem --resilience none                 nbd engine, Unix socket
#   farmem-ec     farmem-nbd --backend farmem --resilience ec:4+2 --ec-layout   nbd engine, Unix socket
#                 split (Hydra's layout, pinned so that its figures stay comparable; the default
#                 layout, stripe, is farmem-ec-stripe)
#   disk          a file on the local disk, O_DIRECT, libaio (what swap on a    fio's own engine
#                 local disk does: direct block I/O, no page cache)
#   farmem-mem-metrics: farmem-mem with --metrics-listen on loopback, scraped every second while
#                 fio runs; farmem-none-metrics: farmem-none on six daemons of its own, farmem-nbd
#                 AND every farmemd with --metrics-listen, all seven scraped every second (the cost
#                 of the metrics, issue 14: farmem-none-metrics vs farmem-none); not in the default
#                 targets
#   farmem-none-prefaulted: farmem-none on six daemons of its own run with --populate-at-start
#                 (every slab populated at start, as farmemd did before memory on demand): the
#                 cost of memory on demand to steady-state I/O is farmem-none vs this; not in the
#                 default targets
#   farmem-none-alt: farmem-none on the same daemons, served by another farmem-nbd binary
#                 (--alt-nbd PATH, e.g. a build of an older commit): before/after comparisons,
#                 --ab "farmem-none farmem-none-alt"; not in the default targets
#   farmem-none-plain, farmem-ec-plain: farmem-none / farmem-ec with --no-encrypt (pages stored in
#                 plaintext): the cost of page encryption (docs/security.md) is farmem-none vs
#                 farmem-none-plain; not in the default targets. With any of them the run also
#                 prints `openssl speed` for AES-256-GCM on 4 KiB blocks, one core (the raw cost of
#                 sealing a page) as the baseline.
#   farmem-ec-stripe: ec:4+2 in the stripe layout, farmem-nbd's default (--ec-layout stripe:
#                 whole pages in stripes of 4 pages + 2 parity: a read is one message to one
#                 daemon; docs/nbd.md "Stripe layout"), on
#                 the same daemons; not in the default targets. Stripe vs split vs none in one
#                 run: --ab "farmem-ec-stripe farmem-ec" --baseline farmem-none
#   farmem-ec-stripe-plain: farmem-ec-stripe with --no-encrypt: the cost of page encryption with
#                 the default ec layout is farmem-ec-stripe vs this; not in the default targets
#   farmem-none-x: farmem-none with the extra farmem-nbd arguments of --x-args (a knob under test,
#                 e.g. --ab "farmem-none-x farmem-none" --x-args "--busy-poll-us 0"), on the
#                 same daemons; not in the default targets
#
# farmem-none, farmem-ec and the -plain targets share six farmemd daemons on loopback (tcp
# transport, 64 MiB slabs). Prints IOPS, mean and p99 latency (submission to completion, fio
# lat_ns) per target, the ratios the issue asks about, and whether its targets hold (farmem-none
# depth 16 >= 3x nbdkit-nbd and >= 0.6x nbdkit-mem; farmem-ec within 1.5x of farmem-none).
#
#   blockdev/bench/nbd_bench.sh [--build-dir DIR] [--runtime SECONDS] [--repeat N] [--size SIZE]
#                               [--targets "a b ..."] [--disk-dir DIR] [--swap-safe]
#                               [--json-dir DIR] [--cpu] [--alt-nbd PATH] [--bs SIZE]
#                               [--x-args "ARGS"]
#   blockdev/bench/nbd_bench.sh --ab "A B" [--pairs N] [--baseline TARGET|none]
#                               [--workloads "randread:1 randwrite:16 ..."] [other options]
#   blockdev/bench/nbd_bench.sh --instructions [--ios N] [--pairs N] [--size SIZE]
#                               [--workloads "..."] [--build-dir DIR]
#
# --bs SIZE: fio's block size for every job (default 4k), e.g. --bs 1m --workloads "read:8 write:8"
# (rw may be any of fio's: read, write, randread, randwrite).
#
# --cpu: also the servers' CPU time per request: the CPU time (user + system, all threads) of
# every process serving the target (nbdkit; farmem-nbd AND the farmemd daemons it uses) over each
# job, from their process CPU clocks (bench_lib.sh cpu_ns), divided by the requests fio
# completed. A loaded machine distorts it less than IOPS and latency: it is the cost of what runs
# on the request path, e.g. page encryption (farmem-none vs farmem-none-plain). It drops the ramp
# (--ramp_time 0) so that every request of the job is counted; the exports are written whole
# beforehand either way. Daemons shared by several targets are idle while another target's job
# runs (one job at a time), so each job's CPU is its own.
#
# --ab "A B": the on-vs-off mode for a shared, loaded machine, where one target's IOPS swing by
# several times between runs a minute apart. Only A, B and the baseline (default nbdkit-mem) are
# started. For each of --pairs N (default 12) and each workload (default randread and randwrite at
# depth 1 and 16, 4 KiB) it runs the baseline, then A and B back to back, A first in odd pairs and
# B first in even ones (A B | B A | A B ...: a drift in load hits both alike), each a short job
# (--runtime, default 3 s, no ramp). It prints per workload the median over pairs of the per-pair
# IOPS ratio A/B with a 95% confidence interval of that median (distribution-free, from order
# statistics), the per-pair difference of mean latency (A - B), and the servers' CPU per request
# (as --cpu, always on here, less each server set's background CPU rate measured over 5 s with no
# job) as the per-pair difference and ratio, and pooled over all pairs; then each target's
# medians and ranges, the baseline's among them; then the issues' targets for known pairs
# (farmem-none vs farmem-none-prefaulted, farmem-none-metrics vs farmem-none, farmem-none/ec vs
# -plain) as met / NOT MET / not resolved by this run, both from IOPS and from CPU per request
# (for a CPU-bound server, IOPS scale as 1 / CPU per request).
#
# --instructions: the cost of --metrics-listen (issue 14) in instructions, not seconds, so that the
# machine's load cannot move it: farmem-nbd (--resilience none on six loopback farmemd, as
# farmem-none) runs under valgrind's callgrind, once with --metrics-listen (scraped every second,
# as farmem-none-metrics) and once without, --pairs times each (default 1; off first in odd
# pairs). Each workload is one fio job of exactly --ios requests (default 20000; fio
# --number_ios, fixed random offsets) on a fresh connection, callgrind's counters zeroed before
# it and dumped after it (callgrind_control), so the count is every user-space instruction of
# every farmem-nbd thread while that job ran. Prints per workload the instructions per request
# with metrics off (the baseline) and on, their difference and ratio, for the request path (the
# NBD connection's thread, which runs each request to completion: the figure the <= 2% target is
# judged on), the background threads (heartbeats, timers: driven by time, so by how long the job
# took under callgrind, not by requests) and the whole process; and the metrics HTTP thread's
# cost per scrape, as how many requests' worth one scrape a second is. Also the clock_gettime calls per request: under valgrind they are system calls
# (no vDSO), so their user-space cost on a real machine (a vDSO read, tens of instructions) is
# missing from the count; the kernel's instructions (send/recv) are not counted either, so the
# share printed is an upper bound of the share of all instructions. Needs valgrind; --size
# defaults to 64M here (the export is written whole first, under callgrind too).
#
# Defaults: build dir ./build, 10 s per job (after 2 s ramp), 3 repetitions, 1G export/file, all
# targets, the disk file in ./build (it must be a real disk, not tmpfs: O_DIRECT), swap-safe off
# (nbdkit without --swap, farmem-nbd --no-swap-safe; --swap-safe turns it on for both). All servers
# run side by side; each workload runs on every target back to back, the order rotated every
# repetition so that load drifting during the run (shared machine) hits all alike. The table shows
# the median over repetitions and every repetition's IOPS. Each export/file is written whole before
# the jobs, so reads hit allocated memory / blocks everywhere (nbdkit's memory plugin is sparse,
# farmem maps remote slabs on first write).
set -euo pipefail

build=build
runtime=
repeat=3
size=1G
swap_safe=0
json_dir=
cpu=0
targets="nbdkit-mem nbdkit-nbd farmem-mem farmem-none farmem-ec disk"
disk_dir=
x_args=
ab=
pairs=12
baseline=nbdkit-mem
workloads="randread:1 randread:16 randwrite:1 randwrite:16"
alt_nbd=
bs=4k
instructions=0
ios=20000
size_given=0
pairs_given=0
while [ $# -gt 0 ]; do
  case $1 in
    --build-dir) build=$2; shift 2 ;;
    --runtime) runtime=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --size) size=$2; size_given=1; shift 2 ;;
    --targets) targets=$2; shift 2 ;;
    --disk-dir) disk_dir=$2; shift 2 ;;
    --swap-safe) swap_safe=1; shift ;;
    --json-dir) json_dir=$2; shift 2 ;;
    --cpu) cpu=1; shift ;;
    --ab) ab=$2; shift 2 ;;
    --pairs) pairs=$2; pairs_given=1; shift 2 ;;
    --instructions) instructions=1; shift ;;
    --ios) ios=$2; shift 2 ;;
    --baseline) baseline=$2; shift 2 ;;
    --workloads) workloads=$2; shift 2 ;;
    --alt-nbd) alt_nbd=$2; shift 2 ;;
    --bs) bs=$2; shift 2 ;;
    --x-args) x_args=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
done
if [ $instructions = 1 ]; then
  [ -z "$ab" ] || { echo "--instructions and --ab are two modes: choose one" >&2; exit 2; }
  [ $size_given = 1 ] || size=64M
  [ $pairs_given = 1 ] || pairs=1
fi
if [ -n "$ab" ]; then
  read -r ab_a ab_b ab_rest <<<"$ab"
  if [ -z "${ab_b:-}" ] || [ -n "${ab_rest:-}" ] || [ "$ab_a" = "$ab_b" ] ||
    [ "$baseline" = "$ab_a" ] || [ "$baseline" = "$ab_b" ]; then
    echo "--ab wants two different targets, neither of them the baseline," \
      "e.g. --ab \"farmem-none farmem-none-plain\"" >&2
    exit 2
  fi
  targets="$ab_a $ab_b"
  [ "$baseline" = none ] || targets="$baseline $targets"
  cpu=1
  : "${runtime:=3}"
else
  : "${runtime:=10}"
fi
[ -n "$disk_dir" ] || disk_dir=$build
bin=$build/bin
# bench_require, stop_pids, wait_file, bench_secret, start_farmemds, cpu_ns
# shellcheck source=blockdev/bench/bench_lib.sh
source "$(dirname "$0")/bench_lib.sh"
bench_require fio nbdkit python3

work=$(mktemp -d /tmp/nbd-bench.XXXXXX)
[ -n "$json_dir" ] || json_dir=$work
mkdir -p "$json_dir"
disk_file=$disk_dir/nbd-bench-disk.$$.img
pids=()
cleanup() {
  local rc=$?
  rm -f "$disk_file"
  bench_cleanup "$rc"
}
trap cleanup EXIT

has() { case " $targets " in *" $1 "*) return 0 ;; esac; return 1; }
declare -A server_pids  # target -> every process serving it (--cpu): NBD server and its daemons
if has farmem-none-alt && [ ! -x "$alt_nbd" ]; then
  echo "farmem-none-alt needs --alt-nbd PATH, a farmem-nbd binary" >&2
  exit 2
fi

nbdkit_extra=()
farmem_extra=(--no-swap-safe)
if [ $swap_safe = 1 ]; then nbdkit_extra=(--swap); farmem_extra=(); fi

# Each daemon's --capacity for exports adding up to HALVES/2 x --size spread over six daemons:
# doubled for placement slack, in whole 64 MiB slabs, at least 4 (memory is leased on demand, so
# the ceiling costs nothing until used; with --populate-at-start it is populated at start).
capacity_for() {
  python3 -c "import math,re,sys; m=re.fullmatch(r'(\d+)([KMG]?)',sys.argv[1]); \
v=int(m[1])*{'':1,'K':1<<10,'M':1<<20,'G':1<<30}[m[2]]; \
print(f'{max(4,math.ceil(v*int(sys.argv[2])/2*2/6/(64<<20)))*64}M')" "$size" "$1"
}
# start_farmem_nbd TARGET PEERS RESILIENCE DAEMON_PIDS [farmem-nbd args...]: an export of the
# remote page store on those daemons, served on $work/TARGET.sock.
start_farmem_nbd() {
  local t=$1 peers=$2 res=$3 dpids=$4
  shift 4
  local exe=$bin/farmem-nbd
  [ "$t" = farmem-none-alt ] && exe=$alt_nbd
  "$exe" --backend farmem --peers "$peers" --secret-file "$work/secret" \
    --resilience "$res" --transport tcp --size "$size" --unix "$work/$t.sock" \
    --log-level warn "${farmem_extra[@]}" "$@" 2>"$work/$t.log" &
  pids+=($!)
  server_pids[$t]="$! $dpids"
}

# ---- --instructions: metrics on vs off, counted by callgrind ------------------------------------
if [ $instructions = 1 ]; then
  bench_require valgrind callgrind_control curl
  ipeers=''
  # shellcheck disable=SC2034  # start_farmemds fills it (nameref)
  ipids=()
  start_farmemds ipeers ipids di 6 --capacity "$(capacity_for 2)" --slab-size 64M
  scrapes() { if [ -f "$1" ]; then wc -l <"$1"; else echo 0; fi; }
  echo "fio $(fio --version | sed 's/fio-//'), $(valgrind --version), $(nproc) CPUs, export $size," \
    "--resilience none on six loopback farmemd (tcp), swap-safe=$swap_safe, $ios requests per job," \
    "load average $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%H:%M) UTC"
  for p in $(seq "$pairs"); do
    order=(off on)
    [ $((p % 2)) = 0 ] && order=(on off)
    for v in "${order[@]}"; do
      metrics=()
      [ "$v" = on ] && metrics=(--metrics-listen 127.0.0.1:0 --metrics-port-file "$work/ins-$p.mport")
      rm -f "$work/ins.sock"
      valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file="$work/cg-$v-$p" \
        "$bin/farmem-nbd" --backend farmem --peers "$ipeers" --secret-file "$work/secret" \
        --resilience none --transport tcp --size "$size" --unix "$work/ins.sock" --log-level warn \
        "${farmem_extra[@]}" "${metrics[@]}" 2>"$work/ins-$v-$p.log" &
      vpid=$!
      pids+=("$vpid")
      # Under callgrind the start takes seconds (wait_file allows 30 s).
      for _ in $(seq 600); do [ -S "$work/ins.sock" ] && break; sleep 0.2; done
      wait_file -S "$work/ins.sock"
      nbd_prefill "$(nbd_uri ins)" "$size"
      scraper=''
      if [ "$v" = on ]; then
        wait_file -s "$work/ins-$p.mport"
        mport=$(cat "$work/ins-$p.mport")
        # As a (busy) Prometheus would: every second; one line per scrape in .scrapes.
        (while curl -sf "http://127.0.0.1:$mport/metrics" -o /dev/null; do
          echo >>"$work/ins-$p.scrapes"
          sleep 1
        done) &
        scraper=$!
        pids+=("$scraper")
      fi
      for w in $workloads; do
        rw=${w%%:*}
        qd=${w##*:}
        tag=$v-$rw-qd$qd-$p
        callgrind_control -z $vpid >/dev/null
        s0=$(scrapes "$work/ins-$p.scrapes")
        fio --name="$tag" --ioengine=nbd --uri="$(nbd_uri ins)" --rw="$rw" --bs="$bs" \
          --iodepth="$qd" --numjobs=1 --size="$size" --io_size=1T --number_ios="$ios" \
          --norandommap --randrepeat=1 --output-format=json --output="$json_dir/$tag.json" >/dev/null
        callgrind_control -d "$tag" $vpid >/dev/null
        s1=$(scrapes "$work/ins-$p.scrapes")
        echo $((s1 - s0)) >"$json_dir/$tag.scrapes"
        # The dump just made: one file per thread, cg-V-P.N-TID; kept as the job's.
        mkdir -p "$json_dir/$tag.cg"
        mv "$work/cg-$v-$p".[0-9]*-* "$json_dir/$tag.cg/"
      done
      [ -n "$scraper" ] && { kill "$scraper" 2>/dev/null || true; wait "$scraper" 2>/dev/null || true; }
      kill $vpid
      wait $vpid 2>/dev/null || true
    done
  done
  echo "load average at the end $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%H:%M) UTC"
  python3 - "$json_dir" "$pairs" "$workloads" <<'PY'
import glob, json, re, statistics, sys
d, n, workloads = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
def thread(path):
    """Ir of one thread's dump, what the thread is (the NBD connection's, the metrics HTTP
    thread, or another: heartbeats, timers, the write cache's flusher) and its calls to
    clock_gettime (callgrind's compressed names: "(id) name" defines, "(id)" refers)."""
    names, total, kind, clock, cfn = {}, 0, "other", 0, None
    for line in open(path, errors="replace"):
        m = re.match(r"(c?fn)=\((\d+)\)(?: (.*))?", line)
        if m:
            if m[3]:
                names[m[2]] = m[3]
            name = names.get(m[2], "")
            if m[1] == "fn" and "MetricsServer::" in name:
                kind = "metrics"
            elif m[1] == "fn" and "NbdConnection::" in name and kind == "other":
                kind = "conn"
            cfn = name if m[1] == "cfn" else None
            continue
        if line.startswith("calls=") and cfn is not None and re.search(r"\bclock_gettime\b", cfn):
            clock += int(line[6:].split()[0])
        m = re.match(r"(?:summary|totals): (\d+)", line)
        if m:
            total = int(m[1])
    return total, kind, clock
def job(v, rw, qd, p):
    tag = f"{v}-{rw}-qd{qd}-{p}"
    j = json.load(open(f"{d}/{tag}.json"))["jobs"][0]
    ios = j["read" if rw.endswith("read") else "write"]["total_ios"]
    ir = {"all": 0, "conn": 0, "metrics": 0, "other": 0}
    clock = {"conn": 0, "all": 0}
    for f in glob.glob(f"{d}/{tag}.cg/*"):
        t, kind, c = thread(f)
        ir["all"] += t
        ir[kind] += t
        clock["all"] += c
        if kind == "conn":
            clock["conn"] += c
    return {"ios": ios, "all": ir["all"] / ios, "conn": ir["conn"] / ios,
            "other": ir["other"] / ios, "met": ir["metrics"], "clock": clock["conn"] / ios,
            "secs": j["job_runtime"] / 1000, "scrapes": int(open(f"{d}/{tag}.scrapes").read())}
print()
print("instructions per request (user space; callgrind), metrics off (baseline) vs on; median"
      " over pairs [min-max]. request path = the NBD connection's thread (it runs each request to"
      " completion); background = every other thread but the metrics one (heartbeats, timers:"
      " driven by time, so by how long callgrind took, not by requests)")
print(f"{'workload':<16}{'what':<14}{'off (baseline)':>18}{'on':>18}{'on - off':>12}{'on/off':>9}"
      f"{'clock reads/req off, on':>26}")
share = {}
for w in workloads:
    rw, qd = w.split(":")
    off = [job("off", rw, qd, p) for p in range(1, n + 1)]
    on = [job("on", rw, qd, p) for p in range(1, n + 1)]
    for what, key in (("request path", "conn"), ("background", "other"), ("whole process", "all")):
        a = [x[key] for x in off]
        b = [x[key] for x in on]
        ma, mb = statistics.median(a), statistics.median(b)
        rng = lambda xs: f" [{min(xs):.0f}-{max(xs):.0f}]" if len(xs) > 1 else ""
        clk = (f"{statistics.median(x['clock'] for x in off):.2f}, "
               f"{statistics.median(x['clock'] for x in on):.2f}") if key == "conn" else ""
        print(f"{w.replace(':', ' qd'):<16}{what:<14}{ma:>10.0f}{rng(a):>8}{mb:>10.0f}{rng(b):>8}"
              f"{mb - ma:>+12.0f}{mb / ma:>9.4f}{clk:>26}")
        if key == "conn":
            share[w] = (mb - ma) / ma
    secs = (statistics.median(x["secs"] for x in off), statistics.median(x["secs"] for x in on))
    print(f"{'':<16}job time under callgrind off / on: {secs[0]:.1f} / {secs[1]:.1f} s")
    scr = sum(x["scrapes"] for x in on)
    met = sum(x["met"] for x in on)
    if scr > 0:
        per = met / scr
        worth = per / statistics.median(x["conn"] for x in off)
        print(f"{'':<16}metrics thread: {per:.0f} instructions per scrape ({scr} scrapes): one"
              f" scrape a second = {worth:.1f} requests' worth = {worth / 10000 * 100:.3f}% at"
              f" 10,000 requests/s")
print()
for w in workloads:
    s = share[w]
    print(f"issue 14: metrics on costs <= 2% (request path, instructions)  {w.replace(':', ' qd'):<16}"
          f"{s * 100:+.2f}%  {'met' if s <= 0.02 else 'NOT MET'}")
PY
  exit 0
fi

# ---- servers ----------------------------------------------------------------------------------------
if has nbdkit-mem; then
  nbdkit --foreground --unix "$work/nbdkit-mem.sock" "${nbdkit_extra[@]}" memory "$size" \
    2>"$work/nbdkit-mem.log" &
  pids+=($!)
  server_pids[nbdkit-mem]=$!
fi
if has nbdkit-nbd; then
  port=$((20000 + $$ % 20000))
  nbdkit --foreground --port "$port" --ipaddr 127.0.0.1 "${nbdkit_extra[@]}" memory "$size" \
    2>"$work/nbdkit-remote.log" &
  pids+=($!)
  remote=$!
  for _ in $(seq 200); do (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.05; done
  nbdkit --foreground --unix "$work/nbdkit-nbd.sock" "${nbdkit_extra[@]}" nbd hostname=127.0.0.1 \
    port="$port" 2>"$work/nbdkit-nbd.log" &
  pids+=($!)
  server_pids[nbdkit-nbd]="$! $remote"
fi
scrape_ports=()
for t in farmem-mem farmem-mem-metrics; do
  has $t || continue
  metrics=()
  if [ $t = farmem-mem-metrics ]; then
    metrics=(--metrics-listen 127.0.0.1:0 --metrics-port-file "$work/$t.mport")
    scrape_ports+=("$work/$t.mport")
  fi
  "$bin/farmem-nbd" --backend memory --size "$size" --unix "$work/$t.sock" \
    --log-level warn "${farmem_extra[@]}" "${metrics[@]}" 2>"$work/$t.log" &
  pids+=($!)
  server_pids[$t]=$!
done
# farmem-none, farmem-ec and their -plain twins share six daemons, with room for all of them
# (none 1x, ec:4+2 1.5x the export).
halves=0
for t in farmem-none farmem-none-plain farmem-none-alt farmem-none-x; do
  has $t && halves=$((halves + 2))
done
for t in farmem-ec farmem-ec-plain; do has $t && halves=$((halves + 3)); done
# The stripe layout holds up to its compaction trigger (1.5x) more than packed: 2.25x the export.
for t in farmem-ec-stripe farmem-ec-stripe-plain; do has $t && halves=$((halves + 5)); done
if [ $halves -gt 0 ]; then
  shared_pids=()
  peers=''
  start_farmemds peers shared_pids d 6 --capacity "$(capacity_for $halves)" --slab-size 64M
  for t in farmem-none farmem-ec farmem-none-plain farmem-ec-plain farmem-none-alt farmem-none-x \
    farmem-ec-stripe farmem-ec-stripe-plain; do
    has $t || continue
    res=none
    case $t in farmem-ec*) res=ec:4+2 ;; esac
    crypt=()
    case $t in *-plain) crypt=(--no-encrypt) ;; esac
    # shellcheck disable=SC2206  # --x-args is a list of words
    [ $t = farmem-none-x ] && crypt=($x_args)
    case $t in farmem-ec | farmem-ec-plain) crypt+=(--ec-layout split) ;; esac
    case $t in farmem-ec-stripe*) crypt+=(--ec-layout stripe) ;; esac
    start_farmem_nbd $t "$peers" $res "${shared_pids[*]}" "${crypt[@]}"
  done
fi
# farmem-none-prefaulted and farmem-none-metrics each on six daemons of their own, as large as
# farmem-none's when it runs alone, differing from them only in the flag compared.
if has farmem-none-prefaulted; then
  prefaulted_pids=()
  ppeers=''
  start_farmemds ppeers prefaulted_pids dprefaulted 6 --capacity "$(capacity_for 2)" \
    --slab-size 64M --populate-at-start
  start_farmem_nbd farmem-none-prefaulted "$ppeers" none "${prefaulted_pids[*]}"
fi
if has farmem-none-metrics; then
  metrics_pids=()
  mpeers=''
  start_farmemds mpeers metrics_pids dmetrics 6 --capacity "$(capacity_for 2)" --slab-size 64M \
    --metrics-listen 127.0.0.1:0 --metrics-port-file "$work/dmetrics{i}.mport"
  for i in 0 1 2 3 4 5; do scrape_ports+=("$work/dmetrics$i.mport"); done
  start_farmem_nbd farmem-none-metrics "$mpeers" none "${metrics_pids[*]}" \
    --metrics-listen 127.0.0.1:0 --metrics-port-file "$work/farmem-none-metrics.mport"
  scrape_ports+=("$work/farmem-none-metrics.mport")
fi

# fio options that reach a target
reach() {
  if [ "$1" = disk ]; then
    echo "--ioengine=libaio --direct=1 --filename=$disk_file"
  else
    echo "--ioengine=nbd --uri=$(nbd_uri "$1")"
  fi
}
for t in $targets; do
  [ "$t" = disk ] || wait_file -S "$work/$t.sock"
  # Allocate every page / block (1 MiB sequential writes).
  # shellcheck disable=SC2046
  fio --name=prefill $(reach "$t") --rw=write --bs=1m --iodepth=8 --size="$size" >/dev/null
done

# The metrics targets are scraped every second for the whole run, as a (busy) Prometheus would.
for f in "${scrape_ports[@]}"; do
  wait_file -s "$f"
  mport=$(cat "$f")
  (while curl -sf "http://127.0.0.1:$mport/metrics" -o /dev/null; do sleep 1; done) &
  pids+=($!)
done
echo "fio $(fio --version | sed 's/fio-//'), nbdkit $(nbdkit --version | awk '{print $2}')," \
  "$(nproc) CPUs, export $size, swap-safe=$swap_safe," \
  "disk file on $(df --output=source,fstype "$disk_dir" | tail -1 | tr -s ' ')," \
  "load average $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%H:%M) UTC"
if has farmem-none-plain || has farmem-ec-plain || has farmem-ec-stripe-plain; then
  # The raw cost of sealing one page on one core: AES-256-GCM, 4 KiB blocks (openssl's EVP, the
  # same AES-NI/PCLMUL code farmem-nbd calls). Opening costs the same.
  echo "baseline: $(openssl speed -seconds 3 -bytes 4096 -evp aes-256-gcm 2>/dev/null |
    awk 'tolower($1) ~ /^aes-256-gcm/ {kb=$NF; sub(/k$/,"",kb); printf "openssl AES-256-GCM 4 KiB, 1 core: %.0f MB/s = %.2f us per page", kb*1000/1e6, 4096/(kb*1000)*1e6}')"
fi

# run_job TARGET RW QD RAMP OUT: one fio job, 4 KiB, one connection; fio's JSON in OUT.json and,
# with --cpu, the servers' CPU time over the job in OUT.cpu ("NS" or "NS ticks", see cpu_ns) and
# their page faults over it in OUT.faults (bench_lib.sh page_faults).
run_job() {
  local t=$1 rw=$2 qd=$3 ramp=$4 out=$5 sp=${server_pids[$1]:-} c0='' c1 f0=''
  # shellcheck disable=SC2086  # $sp is a list of pids
  [ $cpu = 1 ] && [ -n "$sp" ] && c0=$(cpu_ns $sp) && f0=$(page_faults $sp)
  # shellcheck disable=SC2046
  fio --name="$t-$rw-qd$qd" $(reach "$t") --rw="$rw" --bs="$bs" --iodepth="$qd" \
    --numjobs=1 --size="$size" --time_based --runtime="$runtime" --ramp_time="$ramp" \
    --lat_percentiles=1 --output-format=json --output="$out.json" >/dev/null
  if [ -n "$c0" ]; then
    # shellcheck disable=SC2086
    c1=$(cpu_ns $sp)
    echo "$((${c1%% *} - ${c0%% *}))$(case "$c0$c1" in *ticks*) echo " ticks" ;; esac)" >"$out.cpu"
    # shellcheck disable=SC2086
    echo "$(($(page_faults $sp) - f0))" >"$out.faults"
  fi
}

if [ -n "$ab" ]; then
  # ---- A/B: baseline, then A and B back to back, their order swapped every pair ------------------
  echo "A/B: A = $ab_a, B = $ab_b, baseline $baseline; $pairs pairs x workloads ($workloads)," \
    "${runtime}s per job, no ramp"
  # Each server set's CPU while no job runs (heartbeats, timers, the metrics scrapes), per second
  # over 5 s: subtracted from each job's CPU (rate x the job's run time) so that a job the load
  # starved down to a few requests is not charged the background as per-request cost.
  for t in $targets; do
    # shellcheck disable=SC2086
    c0=$(cpu_ns ${server_pids[$t]})
    sleep 5  # the subject here is time: CPU used over an interval with no requests
    # shellcheck disable=SC2086
    c1=$(cpu_ns ${server_pids[$t]})
    echo "$(((${c1%% *} - ${c0%% *}) / 5))" >"$json_dir/$t.idle"
  done
  for p in $(seq "$pairs"); do
    for w in $workloads; do
      rw=${w%%:*}
      qd=${w##*:}
      order=("$ab_a" "$ab_b")
      [ $((p % 2)) = 0 ] && order=("$ab_b" "$ab_a")
      [ "$baseline" = none ] || run_job "$baseline" "$rw" "$qd" 0 "$json_dir/$baseline-$rw-qd$qd-$p"
      for t in "${order[@]}"; do run_job "$t" "$rw" "$qd" 0 "$json_dir/$t-$rw-qd$qd-$p"; done
    done
  done
  echo "load average at the end $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%H:%M) UTC"
  python3 - "$json_dir" "$pairs" "$ab_a" "$ab_b" "$baseline" "$workloads" <<'EOF'
import json, math, os, statistics, sys
d, n, a, b, base, workloads = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], \
    sys.argv[5], sys.argv[6].split()
coarse = False
idle = {t: int(open(f"{d}/{t}.idle").read()) for t in (a, b, base) if t != "none"}
def one(t, rw, qd, p):
    global coarse
    j = json.load(open(f"{d}/{t}-{rw}-qd{qd}-{p}.json"))["jobs"][0]
    s = j["read" if rw.endswith("read") else "write"]
    ns, *flag = open(f"{d}/{t}-{rw}-qd{qd}-{p}.cpu").read().split()
    coarse |= bool(flag)
    ios = max(s["total_ios"], 1)
    busy = max(int(ns) - idle[t] * j["job_runtime"] / 1000, 0)  # minus the background
    faults = int(open(f"{d}/{t}-{rw}-qd{qd}-{p}.faults").read())
    return {"iops": s["iops"], "lat": s["lat_ns"]["mean"] / 1000, "cpu": busy / 1000 / ios,
            "cpu_ns": busy, "ios": ios, "faults": faults}
def ci(xs):
    """Median with a distribution-free ~95% confidence interval (order statistics: the
    interval [x_(k), x_(n+1-k)] with P(Binomial(n, 1/2) < k) <= 2.5%); None if n is too small."""
    xs = sorted(xs)
    m, k, cum = len(xs), 0, 0.0
    for j in range(m + 1):
        cum += math.comb(m, j) / 2**m
        if cum > 0.025:
            break
        k = j + 1
    med = statistics.median(xs)
    if k == 0:
        return med, None, None
    return med, xs[k - 1], xs[m - k]
def fmt_ci(c, f):
    med, lo, hi = c
    return f"{f(med)} [{f(lo)}, {f(hi)}]" if lo is not None else f"{f(med)} [n too small]"
r2 = lambda x: f"{x:.3f}"
us = lambda x: f"{x:+.2f}"
res = {}
for w in workloads:
    rw, qd = w.split(":")
    A = [one(a, rw, qd, p) for p in range(1, n + 1)]
    B = [one(b, rw, qd, p) for p in range(1, n + 1)]
    Z = [one(base, rw, qd, p) for p in range(1, n + 1)] if base != "none" else []
    res[w] = {
        "iops": ci([x["iops"] / y["iops"] for x, y in zip(A, B)]),
        "lat": ci([x["lat"] - y["lat"] for x, y in zip(A, B)]),
        "cpud": ci([x["cpu"] - y["cpu"] for x, y in zip(A, B)]),
        "cpur": ci([x["cpu"] / y["cpu"] for x, y in zip(A, B)]),
        "A": A, "B": B, "Z": Z}
print()
print(f"A = {a}, B = {b}: per-pair values, median [95% CI of the median] over {n} pairs;")
print("CPU = servers' CPU time (NBD server + its farmemd) per request, us, less their background"
      " (idle CPU per s: " + ", ".join(f"{t} {v / 1e6:.1f} ms" for t, v in idle.items()) + ")" +
      (" (from clock ticks: COARSE)" if coarse else ""))
print(f"{'workload':<16}{'IOPS A/B':>24}{'mean lat A-B us':>28}{'CPU/req A-B us':>28}{'CPU/req A/B':>24}")
for w in workloads:
    r = res[w]
    print(f"{w.replace(':', ' qd'):<16}{fmt_ci(r['iops'], r2):>24}{fmt_ci(r['lat'], us):>28}"
          f"{fmt_ci(r['cpud'], us):>28}{fmt_ci(r['cpur'], r2):>24}")
print()
print("CPU per request pooled over all pairs (sum of CPU / sum of requests), us: A, B, A-B, A/B")
for w in workloads:
    r = res[w]
    pa, pb = (sum(x["cpu_ns"] for x in r[k]) / 1000 / sum(x["ios"] for x in r[k]) for k in "AB")
    r["pooled"] = (pa, pb)
    print(f"{w.replace(':', ' qd'):<16}{pa:>10.2f}{pb:>10.2f}{pa - pb:>+10.2f}{pa / pb:>10.3f}")
print()
print("servers' page faults (minor + major, every thread) per 1000 requests, all pairs: A, B")
for w in workloads:
    r = res[w]
    fa, fb = (1000 * sum(x["faults"] for x in r[k]) / sum(x["ios"] for x in r[k]) for k in "AB")
    print(f"{w.replace(':', ' qd'):<16}{fa:>10.3f}{fb:>10.3f}")
print()
print("medians per target (range over pairs): IOPS; mean latency us; CPU/req us")
for w in workloads:
    for name, runs in ((a, res[w]["A"]), (b, res[w]["B"]), (base + " (baseline)", res[w]["Z"])):
        if not runs:
            continue
        col = lambda k, f: (f"{f(statistics.median(x[k] for x in runs))} "
                            f"({f(min(x[k] for x in runs))}-{f(max(x[k] for x in runs))})")
        print(f"{w.replace(':', ' qd'):<16}{name:<32}{col('iops', lambda v: f'{v:.0f}'):>26}"
              f"{col('lat', lambda v: f'{v:.1f}'):>24}{col('cpu', lambda v: f'{v:.1f}'):>22}")
# The issues' targets, each written as (on, off): the ratio or difference of "on" to "off".
checks = [
    ("farmem-none", "farmem-none-prefaulted", "iops", ("1", "16"), 0.95,
     "issue 12: memory on demand vs prefaulted, IOPS within 5%"),
    ("farmem-none-metrics", "farmem-none", "iops", ("1", "16"), 0.98,
     "issue 14: metrics on vs off, <= 2% IOPS"),
    ("farmem-none", "farmem-none-plain", "iops", ("16",), 0.90,
     "issue 16: none, encryption <= 10% IOPS"),
    ("farmem-none", "farmem-none-plain", "lat", ("1",), 3.0,
     "issue 16: none, encryption <= 3 us added latency"),
    ("farmem-ec", "farmem-ec-plain", "iops", ("16",), 0.90,
     "issue 16: ec:4+2, encryption <= 10% IOPS"),
    ("farmem-ec", "farmem-ec-plain", "lat", ("1",), 3.0,
     "issue 16: ec:4+2, encryption <= 3 us added latency"),
    ("farmem-ec-stripe", "farmem-ec-stripe-plain", "iops", ("16",), 0.90,
     "issue 16: ec:4+2 stripe, encryption <= 10% IOPS"),
    ("farmem-ec-stripe", "farmem-ec-stripe-plain", "lat", ("1",), 3.0,
     "issue 16: ec:4+2 stripe, encryption <= 3 us added latency"),
]
def verdict(lo, hi, ok, bad):
    if lo is None:
        return "not resolved (too few pairs)"
    if ok(lo, hi):
        return "met"
    if bad(lo, hi):
        return "NOT MET"
    return "not resolved (the CI spans the target)"
lines = []
for on, off, kind, depths, want, text in checks:
    if {on, off} != {a, b}:
        continue
    flip = on != a  # the run's A is the "off" side: invert
    for w in workloads:
        rw, qd = w.split(":")
        if qd not in depths:
            continue
        r = res[w]
        if kind == "iops":
            med, lo, hi = r["iops"]
            if flip and lo is not None:
                med, lo, hi = 1 / med, 1 / hi, 1 / lo
            elif flip:
                med = 1 / med
            # CPU-bound server: IOPS on/off = CPU/req off/on
            cm, clo, chi = r["cpur"]
            if not flip and clo is not None:
                cm, clo, chi = 1 / cm, 1 / chi, 1 / clo
            elif not flip:
                cm = 1 / cm
            v1 = verdict(lo, hi, lambda l, h: l >= want, lambda l, h: h < want)
            v2 = verdict(clo, chi, lambda l, h: l >= want, lambda l, h: h < want)
            lines.append(f"{text:<52}{w.replace(':', ' qd'):<16}IOPS on/off {fmt_ci((med, lo, hi), r2)}: "
                         f"{v1}; 1/(CPU/req on/off) {fmt_ci((cm, clo, chi), r2)}: {v2}")
        else:
            sign = -1 if flip else 1
            def oriented(c):
                med, lo, hi = c
                if sign > 0 or lo is None:
                    return (sign * med, lo, hi) if lo is None else c
                return (-med, -hi, -lo)
            lm, llo, lhi = oriented(r["lat"])
            cm, clo, chi = oriented(r["cpud"])
            v1 = verdict(llo, lhi, lambda l, h: h <= want, lambda l, h: l > want)
            v2 = verdict(clo, chi, lambda l, h: h <= want, lambda l, h: l > want)
            lines.append(f"{text:<52}{w.replace(':', ' qd'):<16}mean latency on-off us "
                         f"{fmt_ci((lm, llo, lhi), us)}: {v1}; CPU/req on-off us "
                         f"{fmt_ci((cm, clo, chi), us)}: {v2}")
if lines:
    print()
    print("targets (met: the whole 95% CI on the right side; NOT MET: the whole CI on the wrong side)")
    for l in lines:
        print(l)
EOF
  exit 0
fi

read -r -a tlist <<<"$targets"
n=${#tlist[@]}
ramp=2
[ $cpu = 1 ] && ramp=0
echo "${runtime}s x $repeat per job"
for rep in $(seq "$repeat"); do
  for rw in randread randwrite; do
    for qd in 1 16; do
      for ((i = 0; i < n; i++)); do
        t=${tlist[$(((i + rep) % n))]}
        run_job "$t" "$rw" "$qd" $ramp "$json_dir/$t-$rw-qd$qd-$rep"
      done
    done
  done
done
echo "load average at the end $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$json_dir" "$repeat" "$targets" <<'EOF'
import json, math, os, statistics, sys
d, reps, targets = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
def one(t, rw, qd, rep):
    j = json.load(open(f"{d}/{t}-{rw}-qd{qd}-{rep}.json"))["jobs"][0]
    s = j["read" if rw.endswith("read") else "write"]
    lat = s["lat_ns"]
    cpu = math.nan  # server CPU per request, us (--cpu)
    f = f"{d}/{t}-{rw}-qd{qd}-{rep}.cpu"
    if os.path.exists(f) and s["total_ios"] > 0:
        cpu = int(open(f).read().split()[0]) / 1000 / s["total_ios"]
    return s["iops"], lat["mean"] / 1000.0, lat["percentile"]["99.000000"] / 1000.0, cpu
res = {}
print()
print(f"{'workload':<16}{'target':<21}{'IOPS':>10}{'mean us':>10}{'p99 us':>10}{'CPU us/req':>12}"
      "   IOPS per run; CPU us/req per run")
for rw in ("randread", "randwrite"):
    for qd in (1, 16):
        for t in targets:
            runs = [one(t, rw, qd, r) for r in range(1, reps + 1)]
            med = tuple(statistics.median(x[i] for x in runs) for i in range(4))
            res[(t, rw, qd)] = med
            per_run = " ".join(f"{r[0]:.0f}" for r in runs)
            if not math.isnan(med[3]):
                per_run += "; " + " ".join(f"{r[3]:.1f}" for r in runs)
            cpu = "-" if math.isnan(med[3]) else f"{med[3]:.1f}"
            print(f"{rw + ' qd' + str(qd):<16}{t:<21}{med[0]:>10.0f}{med[1]:>10.1f}{med[2]:>10.1f}"
                  f"{cpu:>12}   {per_run}")
ratios = [("farmem-none", "nbdkit-nbd"), ("farmem-none", "nbdkit-mem"), ("farmem-ec", "farmem-none"),
          ("farmem-mem", "nbdkit-mem"), ("farmem-none", "disk"), ("farmem-ec", "disk"),
          ("farmem-mem-metrics", "farmem-mem"), ("farmem-none-metrics", "farmem-none"),
          ("farmem-none", "farmem-none-plain"), ("farmem-ec", "farmem-ec-plain"),
          ("farmem-none", "farmem-none-prefaulted")]
ratios = [(a, b) for a, b in ratios if a in targets and b in targets]
if ratios:
    print()
    print("IOPS ratios (medians)")
    print(f"{'':<36}" + "".join(f"{rw[4:] + ' qd' + str(qd):>14}" for rw in ("randread", "randwrite")
                                for qd in (1, 16)))
    for a, b in ratios:
        print(f"{a + ' / ' + b:<36}" + "".join(
            f"{res[(a, rw, qd)][0] / res[(b, rw, qd)][0]:>14.2f}"
            for rw in ("randread", "randwrite") for qd in (1, 16)))
lat = [(a, b) for a, b in (("farmem-none", "farmem-none-plain"), ("farmem-ec", "farmem-ec-plain"))
       if a in targets and b in targets]
if lat:
    print()
    print("Encryption: added mean latency at qd1, us (target <= 3 us)")
    for a, b in lat:
        print(f"{a + ' - ' + b:<36}" + "".join(
            f"{rw + ' ' + format(res[(a, rw, 1)][1] - res[(b, rw, 1)][1], '+.1f'):>20}"
            for rw in ("randread", "randwrite")))
    if not math.isnan(res[(lat[0][0], "randread", 1)][3]):
        print()
        print("Encryption: servers' (farmem-nbd + farmemd) CPU added per request, us (medians; qd1 / qd16)")
        for a, b in lat:
            print(f"{a + ' - ' + b:<36}" + "".join(
                f"{rw + ' ' + format(res[(a, rw, 1)][3] - res[(b, rw, 1)][3], '+.1f') + ' / ' + format(res[(a, rw, 16)][3] - res[(b, rw, 16)][3], '+.1f'):>28}"
                for rw in ("randread", "randwrite")))
checks = [("farmem-none", "nbdkit-nbd", 3.0, "farmem-none qd16 IOPS >= 3x nbdkit-nbd"),
          ("farmem-none", "nbdkit-mem", 0.6, "farmem-none qd16 IOPS >= 0.6x nbdkit-mem"),
          ("farmem-ec", "farmem-none", 1 / 1.5, "farmem-ec qd16 IOPS within 1.5x of farmem-none"),
          ("farmem-none-metrics", "farmem-none", 0.98, "metrics on costs <= 2% IOPS (qd16)"),
          ("farmem-none", "farmem-none-plain", 0.90, "none: encryption costs <= 10% IOPS (qd16)"),
          ("farmem-ec", "farmem-ec-plain", 0.90, "ec:4+2: encryption costs <= 10% IOPS (qd16)"),
          ("farmem-none", "farmem-none-prefaulted", 0.95,
           "memory on demand costs <= 5% IOPS (qd16)")]
checks = [c for c in checks if c[0] in targets and c[1] in targets]
if checks:
    print()
    for a, b, want, text in checks:
        for rw in ("randread", "randwrite"):
            r = res[(a, rw, 16)][0] / res[(b, rw, 16)][0]
            print(f"target {text:<48} {rw:<10} {r:5.2f}  {'met' if r >= want else 'MISSED'}")
EOF
