#!/bin/bash
# Guest side of the nbd_farmem_swap_* vm tests: kernel swap on farmem-nbd with its remote page
# store on real farmemd daemons (loopback, tcp transport), all inside the guest.
#
#   deploy/vm/run --smp 1 -- bash tests/vm/nbd_farmem_swap.sh <bin dir> <none|ec|ec-split|drain> <swap_workload>
#
#   none  3 daemons, --resilience none; 128 MiB working set under memory.max 32M
#   ec    7 daemons (6 for ec:4+2 plus a spare to rebuild on), --resilience ec:4+2 (its default
#         layout, stripe), 96 MiB under 24M, and one daemon SIGKILLed once the workload is reading
#         its pages back: the rest of the run is served degraded (pages on the lost member
#         decoded from the others) while the lost members are re-protected on the spare
#   ec-split  the same in the split layout (--resilience ec-split:4+2): degraded reads by late
#         binding / decode while the lost fragments are rebuilt on the spare
#   drain 4 daemons started with --drain-timeout, --resilience none, 128 MiB under 32M, and one
#         daemon gets SIGTERM once the workload is reading its pages back (issue 12): farmem-nbd
#         must move every member off it before the deadline (no redundancy: nothing to rebuild
#         from), the daemon must exit cleanly within its grace period with every lease freed, and
#         the workload must still read back every byte
#
# The kernel's NBD client attaches the export (nbd-client -swap), mkswap, swapon, and swap_workload
# runs in a cgroup whose memory.max is a quarter of its working set, writing, then re-reading
# (and rewriting, -r) a patterned working set (tests/vm/nbd_swap_smoke.sh does that part and
# checks /proc/vmstat pswpout/pswpin). Fails if any byte is wrong, if too little was swapped, if
# the kill did not happen while the workload still had pages to read back, if farmem-nbd died or
# logged lost data.
#
# Short and long form: CI swaps half as much (the working set over memory.max halved: none and
# drain 80 MiB under 32M, ec and ec-split 60 MiB under 24M), with the same two verify passes and
# the same kill or drain a quarter of the working set into the first (docs/testing.md);
# FARMEM_LONG_TESTS=1 runs the sizes above (by hand). Both passes stay: the second reads back the
# pages the first rewrote while a member was lost, being rebuilt or being moved, and the swap
# slots the kernel overwrote. memory.max stays: at half of it (12M) the cgroup's OOM killer took
# swap_workload in its write phase (reclaim waiting on writeback to the export, host load 11).
#
# Environment (optional): FARMEM_NBD_SWAP_MIB (working set), FARMEM_NBD_SWAP_LIMIT (memory.max),
# FARMEM_NBD_SWAP_PASSES (2), FARMEM_NBD_SWAP_KEEP_LOGS (a directory to copy the logs to),
# FARMEM_NBD_SWAP_KILL=0 (ec without killing a daemon: for timing comparisons only),
# FARMEM_LONG_TESTS=1 (the long form).
set -euo pipefail
say() { echo "[nbd_farmem_swap] $*"; }
fail() {
  echo "[nbd_farmem_swap] FAIL: $*"
  for f in /tmp/farmem-swap/nbd.log /tmp/farmem-swap/farmemd*.log; do
    [[ -s $f ]] && { echo "--- last lines of $f"; tail -n 25 "$f"; }
  done
  exit 1
}
[[ ${FARMEM_VM:-} == 1 ]] || fail "run me inside the guest: deploy/vm/run --smp 1 -- bash $0 ..."
bin=${1:?usage: nbd_farmem_swap.sh <bin dir> <none|ec|ec-split|drain> <swap_workload>}
mode=${2:?mode: none, ec, ec-split or drain}
workload=${3:?swap_workload path}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/guest_daemons.sh"
case $mode in
  none) daemons=3 resilience=none victim="" capacity=96M mib=128 limit=32M ;;
  ec) daemons=7 resilience=ec:4+2 victim=2 capacity=64M mib=96 limit=24M ;;
  ec-split) daemons=7 resilience=ec-split:4+2 victim=2 capacity=64M mib=96 limit=24M ;;
  drain) daemons=4 resilience=none victim=1 capacity=96M mib=128 limit=32M ;;
  *) fail "mode must be none, ec, ec-split or drain, not $mode" ;;
esac
drain_ms=20000  # drain: farmemd --drain-timeout
daemon_args=(--log-level warn)
# Failure detection by timeout need not be fast here: the SIGKILLed daemon's sockets close, which
# farmem-nbd notices at once, and drain/none kill nothing. With 600 ms, a guest starved by a busy
# host (its clock runs on while its vCPU waits for a host core) took live daemons for dead: once in
# 4 drain runs (a second guest on the loaded host), and at host load ~17 both `none` (20 extents,
# their only copy, "LOST": swap_workload SIGBUS) and `ec` (members of one extent on 3 "failed"
# daemons: beyond ec:4+2). That is not what this test is about.
failure_ms=2000
[[ $mode == drain ]] && daemon_args=(--log-level info --drain-timeout "$drain_ms")
form=long
if [[ ${FARMEM_LONG_TESTS:-0} == 0 ]]; then  # unset, empty or 0: the short form (CI)
  form=short mib=$(( ${limit%M} + (mib - ${limit%M}) / 2 ))
fi
mib=${FARMEM_NBD_SWAP_MIB:-$mib}
limit=${FARMEM_NBD_SWAP_LIMIT:-$limit}
passes=${FARMEM_NBD_SWAP_PASSES:-2}
[[ ${FARMEM_NBD_SWAP_KILL:-1} == 0 ]] && victim=""  # (benchmarks: the same run without the kill)
start=$(date +%s.%N)
elapsed() { awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
# (bash builtins only: the killer below calls it in a loop, and every fork costs under emulation)
vmstat_get() {  # VAR KEY: VAR=the value of KEY in /proc/vmstat
  local _key _val
  while read -r _key _val; do
    [[ $_key == "$2" ]] && { printf -v "$1" %s "$_val"; return; }
  done </proc/vmstat
}
vmstat() { local value=0; vmstat_get value "$1"; echo "$value"; }

work=/tmp/farmem-swap
mkdir -p "$work"
pids=() nbd_pid="" killer=""
cleanup() {
  set +e
  [[ -n $killer ]] && kill "$killer" 2>/dev/null
  [[ -n $nbd_pid ]] && kill "$nbd_pid" 2>/dev/null
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  [[ -n ${FARMEM_NBD_SWAP_KEEP_LOGS:-} ]] && cp "$work"/*.log "$FARMEM_NBD_SWAP_KEEP_LOGS/" 2>/dev/null
  return 0
}
trap cleanup EXIT

# ---- the daemons (loopback, tcp) ------------------------------------------------------------------
# The export is 256 MiB; at most (working set - limit) of it is ever in use. The daemons lend
# 2 MiB slabs: 3 x 96 MiB for `none`, 7 x 64 MiB for ec:4+2 (1.5x, and still enough over 6).
# One client: it may take all of a daemon's memory (--max-client-share 1; the default keeps a
# quarter for other clients, and the 256 MiB export would not fit the start-up check).
loopback=()
for ((i = 0; i < daemons; i++)); do loopback+=(127.0.0.1); done
start_daemons "$work" "${loopback[@]}" -- --capacity "$capacity" --slab-size 2M \
  --max-client-share 1 --rdma off --lease-ttl-ms 30000 "${daemon_args[@]}"
say "$daemons farmemd daemons up at $(elapsed) s: $peer_list"

# ---- farmem-nbd (swap-safe mode: mlockall, PR_SET_IO_FLUSHER, oom_score_adj -1000) --------------
export NBD_SOCK=$work/nbd.sock
"$bin/farmem-nbd" --backend farmem --peers "$peer_list" --secret-file "$work/secret" \
  --resilience "$resilience" --transport tcp --size 256M --unix "$NBD_SOCK" \
  --max-connections 2 --heartbeat-ms 100 --failure-timeout-ms "$failure_ms" \
  --peer-wait-ms 60000 2>"$work/nbd.log" &
nbd_pid=$!
# Start-up waits long: at host load 14-19 a run failed here, before any swapping, with every
# daemon's HELLO timed out within the default --peer-wait-ms (5 s) while the starved guest's
# 7 daemons and farmem-nbd set up their connections (2026-12-03, docs/testing.md).
for _ in $(seq 1200); do
  [[ -S $NBD_SOCK ]] && break
  kill -0 "$nbd_pid" 2>/dev/null || break
  sleep 0.1
done
[[ -S $NBD_SOCK ]] || fail "farmem-nbd did not start"
say "farmem-nbd ($resilience) listening at $(elapsed) s; $form form: $mib MiB under $limit, $passes passes"

# ---- the killer: one daemon dies (drain: is drained) while the workload reads its pages back -------
in0=$(vmstat pswpin)
# Pages swapped in before the kill: well into the first verify pass, long before its end.
kill_after=$(( (mib * 256) / 4 ))
if [[ -n $victim ]]; then
  mkfifo "$work/tick"  # read -t on a fifo nobody writes: a sleep without forking
  (
    now=0
    while vmstat_get now pswpin; ((now - in0 < kill_after)); do
      read -r -t 0.3 <>"$work/tick" || true
    done
    if [[ $mode == drain ]]; then
      t0=$EPOCHREALTIME
      kill -TERM "${pids[$victim]}"
      echo "$now" >"$work/killed"
      echo "[nbd_farmem_swap] SIGTERM (drain) farmemd $victim (pid ${pids[$victim]}) after $((now - in0)) pages swapped in"
      while kill -0 "${pids[$victim]}" 2>/dev/null && [[ $(<"/proc/${pids[$victim]}/stat") != *") Z "* ]]; do
        read -r -t 0.1 <>"$work/tick" || true
      done
      ms=$(( (${EPOCHREALTIME/./} - ${t0/./}) / 1000 ))
      echo "$ms" >"$work/drained_ms"
      echo "[nbd_farmem_swap] farmemd $victim exited $ms ms after SIGTERM (--drain-timeout $drain_ms)"
    else
      kill -9 "${pids[$victim]}"
      echo "$now" >"$work/killed"
      echo "[nbd_farmem_swap] SIGKILL farmemd $victim (pid ${pids[$victim]}) after $((now - in0)) pages swapped in"
    fi
  ) &
  killer=$!
fi

# ---- swap on it, run the workload, check every byte (nbd_swap_smoke.sh) ----------------------------
NBD_SWAP_SERVER_CMD=true NBD_SWAP_EXPORT_SIZE=256M NBD_SWAP_LIMIT=$limit \
  NBD_SWAP_WORKSET_MIB=$mib NBD_SWAP_PASSES=$passes NBD_SWAP_WORKLOAD_ARGS=-r \
  bash "$here/nbd_swap_smoke.sh" "$workload" || fail "the swap workload failed (see above)"
in_end=$(vmstat pswpin)
if [[ -n $killer ]]; then
  kill "$killer" 2>/dev/null || true  # still waiting: the run swapped in too little (checked below)
  wait "$killer" 2>/dev/null || true
  killer=""
fi

kill -0 "$nbd_pid" 2>/dev/null || fail "farmem-nbd died"
# Where the (emulated) CPU went: user+system seconds of farmem-nbd and of the daemons.
cpu_s() { awk '{ printf "%.1f", ($14 + $15) / 100 }' "/proc/$1/stat" 2>/dev/null || echo "?"; }
dcpu=0
for p in "${pids[@]}"; do c=$(cpu_s "$p"); [[ $c == "?" ]] || dcpu=$(awk -v a="$dcpu" -v b="$c" 'BEGIN { print a + b }'); done
say "cpu seconds: farmem-nbd $(cpu_s "$nbd_pid"), daemons $dcpu, guest total $(awk '/^cpu / { printf "%.1f user+nice, %.1f system, %.1f softirq", ($2 + $3) / 100, $4 / 100, $8 / 100 }' /proc/stat)"
if [[ -n $victim ]]; then
  [[ -s $work/killed ]] || fail "farmemd $victim was never killed (the workload swapped in too little)"
  after=$(( in_end - $(cat "$work/killed") ))
  # The kill must have come early enough that a good part of the run read degraded.
  (( after >= kill_after )) || fail "only $after pages were swapped in after the kill"
  say "$after pages swapped in after the kill"
  if [[ $mode == drain ]]; then
    [[ -s $work/drained_ms ]] || fail "farmemd $victim did not exit after SIGTERM"
    (( $(cat "$work/drained_ms") < drain_ms )) || fail "farmemd $victim did not exit within its grace period"
    wait "${pids[$victim]}" || fail "farmemd $victim exited with an error after SIGTERM"
    grep -q "drain: every lease was freed" "$work/farmemd$victim.log" ||
      fail "farmemd $victim still held leases when it exited"
    moved=$(grep -c "moved off 127.0.0.1:$(cat "$work/port$victim")" "$work/nbd.log" || true)
    (( moved > 0 )) || fail "farmem-nbd moved nothing off farmemd $victim"
    if grep -E "not moved before|rebuilt on" "$work/nbd.log"; then fail "members were lost, not moved"; fi
    grep "every member under EVICT_NOTICE is moved" "$work/nbd.log" | tail -n 1 || true
    say "$moved member(s) moved off farmemd $victim"
  else
    grep -E "rebuilt|re-protected|degraded" "$work/nbd.log" | head -n 3 || true
    # The split layout logs "extent E member M rebuilt on D", the stripe layout "slab group G
    # member M re-protected on D".
    grep -qE "rebuilt on|re-protected on" "$work/nbd.log" ||
      fail "farmem-nbd rebuilt nothing after the daemon died"
  fi
fi
if grep -E "LOST|unrecoverable|\[error\]" "$work/nbd.log"; then fail "farmem-nbd reported errors"; fi
kill "$nbd_pid"
wait "$nbd_pid" || fail "farmem-nbd exited with an error"
nbd_pid=""
say "PASS ($mode) in $(elapsed) s"
