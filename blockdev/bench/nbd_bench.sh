#!/usr/bin/env bash
# nbd_bench.sh: farmem-nbd (--backend memory) against nbdkit's memory plugin, in one run, with
# fio's nbd engine (libnbd) on a Unix socket: 4 KiB random reads and writes at queue depth 1 and
# 16, one connection each. Prints IOPS, mean and p99 latency (submission to completion, fio
# lat_ns) for both servers and the farmem-nbd/nbdkit ratios. nbdkit is the baseline measured in
# the same run: absolute numbers drift between runs and machines, compare the ratios.
#
#   blockdev/bench/nbd_bench.sh [--build-dir DIR] [--runtime SECONDS] [--repeat N] [--size SIZE]
#                               [--swap-safe] [--json-dir DIR]
#
# Defaults: build dir ./build, 10 s per job (after 2 s ramp), 3 repetitions, 1G export, swap-safe
# off for both (nbdkit without --swap, farmem-nbd --no-swap-safe), --swap-safe turns it on for
# both. Both servers run side by side; each workload runs on one then the other, back to back,
# with the order flipped every repetition, so that load drifting during the run (shared machine)
# hits both alike. The table shows the median over repetitions. The export is written once
# before the jobs so that reads hit allocated memory in both (nbdkit's memory plugin is sparse).
set -euo pipefail

build=build
runtime=10
repeat=3
size=1G
swap_safe=0
json_dir=
while [ $# -gt 0 ]; do
  case $1 in
    --build-dir) build=$2; shift 2 ;;
    --runtime) runtime=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --swap-safe) swap_safe=1; shift ;;
    --json-dir) json_dir=$2; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
done
farmem_nbd=$build/bin/farmem-nbd
for tool in fio nbdkit python3; do
  command -v $tool >/dev/null || { echo "$tool not found" >&2; exit 1; }
done
if [ ! -x "$farmem_nbd" ]; then
  echo "$farmem_nbd not built (cmake --build $build --target farmem-nbd)" >&2
  exit 1
fi

work=$(mktemp -d /tmp/nbd-bench.XXXXXX)
[ -n "$json_dir" ] || json_dir=$work
mkdir -p "$json_dir"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

wait_socket() {
  for _ in $(seq 600); do [ -S "$1" ] && return 0; sleep 0.05; done
  echo "no socket at $1" >&2
  exit 1
}

nbdkit_extra=()
farmem_extra=(--no-swap-safe)
if [ $swap_safe = 1 ]; then nbdkit_extra=(--swap); farmem_extra=(); fi
nbdkit --foreground --unix "$work/nbdkit.sock" "${nbdkit_extra[@]}" memory "$size" \
  2>"$work/nbdkit.log" &
pids+=($!)
"$farmem_nbd" --backend memory --size "$size" --unix "$work/farmem.sock" --log-level warn \
  "${farmem_extra[@]}" 2>"$work/farmem.log" &
pids+=($!)
for server in nbdkit farmem; do
  wait_socket "$work/$server.sock"
  # Allocate every page of the export (1 MiB sequential writes).
  fio --name=prefill --ioengine=nbd --uri="nbd+unix:///?socket=$work/$server.sock" --rw=write \
    --bs=1m --iodepth=8 --size="$size" >/dev/null
done

echo "fio $(fio --version | sed 's/fio-//'), nbdkit $(nbdkit --version | awk '{print $2}')," \
  "$(nproc) CPUs, export $size, ${runtime}s x $repeat per job, swap-safe=$swap_safe," \
  "load average $(cut -d' ' -f1-3 /proc/loadavg)"
for rep in $(seq "$repeat"); do
  order="nbdkit farmem"
  [ $((rep % 2)) = 0 ] && order="farmem nbdkit"
  for rw in randread randwrite; do
    for qd in 1 16; do
      for server in $order; do
        fio --name="$server-$rw-qd$qd" --ioengine=nbd \
          --uri="nbd+unix:///?socket=$work/$server.sock" --rw="$rw" --bs=4k --iodepth="$qd" \
          --numjobs=1 --size="$size" --time_based --runtime="$runtime" --ramp_time=2 \
          --lat_percentiles=1 --output-format=json \
          --output="$json_dir/$server-$rw-qd$qd-$rep.json" >/dev/null
      done
    done
  done
done
echo "load average at the end $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$json_dir" "$repeat" <<'EOF'
import json, statistics, sys
d, reps = sys.argv[1], int(sys.argv[2])
def one(server, rw, qd, rep):
    j = json.load(open(f"{d}/{server}-{rw}-qd{qd}-{rep}.json"))["jobs"][0]
    s = j["read" if rw == "randread" else "write"]
    lat = s["lat_ns"]
    return s["iops"], lat["mean"] / 1000.0, lat["percentile"]["99.000000"] / 1000.0
def median(server, rw, qd):
    runs = [one(server, rw, qd, r) for r in range(1, reps + 1)]
    return tuple(statistics.median(x[i] for x in runs) for i in range(3)), runs
print()
print(f"{'workload':<16}{'server':<12}{'IOPS':>10}{'mean us':>10}{'p99 us':>10}   IOPS per run")
for rw in ("randread", "randwrite"):
    for qd in (1, 16):
        res = {}
        for s, label in (("nbdkit", "nbdkit"), ("farmem", "farmem-nbd")):
            (iops, mean, p99), runs = median(s, rw, qd)
            res[s] = (iops, mean, p99)
            per_run = " ".join(f"{r[0]:.0f}" for r in runs)
            print(f"{rw + ' qd' + str(qd):<16}{label:<12}{iops:>10.0f}{mean:>10.1f}{p99:>10.1f}"
                  f"   {per_run}")
        (bi, bm, bp), (fi, fm, fp) = res["nbdkit"], res["farmem"]
        print(f"{'':<16}{'ratio f/n':<12}{fi / bi:>10.2f}{fm / bm:>10.2f}{fp / bp:>10.2f}")
EOF
