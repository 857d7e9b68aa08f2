#!/usr/bin/env bash
# nbd_qd1_profile.sh: where a depth-1 4 KiB random read's time goes (issue 13 item 3,
# docs/benchmarks-nbd.md "QD1 latency"). farmem-nbd --resilience none (256 MiB) on six farmemd
# (tcp, loopback) and `nbdkit memory` (256 MiB), both on Unix sockets; fio randread, iodepth 1,
# nbd engine, each export written whole first. For each server, one job per repetition under
# `perf stat` of the system calls and scheduler events of each process set separately (fio, the
# NBD server, the daemons), printed per request: system calls by kind, context switches,
# wake-ups, and CPU µs (task-clock) per request. Needs root (or perf_event_paranoid <= 0).
#
# With --record DIR, one more farmem job runs under `perf record -g` of farmem-nbd and the daemons
# (DIR/perf.data, DIR/report.txt: self time by symbol, kernel included).
#
#   blockdev/bench/nbd_qd1_profile.sh [--build-dir DIR] [--runtime S] [--reps N] [--rw RW]
#                                     [--nbd-args "EXTRA farmem-nbd ARGS"] [--record DIR]
set -euo pipefail

build=build
runtime=5
reps=2
rw=randread
nbd_args=
record=
while [ $# -gt 0 ]; do
  case $1 in
    --build-dir) build=$2; shift 2 ;;
    --runtime) runtime=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --rw) rw=$2; shift 2 ;;
    --nbd-args) nbd_args=$2; shift 2 ;;
    --record) record=$2; shift 2 ;;
    *) echo "unknown option $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
bin=$build/bin
# shellcheck source=blockdev/bench/bench_lib.sh
source "$(dirname "$0")/bench_lib.sh"
bench_require fio perf nbdkit python3
work=$(mktemp -d)
pids=()
trap 'stop_pids; wait 2>/dev/null || true; rm -rf "$work"' EXIT

peers=''
dpids=()
start_farmemds peers dpids d 6 --capacity 256M --slab-size 64M
# shellcheck disable=SC2086  # nbd_args is a list of words
"$bin/farmem-nbd" --backend farmem --peers "$peers" --secret-file "$work/secret" \
  --resilience none --transport tcp --size 256M --unix "$work/farmem.sock" --log-level warn \
  --no-swap-safe $nbd_args 2>"$work/farmem.log" &
pids+=($!)
nbd_pid=$!
nbdkit --foreground --exit-with-parent --unix "$work/nbdkit.sock" memory 256M &
pids+=($!)
kit_pid=$!
for t in farmem nbdkit; do
  wait_file -S "$work/$t.sock"
  nbd_prefill "$(nbd_uri $t)" 256M
done

events=context-switches,cpu-migrations,task-clock,sched:sched_wakeup
for s in sendmsg sendto recvfrom recvmsg read write poll ppoll epoll_wait epoll_pwait futex \
  setsockopt; do
  events=$events,syscalls:sys_enter_$s
done
summary() {  # summary TARGET REP: per-request table from the three perf files and fio's json
  python3 - "$work" "$1" "$2" <<'EOF'
import json, sys
work, t, rep = sys.argv[1:]
j = json.load(open(f"{work}/{t}.{rep}.json"))["jobs"][0]
side = j["read"] if j["read"]["total_ios"] else j["write"]
n = side["total_ios"]
print(f"{t} rep {rep}: {n} requests, {side['iops']:.0f} IOPS, mean {side['lat_ns']['mean']/1e3:.1f} µs, "
      f"clat p50 {side['clat_ns']['percentile']['50.000000']/1e3:.1f} µs")
for who in ("fio", "server", "daemons"):
    try:
        lines = open(f"{work}/{t}.{rep}.{who}").read().split("\n")
    except FileNotFoundError:
        continue
    c = {}
    for l in lines:
        f = l.split(",")
        if len(f) > 3 and f[0].replace(".", "").isdigit():
            c[f[2].replace("syscalls:sys_enter_", "")] = float(f[0])
    cpu = c.pop("task-clock", 0) * 1e3 / n  # msec -> µs per request
    parts = [f"{k} {v / n:.2f}" for k, v in c.items() if v / n >= 0.01]
    print(f"  {who:8s} CPU {cpu:5.1f} µs/req; per request: " + ", ".join(parts))
EOF
}
for ((rep = 1; rep <= reps; rep++)); do
  for t in nbdkit farmem; do
    if [ $t = farmem ]; then server=$nbd_pid; else server=$kit_pid; fi
    perf stat -x, -e "$events" -p "$server" -o "$work/$t.$rep.server" -- sleep $((runtime + 2)) &
    p1=$!
    p2=
    if [ $t = farmem ]; then
      perf stat -x, -e "$events" -p "$(IFS=,; echo "${dpids[*]}")" -o "$work/$t.$rep.daemons" \
        -- sleep $((runtime + 2)) &
      p2=$!
    fi
    sleep 0.5
    perf stat -x, -e "$events" -o "$work/$t.$rep.fio" -- \
      fio --name=j --ioengine=nbd --uri="$(nbd_uri $t)" --rw="$rw" --bs=4k --iodepth=1 --numjobs=1 \
      --size=256M --time_based --runtime="$runtime" --output-format=json \
      --output="$work/$t.$rep.json" >/dev/null
    wait $p1 ${p2:+$p2}
    summary $t $rep
  done
done
if [ -n "$record" ]; then
  mkdir -p "$record"
  perf record -g -F 20000 -o "$record/perf.data" -p "$nbd_pid,$(IFS=,; echo "${dpids[*]}")" \
    -- sleep $((runtime + 1)) 2>/dev/null &
  p1=$!
  sleep 0.5
  fio --name=j --ioengine=nbd --uri="$(nbd_uri farmem)" --rw="$rw" --bs=4k --iodepth=1 --numjobs=1 \
    --size=256M --time_based --runtime="$runtime" --output-format=json \
    --output="$work/rec.json" >/dev/null
  wait $p1
  perf report -i "$record/perf.data" --no-children --sort comm,dso,sym --stdio 2>/dev/null \
    | grep -v '^$' | head -150 >"$record/report.txt"
  python3 -c "import json,sys; j=json.load(open(sys.argv[1]))['jobs'][0]['read']
print('recorded job:', j['total_ios'], 'requests, mean', round(j['lat_ns']['mean']/1e3,1), 'µs')" "$work/rec.json"
fi
echo "load: $(uptime)"
