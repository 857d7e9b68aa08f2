#!/usr/bin/env bash
# deploy/docker/entrypoint.sh on a real kernel, without Docker: in the qemu guest (ctest label vm),
# two network namespaces on a bridge stand in for two containers on a compose bridge network, and
# the guest's own namespace for host networking (rxe0 on eth0).
#   - In a container namespace the entrypoint creates soft-RoCE on its eth0; if rdma_rxe cannot
#     receive there (no UDP 4791 socket: Debian 12's 6.1) it removes it and farmemd serves TCP, and
#     a client in the other namespace gets its data over tcp; if it can, the client uses verbs.
#   - FARMEM_RDMA=on in such a namespace refuses to start instead.
#   - With host networking farmemd serves RDMA and the client's data moves over verbs.
set -euo pipefail
bin=${FARMEM_BIN_DIR:?}
src=${FARMEM_SOURCE_DIR:?}
entry=$src/deploy/docker/entrypoint.sh
export PATH=$bin:$PATH
fail() { echo "FAIL: $*" >&2; exit 1; }
host_addr=${FARMEM_VM_ADDRS%% *}
[[ -n "$host_addr" && -n "${FARMEM_VM_RXE:-}" ]] || fail "not in the test guest with rxe"

work=$(mktemp -d)
mkdir -p /run/secrets
head -c 32 /dev/urandom | base64 >/run/secrets/farmem_secret
chmod 600 /run/secrets/farmem_secret
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT

ip link add br0 type bridge
ip link set br0 up
for n in a b; do
  ip netns add "$n"
  ip link add "v$n" type veth peer name eth0 netns "$n"
  ip link set "v$n" master br0 up
  ip -n "$n" link set lo up
  ip -n "$n" link set eth0 up
done
ip -n a addr add 192.168.77.1/24 dev eth0
ip -n b addr add 192.168.77.2/24 dev eth0

wait_listening() {  # log file
  for _ in $(seq 200); do grep -q "listening on" "$1" && return 0; sleep 0.2; done
  cat "$1" >&2
  fail "farmemd did not start"
}
demo() {  # where (netns or "") daemon -> the demo's output
  local ns=()
  [[ -n "$1" ]] && ns=(ip netns exec "$1")
  "${ns[@]}" "$entry" farmemctl demo --peers "$2" --secret-file /run/secrets/farmem_secret \
    --size 8M 2>&1 || { echo "demo exit $?"; }
}

echo "== a 'container' on a bridge: entrypoint farmemd in namespace a"
ip netns exec a env FARMEM_CAPACITY=32M FARMEM_SLAB_SIZE=4M "$entry" farmemd >"$work/a.log" 2>&1 &
wait_listening "$work/a.log"
cat "$work/a.log"
grep -q "created soft-RoCE device rxe_[0-9a-f]* on eth0" "$work/a.log" || fail "no rxe made in the namespace"
out=$(demo b 192.168.77.1:7411)
echo "$out"
grep -q "verified: every byte read back is the byte written" <<<"$out" || fail "demo from namespace b failed"
if grep -q "no RoCE socket (UDP 4791)" "$work/a.log"; then
  grep -q -- "--rdma off" "$work/a.log" || fail "fell back but did not run farmemd with --rdma off"
  grep -q "over tcp" <<<"$out" || fail "the daemon serves TCP only, yet the demo did not say tcp"
  rdma link show | grep -q "^link rxe_" && fail "the namespace's rxe device was not removed"
  echo "== this kernel's rxe does not receive in a namespace: TCP, as the README says"
  echo "== FARMEM_RDMA=on in namespace b must refuse"
  if ip netns exec b env FARMEM_RDMA=on "$entry" farmemd >"$work/b.log" 2>&1; then
    fail "FARMEM_RDMA=on started without usable RDMA"
  fi
  grep -q "FARMEM_RDMA=on: giving up" "$work/b.log" || fail "no reason given: $(cat "$work/b.log")"
else
  grep -q "over verbs" <<<"$out" || fail "rxe receives in the namespace, yet the demo did not use verbs"
  echo "== this kernel's rxe is namespace-aware: verbs between 'containers'"
fi

echo "== host networking: entrypoint farmemd in the guest's namespace (rxe0 on eth0)"
FARMEM_CAPACITY=32M FARMEM_SLAB_SIZE=4M FARMEM_ADDR=$host_addr "$entry" farmemd >"$work/h.log" 2>&1 &
wait_listening "$work/h.log"
cat "$work/h.log"
grep -q "RDMA: listening with rdma_cm on $host_addr" "$work/h.log" || fail "no RDMA with host networking"
out=$(demo "" "$host_addr:7411")
echo "$out"
grep -q "verified: every byte read back is the byte written" <<<"$out" || fail "host demo failed"
grep -q "over verbs" <<<"$out" || fail "host networking: the demo did not use verbs"
echo "PASS"
