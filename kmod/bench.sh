#!/bin/bash
# farmem.ko against the other ways to the same remote memory, in one guest run (issue 15,
# docs/benchmarks.md "Reference"): 4 KiB random reads and writes at depth 1 and 32 (fio, libaio,
# O_DIRECT) on
#   kmod    /dev/farmem0: farmem.ko, RDMA READ/WRITE from the block layer (farmemctl kmod attach)
#   nbd     /dev/nbd0 on farmem-nbd --transport verbs (the userspace paging client, same daemon)
#   nbdtcp  /dev/nbd0 on farmem-nbd --transport tcp (the same, over the daemon's TCP listener)
#   nbdkit  /dev/nbd0 on nbdkit memory (no far memory at all: the NBD path alone)
# and perftest's ib_read_lat / ib_write_lat (4 KiB) on the same rxe0, the floor.
#   deploy/vm/run --smp 1 -- bash kmod/bench.sh <bin dir> <farmem.ko> [<swap_workload>]
# One farmemd with --rdma on at 10.0.2.15 (rxe0). Prints one RESULT line per figure and a table.
# With a third argument, the swap_workload program (tests/vm), each device also serves as swap for
# a patterned, verified working set of SWAP_MIB (32) MiB under a memory.max of SWAP_LIMIT (8M) (two passes,
# rewriting), and the workload's runtime is printed per device ("RESULT swap NAME SECONDS").
# Environment: RUNTIME (fio seconds per job, 5), SIZE (device size, 64M), SWAP_MIB, SWAP_LIMIT,
# LAT_ITERS (ib_read_lat/ib_write_lat iterations, 1000: ~0.1 s; as many as fio's RUNTIME takes
# at depth 1, e.g. 25000 for 3 s, make the means comparable: both then sit through the same
# share of the host's preemptions of the guest), KMOD_ONLY=1 (farmem0 and perftest only).
# Latencies in the table are fio's total latency (lat: from before io_submit to the completion),
# the one comparable with ib_read_lat's (from ibv_post_send); RESULT lines carry clat too.
set -euo pipefail
[[ ${FARMEM_VM:-} == 1 ]] || { echo "run me inside the guest: deploy/vm/run -- bash $0 ..." >&2; exit 2; }
bin=${1:?usage: bench.sh <bin dir> <farmem.ko>}
ko=${2:?farmem.ko path}
workload=${3:-}
swap_mib=${SWAP_MIB:-32}
swap_limit=${SWAP_LIMIT:-8M}
runtime=${RUNTIME:-5}
size=${SIZE:-64M}
addr=10.0.2.15
work=/tmp/kmod-bench
mkdir -p "$work"
say() { echo "[kmod_bench] $*"; }
pids=()
cleanup() {
  set +e
  nbd-client -d /dev/nbd0 >/dev/null 2>&1
  [[ -e /sys/kernel/farmem/status ]] && "$bin/farmemctl" kmod detach >/dev/null 2>&1
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
}
trap cleanup EXIT
results=$work/results
: >"$results"

# fio_one NAME DEVICE RW DEPTH: one 4 KiB job; RESULT line "NAME rw qd iops mean_us p50_us p99_us
# lat_mean_us lat_p50_us lat_p99_us": completion latency (clat: from io_submit's return) and total
# latency (lat: from before io_submit; clat leaves out the ~70-80 µs io_submit takes in the
# guest, and all of a request that ends inside io_submit).
fio_one() {
  local name=$1 dev=$2 rw=$3 qd=$4
  fio --name=b --filename="$dev" --rw=$rw --bs=4k --iodepth=$qd --ioengine=libaio --direct=1 \
    --size="$size" --time_based --runtime="$runtime" --ramp_time=1 --randrepeat=0 \
    --lat_percentiles=1 --output-format=json >"$work/fio.json" || { say "fio $name $rw qd$qd failed"; exit 1; }
  python3 - "$name" "$rw" "$qd" "$work/fio.json" >>"$results" <<'EOF'
import json, sys
name, rw, qd, path = sys.argv[1:]
j = json.load(open(path))["jobs"][0]["read" if rw == "randread" else "write"]
c, t = j["clat_ns"], j["lat_ns"]
p, q = c.get("percentile", {}), t.get("percentile", {})
print(f"RESULT {name} {rw} {qd} {j['iops']:.0f} {c['mean'] / 1000:.1f} "
      f"{p.get('50.000000', 0) / 1000:.1f} {p.get('99.000000', 0) / 1000:.1f} "
      f"{t['mean'] / 1000:.1f} {q.get('50.000000', 0) / 1000:.1f} {q.get('99.000000', 0) / 1000:.1f}")
EOF
  tail -n 1 "$results"
}

# fio_all NAME DEVICE: the four 4 KiB jobs.
fio_all() {
  local rw qd
  for rw in randread randwrite; do
    for qd in 1 32; do fio_one "$1" "$2" $rw $qd; done
  done
}

# swap_time NAME DEVICE: with a swap_workload, DEVICE as the only swap of a cgroup limited to 8M
# running it; "RESULT swap NAME SECONDS" (fails the bench if the workload reads a wrong page).
swap_time() {
  local name=$1 dev=$2 cg=/sys/fs/cgroup/kmod_bench t0 rc=0
  [[ -n $workload ]] || return 0
  mkswap "$dev" >/dev/null
  swapon "$dev"
  mkdir -p "$cg"
  echo "$swap_limit" >"$cg/memory.max"
  t0=$(date +%s%N)
  bash -c 'echo $$ >"$1/cgroup.procs" && shift && exec "$@"' _ "$cg" "$workload" -m "$swap_mib" \
    -p 2 -r >"$work/swap-$name.log" 2>&1 || rc=$?
  echo "RESULT swap $name $((($(date +%s%N) - t0) / 1000000))e-3" >>"$results"
  swapoff "$dev"
  if grep -q MISMATCH "$work/swap-$name.log"; then
    say "swap_workload on $name read a page it did not write:"
    tail -n 20 "$work/swap-$name.log"
    exit 1
  fi
  if ((rc != 0)); then  # e.g. 137: the cgroup's OOM killer, when reclaim outran the device
    sed -i '$d' "$results"
    echo "RESULT swap $name failed-$rc" >>"$results"
    say "swap_workload on $name exited with $rc (137: killed, the cgroup ran out of memory):"
    tail -n 5 "$work/swap-$name.log"
  fi
  tail -n 1 "$results"
}

# ---- the daemon ------------------------------------------------------------------------------------
head -c 32 /dev/urandom | base64 >"$work/secret"
chmod 600 "$work/secret"
"$bin/farmemd" --listen "$addr:0" --port-file "$work/port" --capacity 256M --slab-size 2M \
  --max-client-share 1 --rdma on --secret-file "$work/secret" --log-level warn 2>"$work/farmemd.log" &
pids+=($!)
for _ in $(seq 400); do [[ -s $work/port ]] && break; sleep 0.05; done
peer="$addr:$(cat "$work/port")"

# ---- kmod ------------------------------------------------------------------------------------------
insmod "$ko"
"$bin/farmemctl" kmod attach --peers "$peer" --secret-file "$work/secret" --size "$size" \
  >"$work/attach.log" 2>&1 &
attach=$!
for _ in $(seq 600); do [[ -b /dev/farmem0 ]] && break; sleep 0.05; done
[[ -b /dev/farmem0 ]] || { say "no /dev/farmem0"; cat "$work/attach.log"; exit 1; }
dd if=/dev/urandom of=/dev/farmem0 bs=1M oflag=direct status=none 2>/dev/null || true
fio_all kmod /dev/farmem0
swap_time kmod /dev/farmem0
say "kmod done; detaching"
timeout 60 "$bin/farmemctl" kmod detach || say "detach failed or hung"
say "detached; waiting for the keeper"
wait "$attach" || say "the keeper exited with $?"
rmmod farmem || say "rmmod failed"
say "perftest: starting"

# ---- perftest on the same rxe0 ---------------------------------------------------------------------
perftest() {  # TOOL: "RESULT TOOL t_typical t_avg p99"
  local tool=$1 out="" iters=${LAT_ITERS:-1000}
  "$tool" -d rxe0 -x 1 -F -s 4096 -n "$iters" >"$work/server.log" 2>&1 &
  local server=$!
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    sleep 0.5
    if out=$("$tool" -d rxe0 -x 1 -F -s 4096 -n "$iters" "$addr" 2>&1); then break; fi
    out=""
  done
  wait "$server" || true
  awk -v t="$tool" '$1 == 4096 { printf "RESULT %s %s %s %s\n", t, $5, $6, $8; exit }' <<<"$out" >>"$results"
  tail -n 1 "$results"
}
perftest ib_read_lat
perftest ib_write_lat

if [[ ${KMOD_ONLY:-0} != 1 ]]; then
# ---- nbdkit memory ---------------------------------------------------------------------------------
say "nbdkit memory: starting"
# As a swap device is served (tests/vm/nbd_swap_smoke.sh): the server locked in memory (--swap),
# nbd-client -swap (the socket may allocate from the reserves while the kernel reclaims).
nbdkit -U "$work/nbdkit.sock" -P "$work/nbdkit.pid" --swap memory "$size"
for _ in $(seq 400); do [[ -S $work/nbdkit.sock ]] && break; sleep 0.05; done
nbd-client -unix "$work/nbdkit.sock" /dev/nbd0 -b 4096 -swap -N "" >/dev/null
dd if=/dev/urandom of=/dev/nbd0 bs=1M oflag=direct status=none 2>/dev/null || true
fio_all nbdkit /dev/nbd0
swap_time nbdkit /dev/nbd0
nbd-client -d /dev/nbd0 >/dev/null
kill "$(cat "$work/nbdkit.pid")"

# ---- farmem-nbd over verbs, then over tcp --------------------------------------------------------
# The userspace paging client on the same daemon: --resilience none (one daemon; the default,
# ec:4+2, needs six). Each is skipped, with its log, when it exits or does not listen in 60 s.
farmem_nbd() {  # NAME TRANSPORT
  local name=$1 transport=$2 nbd
  rm -f "$work/nbd.sock"
  "$bin/farmem-nbd" --backend farmem --peers "$peer" --secret-file "$work/secret" \
    --transport "$transport" --resilience none --size "$size" --unix "$work/nbd.sock" \
    --max-connections 1 --log-level info 2>"$work/$name.log" &  # swap-safe, the default
  nbd=$!
  pids+=("$nbd")
  for _ in $(seq 600); do
    [[ -S $work/nbd.sock ]] && break
    kill -0 "$nbd" 2>/dev/null || break
    sleep 0.1
  done
  if [[ -S $work/nbd.sock ]] && timeout 60 nbd-client -unix "$work/nbd.sock" /dev/nbd0 -b 4096 -swap -N "" >/dev/null; then
    grep -i -m 2 "uses $transport" "$work/$name.log" || true
    dd if=/dev/urandom of=/dev/nbd0 bs=1M oflag=direct status=none 2>/dev/null || true
    fio_all "$name" /dev/nbd0
    swap_time "$name" /dev/nbd0
    nbd-client -d /dev/nbd0 >/dev/null
  else
    say "farmem-nbd ($transport) did not serve: skipped; its log:"
    tail -n 30 "$work/$name.log"
  fi
  kill "$nbd" 2>/dev/null || true
  wait "$nbd" 2>/dev/null || true
}
say "farmem-nbd over verbs: starting"
farmem_nbd nbd verbs
say "farmem-nbd over tcp: starting"
farmem_nbd nbdtcp tcp
fi

# ---- the table -------------------------------------------------------------------------------------
python3 - "$results" <<'EOF'
import sys
fio, pt, swap = {}, {}, {}
for line in open(sys.argv[1]):
    w = line.split()
    if len(w) == 11:
        fio[(w[1], w[2], w[3])] = tuple(float(x) for x in w[4:11])
    elif len(w) == 4 and w[1] == "swap":
        swap[w[2]] = w[3]
    elif len(w) == 5:
        pt[w[1]] = (float(w[2]), float(w[3]), float(w[4]))
print("| job | kmod IOPS / mean µs / p50 µs (total latency) | farmem-nbd verbs | farmem-nbd tcp | nbdkit memory | kmod vs nbd (mean lat) |")
print("|---|---|---|---|---|---|")
for rw in ("randread", "randwrite"):
    for qd in ("1", "32"):
        cells = []
        for n in ("kmod", "nbd", "nbdtcp", "nbdkit"):
            v = fio.get((n, rw, qd))
            cells.append(f"{v[0]:.0f} / {v[4]:.0f} / {v[5]:.0f}" if v else "-")
        k, b = fio.get(("kmod", rw, qd)), fio.get(("nbd", rw, qd))
        ratio = f"{b[4] / k[4]:.2f}x lower" if k and b and k[4] else "-"
        print(f"| 4 KiB {rw} depth {qd} | " + " | ".join(cells) + f" | {ratio} |")
for t, (typ, avg, p99) in pt.items():
    print(f"{t} 4 KiB: t_typical {typ} us, t_avg {avg} us, p99 {p99} us")
if swap:
    print("swap workload runtime, s: " + ", ".join(
        f"{n} {float(t):.1f}" if t[0].isdigit() else f"{n} {t}" for n, t in swap.items()))
k = fio.get(("kmod", "randread", "1"))
if k and "ib_read_lat" in pt:
    print(f"kmod depth-1 read mean / ib_read_lat t_avg: {k[4] / pt['ib_read_lat'][1]:.2f}x "
          f"(p50 / t_typical: {k[5] / pt['ib_read_lat'][0]:.2f}x, "
          f"p99 / p99: {k[6] / pt['ib_read_lat'][2]:.2f}x; total latency, fio's lat; "
          f"clat p50 / t_typical: {k[2] / pt['ib_read_lat'][0]:.2f}x)")
EOF
