#!/bin/bash
# Guest side of the nbd_swap_smoke vm test: the kernel NBD client with swap on it works, and a
# process held to 64 MiB by cgroup v2 gets its 256 MiB working set back intact through the export.
#   deploy/vm/run -- bash tests/vm/nbd_swap_smoke.sh <path of swap_workload>
#
# Environment (all optional): NBD_SWAP_EXPORT_SIZE (512M), NBD_SWAP_LIMIT (64M),
# NBD_SWAP_WORKSET_MIB (256), NBD_SWAP_PASSES (2), NBD_SWAP_WORKLOAD_ARGS (more swap_workload
# options, e.g. -r to rewrite every page on each pass). To swap onto another NBD server, set
# NBD_SWAP_SERVER_CMD to a command that serves an export on the unix socket $NBD_SOCK and returns
# once it is listening (default: nbdkit memory).
set -euo pipefail
say() { echo "[nbd_swap_smoke] $*"; }
fail() { echo "[nbd_swap_smoke] FAIL: $*"; exit 1; }
[[ ${FARMEM_VM:-} == 1 ]] || fail "run me inside the guest: deploy/vm/run -- bash $0 <swap_workload>"
workload=${1:?usage: nbd_swap_smoke.sh <path of swap_workload>}
[[ -x $workload ]] || fail "$workload is not an executable"
size=${NBD_SWAP_EXPORT_SIZE:-512M}
limit=${NBD_SWAP_LIMIT:-64M}
mib=${NBD_SWAP_WORKSET_MIB:-256}
passes=${NBD_SWAP_PASSES:-2}
read -r -a wl_args <<<"${NBD_SWAP_WORKLOAD_ARGS:-}"
export NBD_SOCK=${NBD_SOCK:-/tmp/nbd.sock}
dev=/dev/nbd0
cg=/sys/fs/cgroup/nbd_swap_smoke
start=$(date +%s.%N)

vmstat() { awk -v k="$1" '$1 == k { print $2 }' /proc/vmstat; }

say "export: ${NBD_SWAP_SERVER_CMD:-nbdkit memory $size} on $NBD_SOCK"
if [[ -n ${NBD_SWAP_SERVER_CMD:-} ]]; then
  bash -c "$NBD_SWAP_SERVER_CMD"
else
  # --swap: nbdkit must not itself be swapped out (it serves the swap device).
  nbdkit -U "$NBD_SOCK" -P /tmp/nbdkit.pid --swap memory "$size"
fi
for _ in $(seq 200); do [[ -S $NBD_SOCK ]] && break; sleep 0.05; done
[[ -S $NBD_SOCK ]] || fail "no NBD socket at $NBD_SOCK"

say "nbd-client -unix $NBD_SOCK $dev -b 4096 -swap -N ''"
nbd-client -unix "$NBD_SOCK" "$dev" -b 4096 -swap -N "" || fail "nbd-client"
say "$dev: $(blockdev --getsize64 $dev) bytes"
mkswap "$dev" >/dev/null || fail "mkswap"
swapon "$dev" || fail "swapon"
grep -q "^$dev " /proc/swaps || fail "$dev not in /proc/swaps"
cat /proc/swaps

out0=$(vmstat pswpout) in0=$(vmstat pswpin)
mkdir -p "$cg"
echo "$limit" >"$cg/memory.max"
echo max >"$cg/memory.swap.max" 2>/dev/null || true
say "running $workload -m $mib -p $passes ${wl_args[*]} with memory.max=$limit"
rc=0
bash -c 'echo $$ >"$1/cgroup.procs" && shift && exec "$@"' _ "$cg" "$workload" -m "$mib" -p "$passes" \
  "${wl_args[@]}" || rc=$?
out=$(( $(vmstat pswpout) - out0 )) in=$(( $(vmstat pswpin) - in0 ))
say "pswpout +$out pages, pswpin +$in pages; memory.events: $(tr '\n' ' ' <"$cg/memory.events")"
cat /proc/swaps
((rc == 0)) || fail "swap_workload exited with $rc"

# 256 MiB through a 64 MiB limit: at least the difference must have gone out and come back in.
min=$(( (mib * 256) / 2 ))  # pages: half the working set, well below the ~(mib-64)*256 expected
((out >= min)) || fail "pswpout grew by only $out pages (want >= $min)"
((in >= min)) || fail "pswpin grew by only $in pages (want >= $min)"

swapoff "$dev" || fail "swapoff"
nbd-client -d "$dev" >/dev/null || fail "nbd-client -d"
[[ -f /tmp/nbdkit.pid ]] && kill "$(cat /tmp/nbdkit.pid)" 2>/dev/null
rmdir "$cg" 2>/dev/null || true
say "PASS in $(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"
