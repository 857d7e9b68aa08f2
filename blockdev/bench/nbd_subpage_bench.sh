#!/usr/bin/env bash
# nbd_subpage_bench.sh: writes smaller than a page (issue 13, item 2) on farmem-nbd with its write
# cache on (the default, --write-cache-pages 256) and off (--write-cache-pages 0), against
# `nbdkit memory` (the local-RAM ceiling of an NBD server), in ONE run, with fio's nbd engine:
#
#   randwrite 512 B, 1 KiB and 4 KiB (for comparison) at queue depth 16, and sequential 1 KiB
#   writes at depth 16 (what nbd-tester-client's write-throughput test sends), one connection.
#   A workload is RW:BS[:DEPTH] (depth 16 if not given, e.g. randwrite:1k:1), or mixed[:DEPTH]:
#   the mixed-size integrity job (what nbd-tester-client's integrity test stands for, harsher:
#   depth 16, every block at a random 512 B-aligned offset; the client itself is run by
#   nbd_tester_bench.sh): random writes of 512 B to 128 KiB (fio bssplit
#   512/20:1k/20:4k/30:16k/20:128k/10) over 64 MiB of the export (--mixed-size), each block checked
#   afterwards (--verify=crc32c: fio reads it back; a mismatch fails the run); its IOPS are those
#   of the write phase, not time-based.
#
#   targets  nbdkit-mem        nbdkit memory
#            farmem-ec         farmem-nbd --resilience ec:4+2 --ec-layout split (write cache on,
#                              encryption on; the split layout, as its recorded figures)
#            farmem-ec-nocache the same with --write-cache-pages 0
#            farmem-none, farmem-none-nocache: --resilience none, cache on / off
#            farmem-ec-split, farmem-ec-stripe: ec:4+2 with that --ec-layout given explicitly
#                              (stripe is the default)
#            any farmem target + "-plain" (before -pN / -nocache, e.g. farmem-none-plain): with
#                              --no-encrypt (the page cipher's share of the cost)
#            any farmem target + "-alt" (last, e.g. farmem-none-p256-alt): run by the farmem-nbd
#                              binary that --alt-nbd names (another build, A/B in one run)
#            any farmem target + "-pN" (e.g. farmem-none-p256): --write-cache-pages N (the cache's
#            size, for a comparison of sizes in one run; -nocache is -p0)
#
#   blockdev/bench/nbd_subpage_bench.sh [--build-dir DIR] [--runtime SECONDS] [--repeat N]
#                                       [--size SIZE] [--targets "a b ..."]
#                                       [--workloads "randwrite:1k write:1k ..."] [--alt-nbd BIN]
#                                       [--mixed-size SIZE] [--daemon-args "ARGS"]
#
# --daemon-args: extra farmemd arguments for the six daemons (e.g. "--no-huge-pages": one run
# with them, one without, to compare a daemon setting).
# Defaults: build dir ./build, 5 s per job (after 1 s ramp), 3 repetitions, 256M export, all
# targets. Six farmemd daemons on loopback (tcp, 64 MiB slabs) serve both farmem exports. Every
# export is written whole first (reads and fills then hit allocated memory everywhere). Each
# workload runs on every target back to back, the order rotated every repetition; the table shows
# the median IOPS and each repetition's, and the ratio to nbdkit-mem; a second table the CPU time
# per write of the NBD server and of the six farmemd (process CPU clocks over each job, so the
# cost of the daemons' share is seen beside farmem-nbd's); a third the write cache's pages written
# back and filled and the stripe layout's pages compacted per 1,000 writes (what the cache's size
# changes; load-independent).
set -euo pipefail

build=build
runtime=5
repeat=3
size=256M
targets="nbdkit-mem farmem-ec farmem-ec-nocache farmem-none farmem-none-nocache"
workloads="randwrite:512 randwrite:1k randwrite:4k write:1k"
alt_nbd=
mixed_size=64M
daemon_args=
while [ $# -gt 0 ]; do
  case $1 in
    --build-dir) build=$2; shift 2 ;;
    --runtime) runtime=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --targets) targets=$2; shift 2 ;;
    --workloads) workloads=$2; shift 2 ;;
    --alt-nbd) alt_nbd=$2; shift 2 ;;
    --mixed-size) mixed_size=$2; shift 2 ;;
    --daemon-args) daemon_args=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
done
bin=$build/bin
# bench_require, stop_pids, wait_file, start_farmemds (six farmemd on loopback, their ports), cpu_ns
# shellcheck source=blockdev/bench/bench_lib.sh
source "$(dirname "$0")/bench_lib.sh"
bench_require fio nbdkit python3
work=$(mktemp -d /tmp/nbd-subpage-bench.XXXXXX)
pids=()
trap bench_cleanup EXIT
has() { case " $targets " in *" $1 "*) return 0 ;; esac; return 1; }
declare -A tpid  # target -> the NBD server's pid (its CPU per write)

if has nbdkit-mem; then
  nbdkit --foreground --unix "$work/nbdkit-mem.sock" memory "$size" 2>"$work/nbdkit-mem.log" &
  pids+=($!)
  tpid[nbdkit-mem]=$!
fi
peers=''
daemon_pids=()
# shellcheck disable=SC2086  # --daemon-args is a list of words
start_farmemds peers daemon_pids d 6 --capacity 512M --slab-size 64M $daemon_args
for t in $targets; do
  case $t in nbdkit-mem) continue ;; farmem-*) ;; *) echo "unknown target $t" >&2; exit 2 ;; esac
  res=ec:4+2
  opts=()
  base=$t
  nbd=$bin/farmem-nbd
  case $base in
    *-alt)
      [ -n "$alt_nbd" ] || { echo "target $t needs --alt-nbd" >&2; exit 2; }
      nbd=$alt_nbd; base=${base%-alt} ;;
  esac
  case $base in
    *-nocache) opts+=(--write-cache-pages 0); base=${base%-nocache} ;;
    *-p[0-9]*) opts+=(--write-cache-pages "${base##*-p}"); base=${base%-p*} ;;
  esac
  case $base in *-plain) opts+=(--no-encrypt); base=${base%-plain} ;; esac
  case $base in
    farmem-none) res=none ;;
    farmem-ec) opts+=(--ec-layout split) ;;  # as its recorded figures
    farmem-ec-split) opts+=(--ec-layout split) ;;
    farmem-ec-stripe) opts+=(--ec-layout stripe) ;;
    *) echo "unknown target $t" >&2; exit 2 ;;
  esac
  "$nbd" --backend farmem --peers "$peers" --secret-file "$work/secret" \
    --resilience "$res" --transport tcp --size "$size" --unix "$work/$t.sock" --log-level warn \
    --no-swap-safe --metrics-listen 127.0.0.1:0 --metrics-port-file "$work/$t.mport" \
    "${opts[@]}" 2>"$work/$t.log" &
  pids+=($!)
  tpid[$t]=$!
done
for t in $targets; do
  wait_file -S "$work/$t.sock"
  nbd_prefill "$(nbd_uri "$t")" "$size"
done
echo "fio $(fio --version | sed 's/fio-//'), nbdkit $(nbdkit --version | awk '{print $2}'),${daemon_args:+ farmemd $daemon_args,}" \
  "$(nproc) CPUs, export $size, ${runtime}s x $repeat per job, uptime: $(uptime)"
# cache_counters TARGET: "writebacks fills writes" so far: its write cache's pages written back
# and filled (read to complete a partly written page), and the NBD writes it answered
# (--metrics-listen; 0 0 N with the cache off). Their growth over a job is the cost the cache's
# size can change, per 1,000 writes.
cache_counters() {
  curl -s "http://127.0.0.1:$(cat "$work/$1.mport")/metrics" |
    awk '$1 == "farmem_write_cache_writebacks_total" {w = $2}
         $1 == "farmem_write_cache_fills_total" {f = $2}
         $1 ~ /^farmem_export_requests_total[{].*op="write"/ {n += $2}
         $1 == "farmem_export_stripe_compacted_pages_total" {m = $2}
         END {print w + 0, f + 0, n + 0, m + 0}'
}
read -r -a tlist <<<"$targets"
n=${#tlist[@]}
for rep in $(seq "$repeat"); do
  for w in $workloads; do
    for ((i = 0; i < n; i++)); do
      t=${tlist[$(((i + rep) % n))]}
      out=$work/$t-${w//:/-}-$rep
      [ -f "$work/$t.mport" ] && cache_counters "$t" >"$out.c0"
      c0=$(cpu_ns "${tpid[$t]}") d0=$(cpu_ns "${daemon_pids[@]}")
      IFS=: read -r rw bs depth <<<"$w"
      if [ "$rw" = mixed ]; then  # mixed[:DEPTH]
        depth=${bs:-16}
        job=(--rw=randwrite --bssplit=512/20:1k/20:4k/30:16k/20:128k/10 --size="$mixed_size"
          --verify=crc32c --verify_fatal=1 --verify_state_save=0)
      else
        job=(--rw="$rw" --bs="$bs" --size="$size" --time_based --runtime="$runtime" --ramp_time=1)
      fi
      fio --name="$t" --ioengine=nbd --uri="$(nbd_uri "$t")" --iodepth="${depth:-16}" \
        --numjobs=1 "${job[@]}" --output-format=json --output="$out.json" >/dev/null
      c1=$(cpu_ns "${tpid[$t]}") d1=$(cpu_ns "${daemon_pids[@]}")
      echo "$((${c1%% *} - ${c0%% *})) $((${d1%% *} - ${d0%% *}))" >"$out.cpu"
      [ -f "$work/$t.mport" ] && cache_counters "$t" >"$out.c1"
    done
  done
done
echo "uptime at the end: $(uptime)"
python3 - "$work" "$repeat" "$targets" "$workloads" <<'EOF'
import json, statistics, sys
d, reps, targets, workloads = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()
print()
print(f"{'workload[:depth]':<18}{'target':<22}{'IOPS':>9}{'x nbdkit':>10}   IOPS per run")
for w in workloads:
    med = {}
    for t in targets:
        runs = [json.load(open(f"{d}/{t}-{w.replace(':', '-')}-{r}.json"))["jobs"][0]["write"]["iops"]
                for r in range(1, reps + 1)]
        med[t] = (statistics.median(runs), runs)
    for t in targets:
        ratio = f"{med[t][0] / med['nbdkit-mem'][0]:.2f}" if "nbdkit-mem" in med else "-"
        print(f"{w.replace(':', ' '):<18}{t:<22}{med[t][0]:>9.0f}{ratio:>10}   "
              + " ".join(f"{x:.0f}" for x in med[t][1]))
print()
print("CPU per write, us (median over repetitions; the NBD server's own, then the six farmemd's,")
print("whose background work of other targets, e.g. compaction, counts against the job that ran;")
print("for a mixed job the clocks also cover fio's verification reads, which its IOPS leave out):")
print(f"{'workload[:depth]':<18}{'target':<22}{'server':>9}{'farmemd':>9}{'sum':>9}")
for w in workloads:
    for t in targets:
        sv, dm = [], []
        for r in range(1, reps + 1):
            base = f"{d}/{t}-{w.replace(':', '-')}-{r}"
            ios = json.load(open(base + ".json"))["jobs"][0]["write"]["total_ios"]
            c = [int(x) for x in open(base + ".cpu").read().split()]
            if ios:
                sv.append(c[0] / 1000 / ios); dm.append(c[1] / 1000 / ios)
        if not sv: continue
        s_, d_ = statistics.median(sv), statistics.median(dm)
        dcol = "-" if t == "nbdkit-mem" else f"{d_:.1f}"
        tot = s_ if t == "nbdkit-mem" else s_ + d_
        print(f"{w.replace(':', ' '):<18}{t:<22}{s_:>9.1f}{dcol:>9}{tot:>9.1f}")
print()
print("write cache per 1,000 writes answered (all repetitions; compacted: pages the stripe")
print("layout's compaction moved meanwhile):")
print(f"{'workload[:depth]':<18}{'target':<22}{'written back':>14}{'filled':>10}{'compacted':>11}")
for w in workloads:
    for t in targets:
        if t == "nbdkit-mem": continue
        wb = fl = n = mv = 0
        for r in range(1, reps + 1):
            base = f"{d}/{t}-{w.replace(':', '-')}-{r}"
            try:
                c0 = [float(x) for x in open(base + ".c0").read().split()]
                c1 = [float(x) for x in open(base + ".c1").read().split()]
            except (OSError, ValueError):
                continue
            wb += c1[0] - c0[0]; fl += c1[1] - c0[1]; n += c1[2] - c0[2]; mv += c1[3] - c0[3]
        if n:
            print(f"{w.replace(':', ' '):<18}{t:<22}{1000 * wb / n:>14.0f}{1000 * fl / n:>10.0f}"
                  f"{1000 * mv / n:>11.0f}")
EOF
