#!/bin/bash
# Guest side of the rxe_smoke vm test (runs inside deploy/vm/run, needs --addrs 1):
# soft-RoCE is there and carries traffic, both with perftest's own TCP exchange and through rdma_cm.
#   deploy/vm/run --addrs 1 -- bash tests/vm/rxe_smoke.sh
set -euo pipefail
say() { echo "[rxe_smoke] $*"; }
fail() { echo "[rxe_smoke] FAIL: $*"; exit 1; }
[[ ${FARMEM_VM:-} == 1 ]] || fail "run me inside the guest: deploy/vm/run --addrs 1 -- bash $0"
read -r -a addrs <<<"${FARMEM_VM_ADDRS:-10.0.2.15}"
a0=${addrs[0]}
a1=${addrs[1]:-$a0}
T=60  # per step; a whole step takes seconds

wait_tcp_listen() {  # port: perftest's out-of-band exchange socket
  for _ in $(seq 200); do
    ss -Hltn "sport = :$1" | grep -q . && return 0
    sleep 0.05
  done
  return 1
}

step() { echo; say "== $*"; }
start=$(date +%s.%N)

step "ibv_devices lists rxe0"
ibv_devices | tee /tmp/devs
grep -qw rxe0 /tmp/devs || fail "rxe0 not in ibv_devices"
ibv_devinfo -d rxe0 | grep -q PORT_ACTIVE || fail "rxe0 port not ACTIVE"

step "ib_read_lat 4 KiB RDMA READ over $a0 (GID index 1, RoCE v2)"
timeout $T ib_read_lat -d rxe0 -x 1 -s 4096 -n 200 -F >/tmp/srv.log 2>&1 &
srv=$!
wait_tcp_listen 18515 || { cat /tmp/srv.log; fail "ib_read_lat server did not listen"; }
timeout $T ib_read_lat -d rxe0 -x 1 -s 4096 -n 200 -F "$a0" || fail "ib_read_lat client"
wait $srv || { cat /tmp/srv.log; fail "ib_read_lat server"; }

step "ib_write_bw 64 KiB RDMA WRITE over $a0"
timeout $T ib_write_bw -d rxe0 -x 1 -s 65536 -n 200 -F >/tmp/srv.log 2>&1 &
srv=$!
wait_tcp_listen 18515 || { cat /tmp/srv.log; fail "ib_write_bw server did not listen"; }
timeout $T ib_write_bw -d rxe0 -x 1 -s 65536 -n 200 -F "$a0" || fail "ib_write_bw client"
wait $srv || { cat /tmp/srv.log; fail "ib_write_bw server"; }

# rdma_cm has no socket to wait for: the client is retried until the listener is up. A server that
# exited meanwhile is started again: perftest's client can crash half-way through a connect made
# too early (seen: ib_read_lat -R segfaulted, and its server then rejected every later attempt).
cm_pair() {  # NAME "SERVER COMMAND" "CLIENT COMMAND" (split on spaces)
  local name=$1 server=$2 client=$3 srv ok=0
  for _ in $(seq 5); do
    timeout $T $server >/tmp/srv.log 2>&1 &
    srv=$!
    for _ in $(seq 50); do
      kill -0 "$srv" 2>/dev/null || break
      if timeout $T $client >/tmp/cli.log 2>&1; then ok=1; break; fi
      sleep 0.1
    done
    if ((ok)); then
      tail -n 4 /tmp/cli.log
      wait "$srv" || { cat /tmp/srv.log; fail "$name server"; }
      return 0
    fi
    say "$name: no connection with this server; starting it again"
    kill "$srv" 2>/dev/null || true
    wait "$srv" 2>/dev/null || true
  done
  cat /tmp/cli.log /tmp/srv.log
  fail "$name client"
}

step "rping through rdma_cm to $a0"
cm_pair rping "rping -s -a $a0 -C 10" "rping -c -a $a0 -C 10 -S 64 -v"

step "ib_read_lat -R (rdma_cm) to the second address $a1"
cm_pair "ib_read_lat -R" "ib_read_lat -d rxe0 -R -s 4096 -n 200 -F" \
  "ib_read_lat -d rxe0 -R -s 4096 -n 200 -F $a1"

echo
say "PASS in $(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"
