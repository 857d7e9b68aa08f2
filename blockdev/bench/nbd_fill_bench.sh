#!/usr/bin/env bash
# nbd_fill_bench.sh: the first fill of a fresh farmem-nbd export in the stripe layout (ec:4+2,
# the default layout), with the next slab group leased ahead (the default) and without
# (--no-lease-ahead, the baseline, in the same run): what a writer waits for when the groups in
# use run out of rows. fio's nbd engine writes the export whole once, sequential 4 KiB at depth 1
# (one connection), every request's latency logged.
#
#   blockdev/bench/nbd_fill_bench.sh [--build-dir DIR] [--pairs N] [--size SIZE]
#                                    [--slab-size SIZE]
#
# Defaults: build dir ./build, 3 pairs (on/off interleaved), a 1G export, 64M slabs (a group of
# 4+2 slabs then holds 256 MiB of pages: a 1G fill takes four groups). Each run gets six fresh
# farmemd daemons on loopback (tcp), so every group is leased during the fill. Printed per run:
# IOPS, mean and p99.9 latency, the writes that waited more than 20 ms (count, their sum, and the
# longest after the first: the first group is leased by the first write either way), and the
# export's groups_leased_ahead / groups_leased_by_writers counters (--metrics-listen).
set -euo pipefail

build=build
pairs=3
size=1G
slab=64M
while [ $# -gt 0 ]; do
  case $1 in
    --build-dir) build=$2; shift 2 ;;
    --pairs) pairs=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --slab-size) slab=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
done
bin=$build/bin
# bench_require, stop_pids, wait_file, start_farmemds
# shellcheck source=blockdev/bench/bench_lib.sh
source "$(dirname "$0")/bench_lib.sh"
bench_require fio curl python3
work=$(mktemp -d /tmp/nbd-fill-bench.XXXXXX)
pids=()
trap bench_cleanup EXIT

echo "fio $(fio --version | sed 's/fio-//'), $(nproc) CPUs, export $size, slabs $slab," \
  "$pairs pairs, uptime: $(uptime)"
for rep in $(seq "$pairs"); do
  # Interleaved, the order swapped every pair.
  order="on off"
  ((rep % 2 == 0)) && order="off on"
  for mode in $order; do
    tag=$mode$rep
    peers=''
    dpids=()
    # The export's worst case (1.5 x (k+r)/k x size plus a group) fits in six daemons of size.
    start_farmemds peers dpids "d$tag-" 6 --capacity "$size" --slab-size "$slab"
    opts=()
    [ "$mode" = off ] && opts+=(--no-lease-ahead)
    "$bin/farmem-nbd" --backend farmem --peers "$peers" --secret-file "$work/secret" \
      --resilience ec:4+2 --transport tcp --size "$size" --unix "$work/$tag.sock" \
      --log-level warn --metrics-listen 127.0.0.1:0 --metrics-port-file "$work/$tag.mport" \
      "${opts[@]}" 2>"$work/$tag.log" &
    nbd=$!
    pids+=("$nbd")
    wait_file -S "$work/$tag.sock"
    wait_file -s "$work/$tag.mport"
    fio --name=fill --ioengine=nbd --uri="$(nbd_uri "$tag")" --rw=write --bs=4k --iodepth=1 \
      --size="$size" --output-format=json --output="$work/$tag.json" \
      --write_lat_log="$work/$tag" --log_avg_msec=0 >/dev/null
    curl -s "http://127.0.0.1:$(cat "$work/$tag.mport")/metrics" >"$work/$tag.metrics"
    kill "$nbd"
    wait "$nbd" || true
    for p in "${dpids[@]}"; do kill "$p"; wait "$p" || true; done
    "$bench_python" - "$work" "$tag" "$mode" <<'PY'
import glob, json, sys
work, tag, mode = sys.argv[1:]
w = json.load(open(f"{work}/{tag}.json"))["jobs"][0]["write"]
lat = []
for f in sorted(glob.glob(f"{work}/{tag}_clat*.log")):
    lat += [int(line.split(",")[1]) for line in open(f)]
waits = [x for x in lat if x > 20_000_000]
after_first = max(waits[1:], default=0)
m = {}
for line in open(f"{work}/{tag}.metrics"):
    k, _, v = line.partition(" ")
    if k.startswith("farmem_export_stripe_groups_leased"):
        m[k] = int(float(v))
ahead = m.get("farmem_export_stripe_groups_leased_ahead_total", 0)
writers = m.get("farmem_export_stripe_groups_leased_by_writers_total", 0)
print(f"lease-ahead {mode:3}  iops {w['iops']:7.0f}  mean {w['clat_ns']['mean'] / 1e3:6.1f} us  "
      f"p99.9 {w['clat_ns']['percentile']['99.900000'] / 1e3:6.0f} us  "
      f"waits>20ms {len(waits)} (sum {sum(waits) / 1e6:5.0f} ms, first {waits[0] / 1e6 if waits else 0:4.0f} ms, "
      f"longest after it {after_first / 1e6:4.0f} ms)  groups ahead {ahead} by writers {writers}")
PY
  done
done
