#!/usr/bin/env bash
# Fault injection through a real NBD client nobody here wrote (fio's nbd engine, libnbd):
# farmem-nbd exports a device kept on real farmemd daemons; fio writes it with crc32c checksums
# while daemons are killed, then reads everything back and verifies it.
#
#   nbd_fault_test.sh BIN_DIR MODE
#     ec         ec:4+2 (its default layout: stripe) over six daemons, two killed mid-run
#     ec-split   the same in the split layout (--resilience ec-split:4+2)
#     replicate  replicate:2 over three daemons, one killed
#     backup     none + --backup over two daemons, all killed
# Exit 0 when fio reports zero verify errors; any error fails.
set -euo pipefail
bin=$1
mode=$2
work=$(mktemp -d /tmp/farmem-nbdfault.XXXXXX)
pids=()
nbd_pid=""
cleanup() {
  [[ -n "$nbd_pid" ]] && kill "$nbd_pid" 2>/dev/null || true
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [[ "${FARMEM_KEEP_TEST_DIRS:-}" == "" ]]; then rm -rf "$work"; fi
}
trap cleanup EXIT

case $mode in
  ec) daemons=6; resilience=ec:4+2; kill_list="1 4"; extra=() ;;
  ec-split) daemons=6; resilience=ec-split:4+2; kill_list="1 4"; extra=() ;;
  replicate) daemons=3; resilience=replicate:2; kill_list="0"; extra=() ;;
  backup) daemons=2; resilience=none; kill_list="0 1"; extra=(--backup "$work/backup.img") ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac

head -c 32 /dev/urandom | base64 >"$work/secret"
chmod 600 "$work/secret"
peers=()
for ((i = 0; i < daemons; i++)); do
  # One client here: it may take all of a daemon's memory (the default share keeps a quarter for
  # others, and farmem-nbd's start-up check would then find 216 of the 256 MiB it needs).
  "$bin/farmemd" --listen 127.0.0.1:0 --port-file "$work/port$i" --capacity 96M --slab-size 2M \
    --max-client-share 1 --secret-file "$work/secret" --log-level warn 2>"$work/farmemd$i.log" &
  pids+=($!)
done
for ((i = 0; i < daemons; i++)); do
  for _ in $(seq 200); do [[ -s "$work/port$i" ]] && break; sleep 0.05; done
  peers+=("127.0.0.1:$(cat "$work/port$i")")
done
peer_list=$(IFS=,; echo "${peers[*]}")

sock="$work/nbd.sock"
"$bin/farmem-nbd" --backend farmem --peers "$peer_list" --secret-file "$work/secret" \
  --resilience "$resilience" --size 128M --unix "$sock" --no-swap-safe "${extra[@]}" \
  --heartbeat-ms 100 --failure-timeout-ms 600 2>"$work/nbd.log" &
nbd_pid=$!
for _ in $(seq 200); do [[ -S "$sock" ]] && break; sleep 0.05; done
[[ -S "$sock" ]] || { echo "farmem-nbd did not start:"; cat "$work/nbd.log"; exit 1; }

# Kill daemons once fio is well into its write phase.
(
  sleep 2
  for i in $kill_list; do
    echo "killing farmemd $i (pid ${pids[$i]})"
    kill -9 "${pids[$i]}"
    sleep 0.5
  done
) &
killer=$!

fio --name=faults --ioengine=nbd --uri="nbd+unix:///?socket=$sock" --rw=randwrite --bs=4k \
  --size=96M --iodepth=16 --verify=crc32c --do_verify=1 --verify_fatal=1 --verify_state_save=0 --numjobs=1 \
  --random_generator=tausworthe64 --output-format=terse --terse-version=3 >"$work/fio.out" 2>&1 || {
  echo "fio failed:"; cat "$work/fio.out"; echo "--- farmem-nbd log:"; tail -40 "$work/nbd.log"; exit 1; }
wait "$killer" || true
# terse v3: field 5 is the job's error, field 6 the KiB read (the verify pass reads everything).
line=$(grep '^3;' "$work/fio.out" | head -1)
err=$(cut -d';' -f5 <<<"$line")
read_kib=$(cut -d';' -f6 <<<"$line")
[[ "$err" == 0 ]] || { echo "fio reported error $err"; cat "$work/fio.out"; exit 1; }
((read_kib >= 96 * 1024)) || { echo "verify pass read only ${read_kib} KiB"; exit 1; }
echo "fio: verify pass read ${read_kib} KiB, no verify errors"
grep -E "degraded|rebuilt|LOST|runs degraded" "$work/nbd.log" | head -5 || true
if grep -q "LOST" "$work/nbd.log"; then echo "data was reported lost"; exit 1; fi
echo "nbd fault test '$mode' passed"
