#!/usr/bin/env bash
# farmem's one-sided 4 KiB reads/writes against perftest on the same soft-RoCE device, in one run.
# Runs inside the qemu test guest:
#
#   deploy/vm/run -- bench/verbs_bench.sh [BIN_DIR]        (BIN_DIR: default $FARMEM_BIN_DIR)
#
# Each round runs perftest's ib_read_lat, ib_write_lat, ib_read_bw -t 16 on rxe0, each followed at
# once by bin/verbs_bench's matching measurement against a farmemd on the same address (verbs
# transport); then ib_read_bw with its defaults, and verbs_bench over the tcp transport (as is,
# and with client and daemon pinned to one vCPU). The table shows medians over rounds and the
# median of the per-round ratios.
# ROUNDS (default 3), SIZE (default 4096), DEPTH (default 16) tune it.
set -euo pipefail

bin=${1:-${FARMEM_BIN_DIR:-}}
[[ -x $bin/verbs_bench && -x $bin/farmemd ]] || {
  echo "verbs_bench.sh: give the build's bin directory (verbs_bench, farmemd)" >&2
  exit 2
}
rounds=${ROUNDS:-3}
size=${SIZE:-4096}
depth=${DEPTH:-16}
addr=${FARMEM_VM_ADDRS:-10.0.2.15}
addr=${addr%% *}
dev=${FARMEM_VM_RXE:-rxe0}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT

# perftest TOOL ARGS...: server and client on $dev; prints the client's result line.
perftest() {
  local tool=$1
  shift
  "$tool" -d "$dev" -x 1 -F "$@" >"$work/server.log" 2>&1 &
  local server=$! out=""
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    sleep 0.5
    if out=$("$tool" -d "$dev" -x 1 -F "$@" "$addr" 2>&1); then break; fi
    out=""
  done
  wait "$server" || true
  [[ -n $out ]] || { echo "verbs_bench.sh: $tool did not run" >&2; cat "$work/server.log" >&2; exit 1; }
  awk -v s="$size" '$1 == s { print; exit }' <<<"$out"
}

# Two daemons: one as it would run, one pinned to vCPU 0 for the pinned TCP run ("tcp0": client
# and daemon on one vCPU, no cross-CPU wake-up per request; see docs/architecture.md).
"$bin/farmemd" --listen "$addr:7411" --rdma on --capacity 256M --slab-size 64M --log-level warn \
  --port-file "$work/port" &
taskset -c 0 "$bin/farmemd" --listen "$addr:7421" --rdma off --capacity 128M --slab-size 64M \
  --log-level warn --port-file "$work/port0" &
for _ in $(seq 300); do [[ -s $work/port && -s $work/port0 ]] && break; sleep 0.1; done
[[ -s $work/port && -s $work/port0 ]] || { echo "verbs_bench.sh: farmemd did not start" >&2; exit 1; }

results=$work/results
: >"$results"
note() { echo "$1 $2" >>"$results"; }  # key value
# ours TAG ARGS...: one verbs_bench run; notes TAG_<op>_lat / TAG_<op>_ops from its RESULT lines.
ours() {
  local tag=$1
  shift
  "$@" --size "$size" --depth "$depth" --iters 1000 --seconds 3 >"$work/ours.log"
  grep -v '^RESULT' "$work/ours.log" >&2
  awk -v t="$tag" '/^RESULT/ {
      for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
      if (f["depth"] == 1) print t "_" f["op"] "_lat", f["typical_us"]
      else print t "_" f["op"] "_ops", f["ops_per_s"]
    }' "$work/ours.log" >>"$results"
}
verbs=("$bin/verbs_bench" --daemon "$addr:7411" --transport verbs)
# Each baseline is followed at once by the farmem measurement it is compared with, so that the
# drift of a shared, emulated machine hits both; ratios are taken per round, then the median.
for r in $(seq "$rounds"); do
  echo "--- round $r of $rounds" >&2
  line=$(perftest ib_read_lat -s "$size" -n 1000)
  note perftest_read_lat "$(awk '{ print $5 }' <<<"$line")"
  ours verbs "${verbs[@]}" --ops read --modes lat
  line=$(perftest ib_write_lat -s "$size" -n 1000)
  note perftest_write_lat "$(awk '{ print $5 }' <<<"$line")"
  ours verbs "${verbs[@]}" --ops write --modes lat
  line=$(perftest ib_read_bw -s "$size" -n 5000 -t "$depth")
  note perftest_read_bw_depth "$(awk '{ printf "%.0f", $5 * 1e6 }' <<<"$line")"
  ours verbs "${verbs[@]}" --ops read,write --modes bw
  line=$(perftest ib_read_bw -s "$size" -n 5000)
  note perftest_read_bw_default "$(awk '{ printf "%.0f", $5 * 1e6 }' <<<"$line")"
  ours tcp "$bin/verbs_bench" --daemon "$addr:7411" --transport tcp
  ours tcp0 taskset -c 0 "$bin/verbs_bench" --daemon "$addr:7421" --transport tcp
done
# Per-round ratios of farmem to its baseline.
for pair in "verbs_read_lat perftest_read_lat read_lat_ratio" \
            "verbs_write_lat perftest_write_lat write_lat_ratio" \
            "verbs_read_ops perftest_read_bw_depth read_bw_ratio" \
            "verbs_read_ops perftest_read_bw_default read_bw_default_ratio"; do
  set -- $pair
  awk -v k="$1" '$1 == k { print $2 }' "$results" >"$work/a"
  awk -v k="$2" '$1 == k { print $2 }' "$results" >"$work/b"
  paste "$work/a" "$work/b" | awk -v k="$3" '$2 > 0 { printf "%s %.3f\n", k, $1 / $2 }' >>"$results"
done
echo "raw results (one line per measurement and round):" >&2
sort "$results" >&2

median() { awk -v k="$1" '$1 == k { print $2 }' "$results" | sort -g | awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)]; else print "nan" }'; }

pr=$(median perftest_read_lat) pw=$(median perftest_write_lat)
pbd=$(median perftest_read_bw_depth) pbx=$(median perftest_read_bw_default)
vr=$(median verbs_read_lat) vw=$(median verbs_write_lat)
vrt=$(median verbs_read_ops) vwt=$(median verbs_write_ops)
tr=$(median tcp_read_lat) tw=$(median tcp_write_lat)
trt=$(median tcp_read_ops) twt=$(median tcp_write_ops)
t0r=$(median tcp0_read_lat) t0w=$(median tcp0_write_lat)
t0rt=$(median tcp0_read_ops) t0wt=$(median tcp0_write_ops)

echo
echo "farmem vs perftest on $dev, $size B, median of $rounds rounds (kernel $(uname -r));"
echo "ratio = median over rounds of farmem / the perftest run just before it"
f='%-42s %10s %13s %7s %11s %12s\n'
printf "$f" "measurement" "perftest" "farmem verbs" "ratio" "farmem tcp" "tcp, 1 vCPU"
printf "$f" "read latency, depth 1 (us, typical)" "$pr" "$vr" "$(median read_lat_ratio)" "$tr" "$t0r"
printf "$f" "write latency, depth 1 (us, typical) [1]" "$pw" "$vw" "$(median write_lat_ratio)" "$tw" "$t0w"
printf "$f" "read throughput, depth $depth (ops/s) [2]" "$pbd" "$vrt" "$(median read_bw_ratio)" "$trt" "$t0rt"
printf "$f" "read throughput vs ib_read_bw defaults [3]" "$pbx" "$vrt" "$(median read_bw_default_ratio)" "" ""
printf "$f" "write throughput, depth $depth (ops/s)" "" "$vwt" "" "$twt" "$t0wt"
echo "[1] ib_write_lat: half of a write ping-pong in which both ends busy-poll; farmem's figure is a"
echo "    full RDMA WRITE + ACK round trip with a passive daemon. Not the same measurement."
echo "[2] perftest: ib_read_bw -t $depth (at most $depth reads in flight, like farmem's depth)."
echo "[3] ib_read_bw's defaults: tx depth 128, reads in flight up to the device's limit."
