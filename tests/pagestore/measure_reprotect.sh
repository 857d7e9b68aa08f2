#!/bin/bash
# Time to re-protect, by hand (a measurement, not a test): farmem-nbd --resilience ec-split:2+1 on three
# farmemd daemons, SIZE written with nbdcopy; one daemon SIGKILLed and restarted empty on its port;
# prints how long detection and re-protection took (farmem-nbd's own "whole again" line), then
# SIGKILLs a second daemon and reads everything back: it must be identical. The split layout (the
# page store's extents; the stripe layout, ec:k+r's default, logs no "whole again" line).
#
#   tests/pagestore/measure_reprotect.sh BUILD_DIR [SIZE=256M] [SLAB=64M] [RESILIENCE=ec-split:2+1]
#
# Needs nbdcopy (libnbd-bin) and bc. Uses loopback ports 17411-17413.
set -euo pipefail
BIN=$(cd "${1:?usage: $0 BUILD_DIR [SIZE] [SLAB] [RESILIENCE]}" && pwd)/bin
SIZE=${2:-256M}
SLAB=${3:-64M}
RES=${4:-ec-split:2+1}
DIR=$(mktemp -d /tmp/farmem-reprotect-XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$DIR"
}
trap cleanup EXIT
cd "$DIR"
printf 'measure-reprotect-secret-0123456789' > secret
chmod 600 secret
declare -A DPID
start() {  # start daemon $1 on port 17410+$1 and wait until it listens
  rm -f "port$1"
  # (in a subshell: not a job of this shell, so killing it prints nothing)
  ("$BIN/farmemd" --listen "127.0.0.1:$((17410 + $1))" --port-file "port$1" --capacity 512M \
    --slab-size "$SLAB" --secret-file secret --log-level warn >> "farmemd-$1.log" 2>&1 &
    echo $! > "pid$1")
  DPID[$1]=$(cat "pid$1")
  PIDS+=("${DPID[$1]}")
  until [ -s "port$1" ]; do sleep 0.05; done
}
wait_log() { until grep -q "$1" nbd.log; do sleep 0.05; done; }
now() { date +%s.%N; }

for i in 1 2 3; do start "$i"; done
("$BIN/farmem-nbd" --backend farmem --peers 127.0.0.1:17411,127.0.0.1:17412,127.0.0.1:17413 \
  --secret-file secret --resilience "$RES" --size "$SIZE" --unix "$DIR/nbd.sock" --no-swap-safe \
  > nbd.log 2>&1 & echo $! > pid-nbd)
PIDS+=("$(cat pid-nbd)")
until [ -S nbd.sock ]; do sleep 0.05; done
URI="nbd+unix:///?socket=$DIR/nbd.sock"
head -c "$SIZE" /dev/urandom > data.img
nbdcopy data.img "$URI"

kill -9 "${DPID[3]}"
t_kill=$(now)
wait_log "is down"
t_down=$(now)
start 3
t_up=$(now)
wait_log "whole again"
t_whole=$(now)
echo "SIGKILL to declared down: $(echo "$t_down - $t_kill" | bc) s"
echo "daemon listening again to whole again: $(echo "$t_whole - $t_up" | bc) s"
grep "whole again" nbd.log | sed 's/^.*page store: //'

kill -9 "${DPID[1]}"
nbdcopy "$URI" back.img
cmp data.img back.img && echo "after a second SIGKILL: all $SIZE read back identical"
