#!/bin/bash
# Guest side of the kmod_smoke_* vm tests (issue 15): farmem.ko serves /dev/farmem0 from farmemd
# slabs over soft-RoCE, with farmemctl kmod attach as the control plane (docs/kmod.md).
#   deploy/vm/run --addrs 2 -- bash tests/vm/kmod_smoke.sh <bin dir> <farmem.ko> <swap_workload> [none|replicate|restart|drain] [<block_writer>]
#
# none: two farmemd daemons with --rdma on, on 10.0.2.15 and 10.0.2.16 (rxe0); replicate: three
# (.15, .16, .17), --resilience replicate:2, and one daemon SIGKILLed while the swap workload reads
# its pages back (reads go to the surviving copy; nothing may be lost); the keeper rebuilds every
# lost copy on another daemon while the workload keeps swapping (and rewriting); once it reports
# "rebuild done", a second original daemon is SIGKILLed: the slabs whose surviving copy it held
# have only their rebuilt copy left, and every byte (two more verify passes of the workload, 8 MiB
# written beyond the swap area before the first kill) must still verify; restart: as none, but the
# lease keeper (farmemctl kmod attach) is SIGKILLed while the swap workload reads its pages back
# and started again 2 s later: it re-adopts the device and renews the same leases, the device
# never stops serving, and a pattern written and read back once the daemons' lease TTL has passed
# since the kill (20 s in this mode) proves the leases outlived their first keeper; drain (short:
# no phases 1-3): resilience none over three daemons, the device filled, then `farmemctl drain
# --wait` of the daemon holding most slabs while block_writer rewrites and re-reads random blocks:
# the keeper must move every slab off it from the noticed lease itself (the only copy) and free
# the old leases before the grace period ends, the drained daemon then exits at once on SIGTERM,
# and all 64 MiB must read back as last written (docs/kmod.md "Moving a noticed copy"); then a
# fresh daemon takes the drained one's place, a second daemon is drained, and the fresh one is
# SIGKILLed while the first move onto it is half done: that move fails, the old lease serves on,
# the keeper moves the slab elsewhere, and all 64 MiB must still read back. insmod farmem.ko;
# farmemctl kmod attach leases 64 MiB (2 MiB slabs) and keeps it; then
#   1. dd: 8 MiB of random bytes written with O_DIRECT in 64 KiB blocks across slab boundaries and
#      read back with 4 KiB and 1 MiB blocks: byte-identical; /sys/kernel/farmem/slabs lists
#      every slab's copies, the owner and the daemons;
#   2. fio --verify=crc32c, random 4 KiB at depth 32 and 64 KiB at depth 1; blkdiscard of a range
#      and of the whole device completes;
#   3. swap: mkswap, swapon, swap_workload (a patterned 32 MiB working set under memory.max 8M,
#      re-read and rewritten) verifies every byte; pswpout/pswpin show it went through farmem0;
#   4. swapoff, farmemctl kmod detach: the attach process frees its leases and exits 0; rmmod;
#   5. (none) leaks: KMOD_LEAK_CYCLES (10) cycles of insmod, attach, I/O, detach, rmmod; no kmalloc
#      cache (nor kernfs nodes, block inodes, request queues) may grow by an object per cycle;
#   and the kernel log has no WARNING/BUG/farmem error. Exit 77 when farmem.ko was not built.
# Environment (optional): KMOD_SWAP_MIB (32), KMOD_SWAP_LIMIT (8M), KMOD_DRAIN_RESILIENCE (drain:
# none, or replicate:2: twice the moves), KMOD_DRAIN_GRACE_MS
# (drain: 60000), KMOD_DRAIN_FAIL (drain, none: 1, the failed move; 0 skips it), KMOD_LEAK_CYCLES,
# KMOD_DRAIN_KEEPER_KILL (drain: 1 kills the keeper during a move and restarts it; ctest kmod_smoke_drain_keeper_kill,
# docs/kmod.md: the new keeper learns of the notices from HEARTBEAT replies and frees the orphan).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/guest_daemons.sh"
say() { echo "[kmod_smoke] $*"; }
work=/tmp/kmod-smoke
fail() {
  echo "[kmod_smoke] FAIL: $*"
  for f in "$work"/*.log; do [[ -s $f ]] && { echo "--- last lines of $f"; tail -n 20 "$f"; }; done
  dmesg | grep -i -E 'farmem|warn|bug|rdma|rxe' | tail -n 30
  exit 1
}
[[ ${FARMEM_VM:-} == 1 ]] || fail "run me inside the guest: deploy/vm/run --addrs 1 -- bash $0 ..."
bin=${1:?usage: kmod_smoke.sh <bin dir> <farmem.ko> <swap_workload>}
ko=${2:?farmem.ko path}
workload=${3:?swap_workload path}
mode=${4:-none}
block_writer=${5:-}
case $mode in
  none) daemons=2 resilience=none capacity=48M victim="" ;;
  replicate) daemons=3 resilience=replicate:2 capacity=64M victim=1 other=0 third=2 ;;
  restart) daemons=2 resilience=none capacity=48M victim="" ;;
  # (KMOD_DRAIN_RESILIENCE=replicate:2 by hand: the keeper moves the noticed copies too rather
  # than rebuild them from the other copy; 80M each: two daemons hold both copies after it)
  # (64M with none: two daemons hold all 32 slabs after the move failure phase)
  drain) daemons=3 resilience=${KMOD_DRAIN_RESILIENCE:-none} capacity=64M victim=""
    [[ $resilience == none ]] || capacity=80M ;;
  *) fail "mode must be none, replicate, restart or drain, not $mode" ;;
esac
[[ $mode != replicate && $mode != drain || -x $block_writer ]] ||
  fail "$mode needs the block_writer program (5th argument)"
if [[ ! -f $ko ]]; then
  say "SKIP: $ko was not built (no kernel headers for the guest: deploy/install-deps.sh --vm)"
  exit 77
fi
read -r -a addrs <<<"${FARMEM_VM_ADDRS:-10.0.2.15}"
((${#addrs[@]} >= daemons)) || fail "needs $daemons guest addresses (--addrs $((daemons - 1)))"
mib=${KMOD_SWAP_MIB:-32}
limit=${KMOD_SWAP_LIMIT:-8M}
start=$(date +%s.%N)
elapsed() { awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
vmstat() { awk -v k="$1" '$1 == k { print $2 }' /proc/vmstat; }
mkdir -p "$work"
pids=() attach="" killer="" writer=""
cleanup() {
  set +e
  [[ -n $killer ]] && kill "$killer" 2>/dev/null
  [[ -n $writer ]] && touch "$work/stop"
  swapoff /dev/farmem0 2>/dev/null
  [[ -n $attach ]] && kill "$attach" 2>/dev/null && wait "$attach" 2>/dev/null
  [[ -n ${wl:-} ]] && kill "$wl" 2>/dev/null
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  return 0
}
trap cleanup EXIT
dmesg -C

# ---- the daemons: RDMA on rxe0, one per address ----------------------------------------------------
# restart: a lease TTL of 20 s rather than 10 (the default) leaves room for the keeper's restart
# under TCG on a busy host (7 s seen from the kill to the re-adoption, 2 s of it the test's pause).
ttl_ms=10000
[[ $mode == restart ]] && ttl_ms=20000
# drain: SIGTERM drains first, for up to the grace period (and says when every lease was freed).
grace_ms=${KMOD_DRAIN_GRACE_MS:-60000}
daemon_args=(--log-level warn)
[[ $mode == drain ]] && daemon_args=(--log-level info --drain-timeout "$grace_ms")
start_daemons "$work" "${addrs[@]:0:daemons}" -- --capacity "$capacity" --slab-size 2M \
  --max-client-share 1 --rdma on --lease-ttl-ms "$ttl_ms" "${daemon_args[@]}"
say "farmemd up at $(elapsed) s: $peer_list"

# ---- the module and its control plane -------------------------------------------------------------
insmod "$ko" || fail "insmod $ko"
[[ $(cat /sys/kernel/farmem/version) == 4 ]] || fail "unexpected interface version"
start_attach() {  # log file [size]
  "$bin/farmemctl" --log-level info kmod attach --peers "$peer_list" --secret-file "$work/secret" \
    --size "${2:-64M}" --resilience "$resilience" >"$1" 2>&1 &
  attach=$!
}
wait_running() {  # /dev/farmem0 is there and serving
  for _ in $(seq 600); do
    grep -q '^state=running' /sys/kernel/farmem/status 2>/dev/null && break
    kill -0 "$attach" 2>/dev/null || fail "farmemctl kmod attach exited"
    sleep 0.05
  done
  grep -q '^state=running' /sys/kernel/farmem/status || fail "/dev/farmem0 not running"
  for _ in $(seq 200); do [[ -b /dev/farmem0 ]] && break; sleep 0.05; done
  [[ -b /dev/farmem0 ]] || fail "no /dev/farmem0"
}
start_attach "$work/attach.log"
wait_running
say "attached at $(elapsed) s: $(cat /sys/kernel/farmem/status)"
size=$(blockdev --getsize64 /dev/farmem0)
((size == 64 << 20)) || fail "/dev/farmem0 has $size bytes, want $((64 << 20))"
[[ $(blockdev --getss /dev/farmem0) == 4096 ]] || fail "logical block size is not 4096"

# ---- 4. detach, rmmod, a clean kernel log (every mode ends here) ---------------------------------
finish() {
  if [[ -z $victim ]]; then
    # (A move whose daemon was killed: the writes to it failed.)
    grep -q 'stale=0 ' /sys/kernel/farmem/status || fail "a stale copy: $(cat /sys/kernel/farmem/status)"
    [[ -n ${move_failed:-} ]] || grep -q 'errors=0 ' /sys/kernel/farmem/status ||
      fail "completion errors: $(cat /sys/kernel/farmem/status)"
  fi
  "$bin/farmemctl" kmod detach || fail "farmemctl kmod detach"
  rc=0
  wait "$attach" || rc=$?
  attach=""
  ((rc == 0)) || fail "farmemctl kmod attach exited with $rc after detach"
  [[ ! -e /dev/farmem0 ]] || fail "/dev/farmem0 still there after detach"
  if [[ $mode == restart ]]; then
    ! grep -q 'lapsed\|cannot be renewed' "$work/attach2.log" || fail "leases lapsed (above)"
  fi
  rmmod farmem || fail "rmmod farmem"
  [[ $mode == none ]] && leak_check
  # (The taint notices "module verification failed" of an unsigned out-of-tree module are expected.)
  # With a daemon killed, its failed operations and its disconnect are expected in the log.
  bad='WARNING|BUG|Oops|farmem: .*(failed|error|disconnected)'
  [[ -n $victim ]] && bad='WARNING|BUG|Oops'
  # drain: the drained daemon's exit disconnects it (it holds no slab by then: nothing fails).
  [[ $mode == drain ]] && bad='WARNING|BUG|Oops|farmem: .*(failed|error)'
  # The daemon killed mid-move: its failures are expected (the move's, the writes' to it, a
  # retry's connection to it, and what those control writes returned).
  local ignore='^$'
  [[ -n ${move_failed:-} ]] && ignore=" ${peers[$d]%:*}:|farmem: control: '(move|peer)' failed: -"
  if dmesg | grep -v 'module verification failed' | grep -v -E "$ignore" | grep -E "$bad"; then
    fail "the kernel log has warnings or farmem errors (above)"
  fi
  say "PASS in $(elapsed) s"
}

# ---- 5. (none) leaks: cycles of insmod, attach, I/O, detach, rmmod --------------------------------
# Debian's kernel has no kmemleak (CONFIG_DEBUG_KMEMLEAK is off), so: the module's own slab caches
# (it makes none) must be gone after rmmod, and the caches it and what it drives (rdma_cm, the
# verbs core, rxe, blk-mq, the gendisk and its sysfs) allocate from must not grow by one object
# per cycle over KMOD_LEAK_CYCLES cycles. Watched: kmalloc-* (every kind), kernfs nodes, block
# devices' inodes, request queues, each counted for its merged group (SLUB merges caches of one
# size: /sys/kernel/slab/NAME is a link to the group). The other caches are only reported: the
# cycles' processes and TCP connections (pid, TIME_WAIT sockets, dentries) are noise there.
# SLUB counts every object of a CPU's current slab as in use; shrinking each cache first flushes
# the per-CPU slabs, which makes the counts exact up to what the rest of the guest does meanwhile.
slab_groups() {  # the watched caches' groups, "DIR NAME" (one name per group)
  local n
  for n in /sys/kernel/slab/{kmalloc-,dma-kmalloc-}* /sys/kernel/slab/{kernfs_node_cache,kernfs_iattrs_cache,bdev_cache,request_queue}; do
    [[ -e $n ]] && echo "$(realpath "$n") ${n##*/}"
  done | sort -u -k1,1 >"$work/slab.groups"
}
slab_counts() {  # prefix: PREFIX.all "cache objects" of every cache, PREFIX.watched of the groups
  local g n f
  awk 'NR > 2 { print $1, $2 }' /proc/slabinfo >"$1.all"
  while read -r g n; do
    echo 1 >>"$g/shrink"  # (not >: a truncate sets the file's attributes, allocating kernfs_iattrs)
    read -r f _ <"$g/objects"
    echo "${g##*/}/$n $f"
  done <"$work/slab.groups" >"$1.watched"
}
leak_check() {
  local cycles=${KMOD_LEAK_CYCLES:-10} i grown t0=$EPOCHREALTIME
  ! grep -i farmem /proc/slabinfo || fail "a farmem slab cache outlived rmmod (above)"
  [[ ! -e /sys/kernel/farmem ]] || fail "/sys/kernel/farmem outlived rmmod"
  head -c $((4 << 20)) /dev/urandom >"$work/small"
  slab_groups
  # Two cycles before counting: the first use of a kernel path may allocate for good (rdma_cm's
  # and rxe's pools, a block major's kobjects, ...), and what the phases above left settles.
  for ((i = -2; i < cycles; i++)); do
    ((i >= 0)) && slab_counts "$work/slabs.$i"
    insmod "$ko" || fail "leak check: insmod, cycle $i"
    start_attach "$work/attach-leak.log" 4M
    wait_running
    if ! { dd if="$work/small" of=/dev/farmem0 bs=64K oflag=direct status=none &&
      dd if=/dev/farmem0 of="$work/small.back" bs=1M iflag=direct status=none &&
      cmp -s "$work/small" "$work/small.back"; }; then
      fail "leak check: I/O in cycle $i"
    fi
    "$bin/farmemctl" kmod detach || fail "leak check: detach, cycle $i"
    wait "$attach" || fail "leak check: the attach process exited with $? after detach, cycle $i"
    attach=""
    rmmod farmem || fail "leak check: rmmod, cycle $i"
  done
  # A leak grows its cache by at least one object in (nearly) every cycle; the rest of the
  # guest allocates in bursts: kmalloc-96 +40 over 5 cycles then +0, +420 in 6 of 10 cycles,
  # +247 in 7 of 10 — 9p fids (p9_fid_create, slub_debug=U's alloc_traces), the root file
  # system's, for the files each cycle's processes open. A group leaks when it grew by `cycles`
  # objects or more in all and grew in at least 9 of 10 cycles (a module leaking a kmalloc per
  # attach: 10 of 10). RCU-deferred frees of the last cycle may still be pending: look again
  # (a state, not a time) before failing.
  for _ in $(seq 8); do
    slab_counts "$work/slabs.$cycles"
    grown=$(slab_leaks)
    [[ -z $grown ]] && break
    sleep 0.25
  done
  say "leak check: $cycles cycles of insmod, attach (4 MiB), I/O, detach, rmmod in $(((${EPOCHREALTIME/./} - ${t0/./}) / 1000)) ms"
  say "leak check: watched caches that grew (objects, cycles that grew it): $(slab_leaks 1 | sort -t+ -k2 -rn | head -n 6 | tr '\n' ';')"
  say "leak check: largest growths of all caches (not checked): $(awk 'NR == FNR { n[$1] = $2; next }
    $2 > n[$1] { printf "%s +%d\n", $1, $2 - n[$1] }' "$work/slabs.0.all" "$work/slabs.$cycles.all" |
    sort -t+ -k2 -rn | head -n 4 | tr '\n' ';')"
  [[ -z $grown ]] ||
    fail "slab caches grew by one object per cycle over $cycles cycles (a leak): $grown"
}
slab_leaks() {  # [min total]: "group +N (a -> b) grew in K of C cycles" per leaking (or growing) group
  local f files=()
  for ((f = 0; f <= cycles; f++)); do files+=("$work/slabs.$f.watched"); done
  awk -v c="$cycles" -v min="${1:-}" '
    { if (FNR == 1) f++; n[$1, f] = $2; g[$1] = 1 }
    END {
      for (k in g) {
        up = 0
        for (i = 2; i <= c + 1; i++) if (n[k, i] > n[k, i - 1]) up++
        d = n[k, c + 1] - n[k, 1]
        if (min != "" ? d >= min : d >= c && up * 10 >= c * 9)
          printf "%s +%d (%d -> %d) grew in %d of %d cycles\n", k, d, n[k, 1], n[k, c + 1], up, c
      }
    }' "${files[@]}"
}
status_field() { sed -n "s/.* $1=\([0-9]*\).*/\1/p" /sys/kernel/farmem/status; }

# ---- drain, then: a move that fails partway (the new lease's daemon dies mid-copy) ----------------
# A fresh farmemd takes the drained one's address and port (the keeper's Cluster finds it again)
# and holds nothing; the daemon of the other two holding fewer slabs is drained. The keeper places
# each move on the daemon with the most free slabs, the fresh one, first; with the copier slowed
# down (300 ms per 64 KiB chunk) it is SIGKILLed as soon as the module has a copy on it (stale:
# being filled), while block_writer keeps writing. That move must fail with the old lease put back
# as the slab's copy (nothing on the killed daemon was ever the only copy of anything), the keeper
# must move every slab to the last daemon instead within the grace, and all 64 MiB must read back
# as last written. KMOD_DRAIN_FAIL=0 skips it.
move_fails_partway() {
  local slabs counts n2 p2 target2 e moved_before t0 ms rc ups_before
  ups_before=$(grep -c "NodeUp ${peers[$d]}" "$work/attach.log" || true)
  "$bin/farmemd" --listen "${peers[$d]}" --capacity "$capacity" --slab-size 2M \
    --max-client-share 1 --rdma on --secret-file "$work/secret" --lease-ttl-ms "$ttl_ms" \
    "${daemon_args[@]}" 2>"$work/farmemd${d}b.log" &
  e=$!
  pids+=("$e")
  # The keeper's word that it reaches the fresh daemon (its Cluster's heartbeat got through).
  give_up=$((SECONDS + 30))
  until (($(grep -c "NodeUp ${peers[$d]}" "$work/attach.log") > ups_before)); do
    ((SECONDS < give_up)) || fail "the keeper did not see farmemd $d back at ${peers[$d]}"
    sleep 0.1
  done
  slabs=$(cat /sys/kernel/farmem/slabs)
  counts=$(awk '$1 == "slab" { n[$3]++ } END { for (p in n) print n[p], p }' <<<"$slabs" | sort -n)
  read -r n2 p2 <<<"$counts"
  target2=$(awk -v p="$p2" '$1 == "peer" && $2 == p { print $5 }' <<<"$slabs")
  say "fresh farmemd at ${peers[$d]}; draining $target2 ($n2 slabs), its first move is to fail"
  moved_before=$(status_field moved)
  echo 300 >/sys/module/farmem/parameters/rebuild_chunk_delay_ms
  rm -f "$work/stop"
  "$block_writer" /dev/farmem0 "$work/full" 0 1024 65536 "$work/stop" >"$work/writer2.log" 2>&1 &
  writer=$!
  t0=$EPOCHREALTIME
  "$bin/farmemctl" drain "$target2" --secret-file "$work/secret" --grace-ms "$grace_ms" --wait \
    >"$work/drain2.log" 2>&1 &
  local drainer=$!
  # The module's word that a move onto the fresh daemon began (status and slabs wait while a
  # move runs: it holds the control lock). With 300 ms per chunk it has ~10 s to go.
  local started="farmem: move of slab .* to daemon ${peers[$d]%:*}:.* started" starts
  starts=$(dmesg | grep -c "$started" || true)
  give_up=$((SECONDS + 60))
  until (($(dmesg | grep -c "$started") > starts)); do
    kill -0 "$drainer" 2>/dev/null || fail "the drain ended before a move to the fresh daemon began"
    ((SECONDS < give_up)) || fail "no move to the fresh daemon began"
    sleep 0.05
  done
  kill -9 "$e"
  say "SIGKILL the fresh farmemd mid-copy ($(dmesg | grep "$started" | tail -n 1 | sed 's/^.*farmem: //')) at $(elapsed) s"
  echo 0 >/sys/module/farmem/parameters/rebuild_chunk_delay_ms
  rc=0
  wait "$drainer" || rc=$?
  ms=$(((${EPOCHREALTIME/./} - ${t0/./}) / 1000))
  ((rc == 0)) || fail "farmemctl drain --wait: $(cat "$work/drain2.log")"
  say "$(tail -n 1 "$work/drain2.log") $ms ms after the notice (grace $grace_ms ms)"
  ((ms < grace_ms)) || fail "the leases were freed only after the grace period"
  # (grep -q would end the pipe early: dmesg's SIGPIPE fails it under pipefail)
  grep -q "farmem: move of slab .* to daemon ${peers[$d]%:*}:.* failed: .*(the old lease is its copy again)" <<<"$(dmesg)" ||
    fail "no move to the killed daemon failed with its old lease put back"
  give_up=$((SECONDS + 60))
  until (($(status_field moved) >= moved_before + n2)) && ! grep -q 'stale=[1-9]' /sys/kernel/farmem/status; do
    ((SECONDS < give_up)) || fail "moved= $(status_field moved), want $((moved_before + n2)): $(cat /sys/kernel/farmem/status)"
    sleep 0.2
  done
  touch "$work/stop"
  rc=0
  wait "$writer" || rc=$?
  writer=""
  cat "$work/writer2.log"
  ((rc == 0)) || fail "the writer failed during the moves (above)"
  ! grep -E 'is lost|no live copy|rebuilt on' "$work/attach.log" || fail "slabs were lost or rebuilt, not moved"
  slabs=$(cat /sys/kernel/farmem/slabs)
  ! awk -v a="$target2" -v b="${peers[$d]}" '$1 == "peer" && ($5 == a || $5 == b) { gone[$2] = 1 }
    $1 == "slab" && gone[$3]' <<<"$slabs" | grep -q . ||
    fail "slabs left on the drained or the killed daemon: $slabs"
  dd if=/dev/farmem0 of="$work/full.back" bs=1M iflag=direct status=none ||
    fail "dd read of the whole device after the failed move"
  cmp "$work/full" "$work/full.back" || fail "the device differs from what was written last"
  say "verified 64 MiB after a move failed partway and $n2 slabs moved at $(elapsed) s: $(cat /sys/kernel/farmem/status)"
  move_failed=1
}

# ---- drain: move every slab off a noticed daemon, resilience none ---------------------------------
if [[ $mode == drain ]]; then
  # The daemon holding most slabs (their only copies).
  slabs=$(cat /sys/kernel/farmem/slabs) || fail "reading /sys/kernel/farmem/slabs"
  # (no process substitution: the guest has no /dev/fd)
  top=$(awk '$1 == "slab" { n[$3]++ } END { for (p in n) print n[p], p }' <<<"$slabs" |
    sort -rn | head -n 1)
  read -r held_n peer_i <<<"$top"
  target=$(awk -v p="$peer_i" '$1 == "peer" && $2 == p { print $5 }' <<<"$slabs")
  for ((d = 0; d < daemons; d++)); do [[ ${peers[$d]} == "$target" ]] && break; done
  ((d < daemons)) || fail "no daemon is $target (peer $peer_i)"
  say "farmemd $d ($target) holds $held_n of the slabs' copies ($resilience)"
  head -c $((64 << 20)) /dev/urandom >"$work/full"
  dd if="$work/full" of=/dev/farmem0 bs=1M oflag=direct status=none || fail "dd write of 64 MiB"
  # A writer through the whole move: random 64 KiB blocks of the whole device, each read back at
  # once (tests/vm/block_writer.c); $work/full follows every write. The copier pauses 10 ms
  # between 64 KiB chunks (a module test knob, 0.3 s a slab) so that more writes land in
  # half-moved slabs (75 with 20 ms seen; the moves must still end well within the grace).
  echo 10 >/sys/module/farmem/parameters/rebuild_chunk_delay_ms
  rebuild_writes_before=$(status_field rebuild_writes)
  rm -f "$work/stop"
  "$block_writer" /dev/farmem0 "$work/full" 0 1024 65536 "$work/stop" >"$work/writer.log" 2>&1 &
  writer=$!
  t0=$EPOCHREALTIME
  keeper_log=$work/attach.log
  if [[ ${KMOD_DRAIN_KEEPER_KILL:-0} == 1 ]]; then
    # By hand: the keeper SIGKILLed while the module moves a slab, restarted 2 s later (systemd's
    # Restart=on-failure): the new one re-adopts the device mid-drain and must finish it.
    "$bin/farmemctl" drain "$target" --secret-file "$work/secret" --grace-ms "$grace_ms" --wait \
      >"$work/drain.log" 2>&1 &
    drainer=$!
    starts=$(dmesg | grep -c 'farmem: move of slab .* started' || true)
    give_up=$((SECONDS + 60))
    until (($(dmesg | grep -c 'farmem: move of slab .* started') > starts + 1)); do
      kill -0 "$drainer" 2>/dev/null || fail "the drain ended before the second move began"
      ((SECONDS < give_up)) || fail "no move began"
      sleep 0.05
    done
    kill -9 "$attach"
    wait "$attach" 2>/dev/null || true
    say "SIGKILL the keeper during a move at $(elapsed) s: $(dmesg | grep 'farmem: move of slab' | tail -n 1)"
    sleep 2
    start_attach "$work/attach2.log"
    keeper_log=$work/attach2.log
    for _ in $(seq 1200); do
      grep -q '^re-adopted /dev/farmem0' "$keeper_log" && break
      kill -0 "$attach" 2>/dev/null || fail "the restarted keeper exited: $(cat "$keeper_log")"
      sleep 0.05
    done
    grep -q '^re-adopted /dev/farmem0' "$keeper_log" || fail "the restarted keeper did not re-adopt"
    say "restarted keeper: $(grep '^re-adopted' "$keeper_log") at $(elapsed) s"
    rc=0
    wait "$drainer" || rc=$?
    ((rc == 0)) || fail "farmemctl drain --wait: $(cat "$work/drain.log")"
    # The old lease of the move the first keeper had started (the module finished it): in no
    # slab, under notice, freed by the new keeper (else the drain waits for its deadline).
    grep -q 'freed 1 orphan lease(s) on' "$keeper_log" ||
      fail "the new keeper freed no orphan lease: $(grep -i orphan "$keeper_log")"
    say "restarted keeper: $(grep -o 'freed 1 orphan lease(s) on [^ ]*' "$keeper_log"); $(grep -c 'under notice by its HEARTBEAT reply' "$keeper_log") notice(s) learned from HEARTBEAT replies"
  else
    "$bin/farmemctl" drain "$target" --secret-file "$work/secret" --grace-ms "$grace_ms" --wait \
      >"$work/drain.log" 2>&1 || fail "farmemctl drain --wait: $(cat "$work/drain.log")"
  fi
  drained_ms=$(((${EPOCHREALTIME/./} - ${t0/./}) / 1000))
  say "$(tail -n 1 "$work/drain.log") $drained_ms ms after the notice (grace $grace_ms ms)"
  ((drained_ms < grace_ms)) || fail "the leases were freed only after the grace period"
  # Every slab moved is the keeper's word (its state), then the module's.
  give_up=$((SECONDS + 60))
  until grep -q '^rebuild done' "$keeper_log"; do
    kill -0 "$attach" 2>/dev/null || fail "the keeper exited"
    ((SECONDS < give_up)) || fail "the keeper did not say rebuild done"
    sleep 0.2
  done
  touch "$work/stop"
  rc=0
  wait "$writer" || rc=$?
  writer=""
  echo 0 >/sys/module/farmem/parameters/rebuild_chunk_delay_ms
  cat "$work/writer.log"
  ((rc == 0)) || fail "the writer failed during the moves (above)"
  grep -E 'moved off' "$keeper_log" | sed 's/^.*slab/[kmod_smoke] keeper: slab/'
  say "keeper: $(grep '^rebuild done' "$keeper_log")"
  ((held_n > 0 && $(status_field moved) == held_n)) ||
    fail "moved=$(status_field moved), want $held_n: $(cat /sys/kernel/farmem/status)"
  overlapped=$(($(status_field rebuild_writes) - rebuild_writes_before))
  say "$overlapped writes went to a copy while it was being moved; $(status_field recopied) chunks copied again"
  ((overlapped >= 3)) || fail "only $overlapped writes overlapped a move: this proves little"
  ! grep -E 'is lost|no live copy|rebuilt on' "$keeper_log" || fail "slabs were lost or rebuilt, not moved"
  slabs=$(cat /sys/kernel/farmem/slabs)
  ! awk -v p="$peer_i" '$1 == "slab" && $3 == p' <<<"$slabs" | grep -q . ||
    fail "slabs still on the drained daemon: $(awk -v p="$peer_i" '$1 == "slab" && $3 == p' <<<"$slabs")"
  grep -q 'stale=0 ' /sys/kernel/farmem/status || fail "a copy is stale: $(cat /sys/kernel/farmem/status)"
  # The drained daemon holds no lease: SIGTERM (--drain-timeout) ends it at once.
  t0=$EPOCHREALTIME
  kill -TERM "${pids[$d]}"
  wait "${pids[$d]}" || fail "farmemd $d exited with an error after SIGTERM"
  ms=$(((${EPOCHREALTIME/./} - ${t0/./}) / 1000))
  say "farmemd $d exited $ms ms after SIGTERM (--drain-timeout $grace_ms)"
  ((ms < grace_ms)) || fail "farmemd $d did not exit within its grace period"
  grep -q "drain: every lease was freed" "$work/farmemd$d.log" ||
    fail "farmemd $d still held leases when it exited"
  # Every byte, with the drained daemon gone: nothing depends on the old leases.
  dd if=/dev/farmem0 of="$work/full.back" bs=1M iflag=direct status=none ||
    fail "dd read of the whole device after the drain"
  cmp "$work/full" "$work/full.back" || fail "the device differs from what was written last"
  say "verified 64 MiB after the drain at $(elapsed) s: $(cat /sys/kernel/farmem/status)"
  # (replicate:2: the other daemon holds the slabs' other copies, the fresh one is the only place)
  [[ ${KMOD_DRAIN_FAIL:-1} == 1 && $resilience == none && $keeper_log == "$work/attach.log" ]] &&
    move_fails_partway
  finish
  exit 0
fi

# ---- 1. dd: a pattern across slab boundaries -------------------------------------------------------
head -c $((8 << 20)) /dev/urandom >"$work/pattern"
# 1 MiB in: the 8 MiB cross the 2 MiB slabs at 2, 4, 6 and 8 MiB.
dd if="$work/pattern" of=/dev/farmem0 bs=64K seek=16 oflag=direct status=none || fail "dd write"
dd if=/dev/farmem0 of="$work/back4k" bs=4K skip=256 count=2048 iflag=direct status=none ||
  fail "dd read 4K"
dd if=/dev/farmem0 of="$work/back1m" bs=1M skip=1 count=8 iflag=direct status=none ||
  fail "dd read 1M"
cmp "$work/pattern" "$work/back4k" || fail "4 KiB reads differ from what was written"
cmp "$work/pattern" "$work/back1m" || fail "1 MiB reads differ from what was written"
say "dd: 8 MiB written and read back identical at $(elapsed) s"
# What a restarted keeper reads back: the owner, both daemons, every slab's copies.
copies=${resilience#replicate:}
[[ $copies == none ]] && copies=1
slabs=$(cat /sys/kernel/farmem/slabs) || fail "reading /sys/kernel/farmem/slabs"
grep -q "^size $((64 << 20)) $((2 << 20)) $copies\$" <<<"$slabs" || fail "slabs: no size line"
grep -Eq '^owner [0-9a-f]{32} cluster$' <<<"$slabs" || fail "slabs: no owner line"
grep -q '^peer ' <<<"$slabs" || fail "slabs: no peer line"
! grep -q '^peer .* connected=0$' <<<"$slabs" || fail "slabs: a daemon is not connected"
(($(grep -c '^slab .* stale=0$' <<<"$slabs") == 32 * copies)) ||
  fail "slabs: want $((32 * copies)) slab lines: $(head -c 600 <<<"$slabs")"

# ---- 2. fio with crc32c verification ---------------------------------------------------------------
run_fio() {  # name bs depth
  fio --name="$1" --filename=/dev/farmem0 --rw=randwrite --bs="$2" --iodepth="$3" \
    --ioengine=libaio --direct=1 --size=8M --offset=16M --verify=crc32c --verify_fatal=1 \
    --do_verify=1 --randrepeat=0 --output="$work/fio-$1.log" || fail "fio $1"
  grep -E 'IOPS|lat \(usec\).*avg' "$work/fio-$1.log" | head -n 3 | sed "s/^/[kmod_smoke] fio $1: /"
}
run_fio rand4k-qd32 4k 32
run_fio rand64k-qd1 64k 1
say "fio verify passed at $(elapsed) s"
# DISCARD completes (a no-op for farmem.ko: the slabs stay leased, docs/kmod.md).
(($(cat /sys/block/farmem0/queue/discard_max_bytes) > 0)) || fail "farmem0 offers no discard"
blkdiscard -o $((3 << 20)) -l $((4 << 20)) /dev/farmem0 || fail "blkdiscard of 4 MiB"
blkdiscard /dev/farmem0 || fail "blkdiscard of the whole device"
say "blkdiscard passed at $(elapsed) s"

# ---- 3. swap on /dev/farmem0 ------------------------------------------------------------------------
swap_kib=""
if [[ -n $victim ]]; then
  # replicate: swap on the first 48 MiB; the last 16 MiB hold data for the rebuild to carry: 8 MiB
  # written now (48..56 MiB) and 4 MiB (57..61 MiB) the writer keeps rewriting during the rebuild.
  swap_kib=$((48 << 10))
  head -c $((8 << 20)) /dev/urandom >"$work/tail"
  dd if="$work/tail" of=/dev/farmem0 bs=1M seek=48 oflag=direct status=none || fail "dd write tail"
fi
mkswap /dev/farmem0 $swap_kib >/dev/null || fail "mkswap"
swapon /dev/farmem0 || fail "swapon"
cg=/sys/fs/cgroup/kmod_smoke
mkdir -p "$cg"
echo "$limit" >"$cg/memory.max"
out0=$(vmstat pswpout) in0=$(vmstat pswpin)
bash -c 'echo $$ >"$1/cgroup.procs" && shift && exec "$@"' _ "$cg" "$workload" -m "$mib" -p 2 -r \
  >"$work/wl.log" 2>&1 &
wl=$!
if [[ -n $victim ]]; then
  # SIGKILL one daemon once a quarter of the working set was swapped back in: well into the
  # first verify pass, long before its end.
  (
    die() { echo "[kmod_smoke] $*"; exit 1; }
    while (($(vmstat pswpin) - in0 < mib * 256 / 4)); do sleep 0.2; done
    kill -9 "${pids[$victim]}"
    echo "[kmod_smoke] SIGKILL farmemd $victim after $(($(vmstat pswpin) - in0)) pages swapped in at $(elapsed) s"
    touch "$work/killed"
    # The keeper rebuilds the lost copies on the other daemons while the workload keeps
    # swapping (its rewrites go to the survivors and to the copy being rebuilt). Wait for it to
    # say "rebuild done" (its state, not a time).
    give_up=$((SECONDS + 150))
    until grep -q '^rebuild done' "$work/attach.log"; do
      kill -0 "$attach" 2>/dev/null || die "the keeper exited"
      ((SECONDS < give_up)) || die "no rebuild done 150 s after the kill"
      sleep 0.2
    done
    echo "[kmod_smoke] $(grep '^rebuild done' "$work/attach.log") at $(elapsed) s, $(grep -c verified "$work/wl.log" || true) workload pass(es) done"
  ) &
  killer=$!
fi
if [[ $mode == restart ]]; then
  # SIGKILL the lease keeper once a quarter of the working set was swapped back in, and start it
  # again 2 s (four missed heartbeats) later: systemd's Restart=on-failure, by hand.
  while (($(vmstat pswpin) - in0 < mib * 256 / 4)); do
    kill -0 "$wl" 2>/dev/null || fail "the workload ended before the keeper was killed"
    sleep 0.2
  done
  kill -9 "$attach"
  wait "$attach" 2>/dev/null || true
  killed_at=$(date +%s)
  say "SIGKILL farmemctl kmod attach after $(($(vmstat pswpin) - in0)) pages swapped in, at $(elapsed) s"
  sleep 2
  start_attach "$work/attach2.log"
  for _ in $(seq 600); do
    grep -q '^re-adopted /dev/farmem0' "$work/attach2.log" && break
    kill -0 "$attach" 2>/dev/null || fail "the restarted farmemctl kmod attach exited"
    sleep 0.05
  done
  grep -q '^re-adopted /dev/farmem0' "$work/attach2.log" || fail "the restarted attach did not re-adopt"
  say "restarted keeper: $(grep '^re-adopted' "$work/attach2.log") at $(elapsed) s"
fi
rc=0
wait "$wl" || rc=$?
out=$(($(vmstat pswpout) - out0)) in=$(($(vmstat pswpin) - in0))
say "swap: pswpout +$out pages, pswpin +$in pages at $(elapsed) s; $(grep -c verified "$work/wl.log" || true) verify passes"
grep MISMATCH "$work/wl.log" && fail "swap_workload found a page it did not write"
if [[ -n $victim ]]; then
  krc=0
  wait "$killer" || krc=$?
  killer=""
  ((krc == 0)) || fail "the kill and rebuild failed (above)"
fi
((rc == 0)) || fail "swap_workload exited with $rc"
min=$(((mib * 256) / 2))
((out >= min && in >= min)) || fail "too little went through swap (want >= $min pages each way)"
if [[ -n $victim ]]; then
  say "after the kill and the rebuild: $(cat /sys/kernel/farmem/status)"
  grep -q 'connected=2 ' /sys/kernel/farmem/status || fail "the killed daemon is still connected"
  grep -q 'stale=0 ' /sys/kernel/farmem/status || fail "a copy is still stale after the rebuild"
fi
swapoff /dev/farmem0 || fail "swapoff"
rmdir "$cg" 2>/dev/null || true
if [[ -n $victim ]]; then
  # Beyond the swap area, written before the kill: half of the slabs now read from copies the
  # keeper rebuilt (copy 0 first).
  dd if=/dev/farmem0 of="$work/tail.back" bs=1M skip=48 count=8 iflag=direct status=none ||
    fail "dd read of the data written before the kill"
  cmp "$work/tail" "$work/tail.back" || fail "data written before the kill differs after the rebuild"

  # ---- 3b. a second rebuild under a block-level writer, then the last original copies die -------
  # A fresh farmemd where daemon $victim was (same address and port: the keeper's Cluster finds it
  # again); every slab now has its copies on daemons $other and $third. Fill the device, kill
  # $other: all 32 slabs are rebuilt onto the fresh daemon while a writer keeps rewriting random
  # 64 KiB blocks of the last two slabs and reading them back. Once the keeper says "rebuild done"
  # again, kill $third, the
  # other original daemon: every byte now comes from a rebuilt copy, and all 64 MiB must be what
  # was written last (a write during a slab's copy that missed the new copy would show here).
  grep -E 'is lost|^rebuild done' "$work/attach.log" | sed 's/^/[kmod_smoke] keeper: /'
  "$bin/farmemd" --listen "${peers[$victim]}" --capacity "$capacity" \
    --slab-size 2M --max-client-share 1 --rdma on --secret-file "$work/secret" \
    --lease-ttl-ms "$ttl_ms" --log-level warn 2>"$work/farmemd${victim}b.log" &
  pids[$victim]=$!
  head -c $((64 << 20)) /dev/urandom >"$work/full"
  dd if="$work/full" of=/dev/farmem0 bs=1M oflag=direct status=none || fail "dd write of 64 MiB"
  say "64 MiB written at $(elapsed) s; daemon $victim restarted"
  rm -f "$work/stop"
  # Random 64 KiB blocks of the last two slabs, 30 and 31, which the keeper rebuilds last (it goes
  # by slab number), each read back at once; $work/full follows every write
  # (tests/vm/block_writer.c: no process per block). Once 28 slabs are rebuilt the copier pauses
  # 100 ms between 64 KiB chunks (a module test knob), so the writes land in half-copied slabs;
  # the writer stops when the keeper says "rebuild done", so a write that missed a new copy is
  # not overwritten again before the last original copies die and everything is read back.
  delay_knob=/sys/module/farmem/parameters/rebuild_chunk_delay_ms
  rebuild_writes_before=$(status_field rebuild_writes)
  "$block_writer" /dev/farmem0 "$work/full" $((30 * 32)) 64 65536 "$work/stop" >"$work/writer.log" 2>&1 &
  writer=$!
  done_before=$(grep -c '^rebuild done' "$work/attach.log" || true)
  rebuilt_before=$(status_field rebuilt)
  kill -9 "${pids[$other]}"
  say "SIGKILL farmemd $other at $(elapsed) s, the writer running"
  give_up=$((SECONDS + 150))
  # Every slab had a copy on it: all 32 rebuilt, and the keeper's word that it is done.
  until (($(grep -c '^rebuild done' "$work/attach.log") > done_before &&
          $(status_field rebuilt) >= rebuilt_before + 32)); do
    kill -0 "$attach" 2>/dev/null || fail "the keeper exited"
    kill -0 "$writer" 2>/dev/null || break
    ((SECONDS < give_up)) ||
      fail "no second rebuild done 150 s after the kill (rebuilt= was $rebuilt_before, $done_before 'rebuild done' before): $(cat /sys/kernel/farmem/status)"
    echo "$(elapsed) s: $(cat /sys/kernel/farmem/status) knob=$(cat "$delay_knob")" >>"$work/rebuild-wait.log"
    if (($(cat "$delay_knob") == 0 && $(status_field rebuilt) >= rebuilt_before + 28)); then
      echo 100 >"$delay_knob"
    fi
    sleep 0.2
  done
  touch "$work/stop"
  echo 0 >"$delay_knob"
  rc=0
  wait "$writer" || rc=$?
  cat "$work/writer.log"
  ((rc == 0)) || fail "the writer failed during the rebuild (above)"
  # The point of this phase: writes that reached a copy while it was being rebuilt (the module
  # counts them). With too few of them, a module that lost such writes would still pass.
  overlapped=$(($(status_field rebuild_writes) - rebuild_writes_before))
  say "$overlapped writes went to a copy while it was being rebuilt; $(status_field recopied) chunks copied again because a write overtook them"
  ((overlapped >= 10)) || fail "only $overlapped writes overlapped a rebuild: this phase proves nothing"
  say "$(grep '^rebuild done' "$work/attach.log" | tail -n 1) at $(elapsed) s: $(cat /sys/kernel/farmem/status)"
  kill -9 "${pids[$third]}"
  say "SIGKILL farmemd $third (the other original daemon) at $(elapsed) s"
  dd if=/dev/farmem0 of="$work/full.back" bs=1M iflag=direct status=none ||
    fail "dd read of the whole device from the rebuilt copies"
  cmp "$work/full" "$work/full.back" || fail "the rebuilt copies differ from what was written last"
  grep -q 'connected=1 ' /sys/kernel/farmem/status || fail "a killed daemon is still connected"
  grep -E 'is lost|^rebuild done' "$work/attach.log" | sed 's/^/[kmod_smoke] keeper: /'
  say "verified 64 MiB from the rebuilt copies alone; $(grep -c 'rebuilt on' "$work/attach.log") copies rebuilt in all"
fi
if [[ $mode == restart ]]; then
  # Once the first keeper's last heartbeat is older than the daemons' lease TTL: had nobody
  # renewed the leases, their rkeys would be gone and this would fail (it does with a restarted
  # keeper that presents a fresh client id, as before re-adoption existed).
  while (($(date +%s) < killed_at + ttl_ms / 1000 + 2)); do sleep 0.5; done
  dd if="$work/pattern" of=/dev/farmem0 bs=64K seek=16 oflag=direct status=none ||
    fail "dd write after the lease TTL"
  dd if=/dev/farmem0 of="$work/back1m" bs=1M skip=1 count=8 iflag=direct status=none ||
    fail "dd read after the lease TTL"
  cmp "$work/pattern" "$work/back1m" || fail "reads after the lease TTL differ"
  say "the leases outlived their first keeper: pattern verified $(($(date +%s) - killed_at)) s after the kill"
fi

finish
