#!/bin/bash
# Object far memory vs kernel paging on the same small-object key-value workload (issue 13, item
# 5; AIFM's comparison with Fastswap), in one qemu guest, on the same farmemd daemon:
#
#   far  kv_bench --backend far: far_hash_map, its objects swapped to farmemd by the far_ptr runtime
#   std  kv_bench --backend std: std::unordered_map, its pages swapped by the kernel to /dev/nbd0,
#        an NBD export of farmem-nbd (--backend farmem) whose pages live on the same farmemd
#
#   farb the far back-end with --batch BATCH: each batch's gets in one far_hash_map::get_many,
#        whose bucket misses are read together (overlapped), as a server with BATCH requests at
#        hand would; std cannot overlap its page faults, so it has no batched form
#   farbN the same with batches of N (e.g. farb32), so that two batch sizes pair in one guest
#
# Local memory (docs/benchmarks-farptr.md, "Object far memory vs kernel swap", says how it was
# sized): far gets local_budget = BUDGET, and with METADATA_IN_BUDGET=1 (the default) that budget
# counts the runtime's metadata (48 B per object, the span tables, the free-frame cache) as well
# as its frames (RuntimeOptions::budget_includes_metadata), so the far process holds about
# BUDGET + its fixed overhead; only far_hash_map's directory (8 B per bucket) is outside it.
# std runs in a cgroup with memory.max = BUDGET + its fixed overhead, measured first
# in this guest as the cgroup memory.peak of a tiny std run (--keys 1024, the same operations:
# what the cgroup is charged for the binary, the libraries' pages it faults in first, the key
# streams, the stack and the allocator, but no data; set STD_OVERHEAD to skip that). Each
# run's cgroup memory.peak is printed, far's too (its cgroup has no limit), and with "stdpeak" in
# ORDER std runs once more with memory.max = the largest memory.peak of the far runs before it
# (far or farb): the same total memory as far really used. /dev/nbd0 is the only swap.
#   deploy/vm/run --smp 1 --timeout 1800 -- bash bench/kv_swap_vs_farptr.sh build/bin
# (~10-15 minutes at the defaults under TCG on a loaded 2-core host.)
#
# Prints the configuration, each run's RESULT lines ("RESULT kv BACKEND DIST OPS SECONDS OPS/S"),
# the CPU each side used, and a table with far / std per distribution (the median of the runs of
# each back-end when ORDER repeats them).
# Environment (defaults, sized for TCG): KEYS (262144), VALUE_BYTES (64), OPS (20000), WARMUP_OPS
# (10000), PHASE_SECONDS (60: a phase stops there), UPDATE_PCT (5), DISTS (uniform,zipf), BUDGET (6M),
# STD_OVERHEAD (measured), SPAN (16384), RESILIENCE (none), ENCRYPT (1: both encrypt, as they do by
# default; 0: neither), TRANSPORT (tcp; verbs: the daemon on rxe0, both sides over verbs),
# METADATA_IN_BUDGET (1; 0: far's budget counts frames only), BATCH (16: ops per get_many in farb),
# ORDER ("far std stdpeak stdpeak std far": back-ends in run order, interleaved against host noise:
# far, farb, farbN, std, stdpeak), PROFILE (0; 1: perf record -a of the guest's one CPU during each run,
# then where its time went by process and library, and the top symbols: the perf sampling costs a
# few percent).
set -euo pipefail
say() { echo "[kv_swap] $*"; }
fail() {
  echo "[kv_swap] FAIL: $*"
  for f in "$work"/*.log; do [[ -s $f ]] && { echo "--- last lines of $f"; tail -n 15 "$f"; }; done
  exit 1
}
[[ ${FARMEM_VM:-} == 1 ]] || { echo "run me inside the guest: deploy/vm/run --smp 1 -- bash $0 <bin dir>" >&2; exit 2; }
bin=$(cd "${1:?usage: kv_swap_vs_farptr.sh <bin dir>}" && pwd)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=tests/vm/guest_daemons.sh
source "$here/../tests/vm/guest_daemons.sh"
keys=${KEYS:-262144}
value_bytes=${VALUE_BYTES:-64}
ops=${OPS:-20000}
warmup=${WARMUP_OPS:-10000}
phase_s=${PHASE_SECONDS:-60}
update_pct=${UPDATE_PCT:-5}
dists=${DISTS:-uniform,zipf}
budget=${BUDGET:-6M}
std_overhead=${STD_OVERHEAD:-}
span=${SPAN:-16384}
resilience=${RESILIENCE:-none}
encrypt=${ENCRYPT:-1}
transport=${TRANSPORT:-tcp}
metadata_in_budget=${METADATA_IN_BUDGET:-1}
batch=${BATCH:-16}
profile=${PROFILE:-0}
read -r -a order <<<"${ORDER:-far std stdpeak stdpeak std far}"
mib() { numfmt --from=iec "$1" | awk '{ printf "%d", $1 / 1048576 }'; }
enc_far=() enc_nbd=()
[[ $encrypt == 1 ]] || { enc_far=(--no-encrypt); enc_nbd=(--no-encrypt); }
common=(--value-bytes "$value_bytes" --ops "$ops" --warmup-ops "$warmup"
  --seconds "$phase_s" --update-pct "$update_pct" --dists "$dists")

work=/tmp/kv-swap
mkdir -p "$work"
pids=() nbd_pid="" swap_on=0
cleanup() {
  set +e
  ((swap_on)) && swapoff /dev/nbd0
  nbd-client -d /dev/nbd0 >/dev/null 2>&1
  [[ -n $nbd_pid ]] && kill "$nbd_pid" 2>/dev/null
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  return 0
}
trap cleanup EXIT
vmstat() { awk -v k="$1" '$1 == k { print $2 }' /proc/vmstat; }
cpu_s() { awk '{ printf "%.1f", ($14 + $15) / 100 }' "/proc/$1/stat" 2>/dev/null || echo 0; }
guest_cpu() { awk '/^cpu / { printf "%.1f %.1f %.1f %.1f", ($2 + $3) / 100, $4 / 100, $8 / 100, $5 / 100 }' /proc/stat; }

say "config: $keys keys, $value_bytes B values, $update_pct% updates, dists $dists, $warmup warm-up + $ops timed ops per dist (at most $phase_s s each)"
say "config: far local_budget $budget ($([[ $metadata_in_budget == 1 ]] && echo "metadata included" || echo "frames only")), $span B spans, farb $batch ops a get_many; std memory.max = $budget + its fixed overhead; resilience $resilience, transport $transport, encryption $([[ $encrypt == 1 ]] && echo on || echo off) (both)"
say "config: kernel $(uname -r), $(nproc) vCPU, vm.page-cluster $(cat /proc/sys/vm/page-cluster), swappiness $(cat /proc/sys/vm/swappiness), MemTotal $(awk '/MemTotal/ { print $2 / 1024 " MiB" }' /proc/meminfo)"

# ---- the daemon both use (loopback; --rdma on only for TRANSPORT=verbs) -----------------------------
rdma=off addr=127.0.0.1
if [[ $transport == verbs ]]; then rdma=on addr=${FARMEM_VM_ADDRS%% *}; fi
start_daemons "$work" "$addr" -- --capacity 640M --slab-size 2M --max-client-share 1 --rdma "$rdma" \
  --lease-ttl-ms 30000 --log-level warn
daemon=${pids[0]}
say "farmemd at $peer_list"

# ---- swap on farmem-nbd, on the same daemon (swap-safe mode, the default) ---------------------------
"$bin/farmem-nbd" --backend farmem --peers "$peer_list" --secret-file "$work/secret" \
  --resilience "$resilience" --transport "$transport" --size 384M --unix "$work/nbd.sock" \
  --max-connections 2 --failure-timeout-ms 5000 "${enc_nbd[@]}" 2>"$work/nbd.log" &
nbd_pid=$!
for _ in $(seq 600); do [[ -S $work/nbd.sock ]] && break; kill -0 "$nbd_pid" || break; sleep 0.05; done
[[ -S $work/nbd.sock ]] || fail "farmem-nbd did not start"
timeout 60 nbd-client -unix "$work/nbd.sock" /dev/nbd0 -b 4096 -swap -N "" >/dev/null || fail "nbd-client"
mkswap /dev/nbd0 >/dev/null || fail "mkswap"
swapon /dev/nbd0 || fail "swapon"
swap_on=1
[[ $(awk 'NR > 1' /proc/swaps | wc -l) == 1 ]] || fail "/dev/nbd0 is not the only swap: $(cat /proc/swaps)"
say "swap on /dev/nbd0 (farmem-nbd --resilience $resilience --transport $transport)"

# in_cgroup CG CMD...: runs CMD as the only process of cgroup CG.
in_cgroup() { bash -c 'echo $$ >"$1/cgroup.procs" && shift && exec "$@"' _ "$@"; }

# ---- std's fixed overhead: a tiny run's memory.peak ------------------------------------------------
if [[ -z $std_overhead ]]; then
  cg=/sys/fs/cgroup/kv_calibrate
  mkdir "$cg"
  in_cgroup "$cg" "$bin/kv_bench" --keys 1024 "${common[@]}" --backend std >"$work/calibrate.log" 2>&1 ||
    fail "the calibration run failed: $(tail -n 3 "$work/calibrate.log")"
  std_overhead="$(( ($(cat "$cg/memory.peak") + 1048575) / 1048576 ))M"
  rmdir "$cg"
fi
limit="$(( $(mib "$budget") + $(mib "$std_overhead") ))M"
say "std's fixed overhead (memory.peak of a --keys 1024 run, rounded up): $std_overhead; std memory.max $limit"
# The same for far, which also brings the pages of the code and libraries only it uses (the
# runtime, OpenSSL) into the page cache: a cgroup is charged for the file pages it faults in
# first, so without this the first far run's memory.peak would carry them and stdpeak get more.
cg=/sys/fs/cgroup/kv_calibrate_far
mkdir "$cg"
in_cgroup "$cg" "$bin/kv_bench" --keys 1024 "${common[@]}" --backend far --peers "$peer_list" \
  --secret-file "$work/secret" --budget "$budget" --span "$span" --resilience "$resilience" \
  "${enc_far[@]}" >"$work/calibrate-far.log" 2>&1 ||
  fail "the far calibration run failed: $(tail -n 3 "$work/calibrate-far.log")"
say "far's fixed overhead (memory.peak of a --keys 1024 run, all local): $(( ($(cat "$cg/memory.peak") + 1048575) / 1048576 )) MiB"
rmdir "$cg"

# ---- the runs -------------------------------------------------------------------------------------
results=$work/results
: >"$results"
run=0
for backend in "${order[@]}"; do
  run=$((run + 1))
  cg=/sys/fs/cgroup/kv_$run
  mkdir "$cg"
  case $backend in
    far | farb | farb[1-9]*) echo max >"$cg/memory.max" ;;
    std) echo "$limit" >"$cg/memory.max" ;;
    stdpeak)
      [[ -n ${far_peak:-} ]] || fail "stdpeak needs a far run before it"
      echo "$far_peak" >"$cg/memory.max"
      say "run $run: std with memory.max = far's memory.peak, $((far_peak / 1048576)) MiB"
      ;;
    *) fail "ORDER: far, farb, farbN, std or stdpeak, not $backend" ;;
  esac
  args=(--keys "$keys" "${common[@]}")
  if [[ $backend == far* ]]; then
    args+=(--backend far --peers "$peer_list" --secret-file "$work/secret" --budget "$budget"
      --span "$span" --resilience "$resilience" "${enc_far[@]}")
    [[ $metadata_in_budget == 1 ]] || args+=(--no-metadata-in-budget)
    [[ $backend == farb ]] && args+=(--batch "$batch")
    [[ $backend == farb[1-9]* ]] && args+=(--batch "${backend#farb}")
  else
    args+=(--backend std)
  fi
  name=$backend
  [[ $backend == stdpeak ]] && name=std-at-far-peak
  [[ $backend == farb ]] && name=far-batched
  [[ $backend == farb[1-9]* ]] && name=far-batched-${backend#farb}
  out0=$(vmstat pswpout) in0=$(vmstat pswpin)
  n0=$(cpu_s "$nbd_pid") d0=$(cpu_s "$daemon") g0=$(guest_cpu) t0=$(date +%s.%N)
  say "run $run: $backend: kv_bench ${args[*]}"
  rc=0 perf_pid=""
  if [[ $profile == 1 ]]; then
    perf record -a -e cpu-clock -F 499 -q -o "$work/perf$run.data" 2>"$work/perf$run.log" &
    perf_pid=$!
  fi
  in_cgroup "$cg" "$bin/kv_bench" "${args[@]}" >"$work/run$run.log" 2>&1 || rc=$?
  if [[ -n $perf_pid ]]; then
    kill -INT "$perf_pid" 2>/dev/null || true
    wait "$perf_pid" || true
    say "run $run: $backend: where the guest CPU went (perf, cpu-clock, whole run incl. the load)"
    perf report -i "$work/perf$run.data" --stdio -q --sort comm,dso --percent-limit 1.5 2>/dev/null | sed 's/^/  /'
    perf report -i "$work/perf$run.data" --stdio -q --sort comm,sym --percent-limit 0.8 2>/dev/null | head -40 | sed 's/^/  /'
  fi
  cat "$work/run$run.log"
  grep MISMATCH "$work/run$run.log" && fail "run $run ($backend) read a wrong value"
  ((rc == 0)) || fail "run $run ($backend) exited with $rc (137: the cgroup's OOM killer); memory.events: $(tr '\n' ' ' <"$cg/memory.events")"
  grep '^RESULT' "$work/run$run.log" | sed "s/^RESULT kv [a-z]* /RESULT kv $name /" >>"$results"
  if [[ $backend == far* ]]; then
    peak=$(cat "$cg/memory.peak")
    (( peak > ${far_peak:-0} )) && far_peak=$peak
    say "run $run: far's memory beyond its budget: $(( peak / 1048576 - $(mib "$budget") )) MiB (memory.peak - local_budget)"
  fi
  read -r gu gs gsi gi <<<"$(guest_cpu)"
  read -r gu0 gs0 gsi0 gi0 <<<"$g0"
  say "run $run: $backend: $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.0f", b - a }') s wall;" \
    "pswpout +$(( $(vmstat pswpout) - out0 )), pswpin +$(( $(vmstat pswpin) - in0 )) pages;" \
    "cgroup memory.peak $(( $(cat "$cg/memory.peak" 2>/dev/null || echo 0) / 1048576 )) MiB;" \
    "kv_bench CPU $(awk '/^user_usec/ { u = $2 } /^system_usec/ { s = $2 } END { printf "%.1f s user, %.1f s system", u / 1e6, s / 1e6 }' "$cg/cpu.stat");" \
    "farmem-nbd $(awk -v a="$n0" -v b="$(cpu_s "$nbd_pid")" 'BEGIN { printf "%.1f", b - a }') s, farmemd $(awk -v a="$d0" -v b="$(cpu_s "$daemon")" 'BEGIN { printf "%.1f", b - a }') s;" \
    "guest: $(awk -v a="$gu0" -v b="$gu" 'BEGIN { printf "%.1f", b - a }') s user, $(awk -v a="$gs0" -v b="$gs" 'BEGIN { printf "%.1f", b - a }') s system, $(awk -v a="$gsi0" -v b="$gsi" 'BEGIN { printf "%.1f", b - a }') s softirq, $(awk -v a="$gi0" -v b="$gi" 'BEGIN { printf "%.1f", b - a }') s idle"
  rmdir "$cg"
done
if grep -E "LOST|unrecoverable|\[error\]" "$work/nbd.log"; then fail "farmem-nbd reported errors"; fi

# ---- the table ------------------------------------------------------------------------------------
python3 - "$results" <<'EOF'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    w = line.split()  # RESULT kv BACKEND DIST OPS SECONDS OPS/S
    runs.setdefault((w[2], w[3]), []).append(float(w[6]))
med = lambda v: statistics.median(v) if v else 0
cell = lambda v: " / ".join(f"{x:.0f}" for x in v) or "-"
ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"
print("| distribution | far_hash_map ops/s | batched (get_many) ops/s "
      "| std::unordered_map + swap on farmem-nbd ops/s | far / std | batched / std "
      "| std at far's memory.peak ops/s | far / that | batched / that |")
print("|---|---|---|---|---|---|---|---|---|")
for dist in dict.fromkeys(d for _, d in runs):
    f, fb, s, p = (runs.get((b, dist), []) for b in ("far", "far-batched", "std", "std-at-far-peak"))
    print(f"| {dist} | {cell(f)} | {cell(fb)} | {cell(s)} | {ratio(med(f), med(s))} "
          f"| {ratio(med(fb), med(s))} | {cell(p)} | {ratio(med(f), med(p))} | {ratio(med(fb), med(p))} |")
    print(f"RATIO {dist} far/std {ratio(med(f), med(s))} batched/std {ratio(med(fb), med(s))} "
          f"far/std-at-far-peak {ratio(med(f), med(p))} batched/std-at-far-peak {ratio(med(fb), med(p))}")
    for name in sorted(b for b, d in runs if d == dist and b.startswith("far-batched-")):
        v = runs[(name, dist)]
        print(f"RATIO {dist} {name} {cell(v)} ops/s: /std {ratio(med(v), med(s))} "
              f"/std-at-far-peak {ratio(med(v), med(p))}")
EOF
say "done"
