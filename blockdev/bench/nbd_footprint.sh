#!/usr/bin/env bash
# nbd_footprint.sh: the memory farmem-nbd locks when it serves swap (issue 13 item 6). A swap-safe
# farmem-nbd (--swap-safe: mlockall(MCL_CURRENT|MCL_FUTURE)) takes that memory from exactly the
# host that is short of it, so it is a figure to keep small. Prints, for one farmem-nbd
# --backend farmem on six loopback farmemd daemons (tcp, 64 MiB slabs):
#
#   idle          locked memory (resident pages of the locked mappings, smaps), VmLck and VmRSS
#                 (/proc/PID/status) once the export is served, no client
#   N conns       locked memory with N clients connected and idle (qemu-io sessions kept open), and the
#                 increase per connection over idle, for each N of --connections
#   after I/O     locked memory once fio's jobs (below) have ended and their connections closed
#   fio           IOPS of 4 KiB randread and randwrite, depth 16, one connection, --runtime s each,
#                 and the most locked memory seen (polled every 0.1 s) while each job ran
#
# With --detail it also lists the locked mappings of the idle, the 1-connection and the after-I/O
# process by size (/proc/PID/smaps): thread stacks, malloc's heap, the write cache, buffers, and
# the program's and its libraries' files.
#
#   blockdev/bench/nbd_footprint.sh [--build-dir DIR] [--nbd-bin PATH] [--resilience R]
#                                   [--size SIZE] [--connections "1 2 4"] [--runtime SECONDS]
#                                   [--detail] [--no-io] [-- farmem-nbd args...]
#
# Defaults: build dir ./build, farmem-nbd from it (--nbd-bin: another binary, e.g. a build of an
# older commit, for before/after), --resilience none, a 1G export, connections "1 2 4", 5 s per
# fio job. The export is written whole (1 MiB writes) before the fio jobs. Needs fio and qemu-io;
# mlockall needs CAP_IPC_LOCK or a large RLIMIT_MEMLOCK (else nothing is locked and a warning says
# so). --no-io stops after the connections (no export write, no fio: the idle and per-connection
# figures only, which is what a slow guest can afford). Arguments after -- go to farmem-nbd as
# they are, e.g. `-- --ec-layout stripe` or `-- --write-cache-pages 256`. With --ec-layout stripe
# the idle figure includes the page table, 16 bytes per export page allocated at start (4 MiB per
# GiB): a line says how much of it that is, since it grows with --size and the rest does not.
set -euo pipefail

build=build
nbd_bin=
resilience=none
size=1G
connections="1 2 4"
runtime=5
detail=0
io=1
nbd_args=()
while [ $# -gt 0 ]; do
  case $1 in
    --build-dir) build=$2; shift 2 ;;
    --nbd-bin) nbd_bin=$2; shift 2 ;;
    --resilience) resilience=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --connections) connections=$2; shift 2 ;;
    --runtime) runtime=$2; shift 2 ;;
    --detail) detail=1; shift ;;
    --no-io) io=0; shift ;;
    --) shift; nbd_args=("$@"); break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
done
bin=$build/bin
[ -n "$nbd_bin" ] || nbd_bin=$bin/farmem-nbd
# bench_require, stop_pids, wait_file, start_farmemds
# shellcheck source=blockdev/bench/bench_lib.sh
source "$(dirname "$0")/bench_lib.sh"
bench_require fio qemu-io

work=$(mktemp -d /tmp/nbd-footprint.XXXXXX)
pids=()
cleanup() {
  stop_pids
  rm -rf "$work"
}
trap cleanup EXIT

# status_kib PID KEY: a field of /proc/PID/status in KiB (VmLck, VmRSS).
status_kib() { awk -v k="$2:" '$1 == k {print $2}' "/proc/$1/status"; }
mib() { awk -v k="$1" 'BEGIN {printf "%.1f", k / 1024}'; }
# locked_kib PID: memory locked in RAM, in KiB: the resident pages of the locked mappings (smaps
# "Rss:" where "Locked:" is not 0). Not VmLck: that counts the whole size of every locked mapping,
# and the shared libraries' are locked page by page as they are used (MCL_ONFAULT), so most of
# their size is neither resident nor locked.
locked_kib() {
  awk '$1 == "Rss:" {rss = $2} $1 == "Locked:" && $2 > 0 {t += rss} END {print t + 0}' \
    "/proc/$1/smaps"
}
# conn_threads PID: farmem-nbd's connection threads (one per client, named nbd-conn).
conn_threads() { grep -lx nbd-conn /proc/"$1"/task/*/comm 2>/dev/null | wc -l; }
# wait_conns PID N: wait (up to 30 s) until farmem-nbd serves exactly N connections.
wait_conns() {
  for _ in $(seq 600); do [ "$(conn_threads "$1")" = "$2" ] && return 0; sleep 0.05; done
  echo "timed out waiting for $2 connections (have $(conn_threads "$1"))" >&2
  exit 1
}
# locked_mappings PID: resident memory of the locked mappings (smaps "Rss:" where "Locked:" is
# not 0; "Locked:" itself is a proportional share, small for libraries other processes map too),
# each file's mappings summed, largest first, then the totals.
locked_mappings() {
  awk '/^[0-9a-f]+-[0-9a-f]+ / {name = ($6 == "" ? "[anon] " $1 : $6); file = ($6 ~ /^\//)}
       $1 == "Rss:" {rss = $2}
       $1 == "Locked:" && $2 > 0 {by[name] += rss; if (file) f += rss; else a += rss}
       END {for (n in by) printf "    %8d KiB  %s\n", by[n], n | "sort -k1,1nr | head -20"
            close("sort -k1,1nr | head -20")
            printf "    total: %.1f MiB anonymous (stacks, heap, buffers), %.1f MiB file-backed" \
                   " (the program and its libraries)\n", a / 1024, f / 1024}' "/proc/$1/smaps"
}

# shellcheck disable=SC2034  # filled by start_farmemds (a nameref)
daemon_pids=()
peers=''
start_farmemds peers daemon_pids d 6 --capacity 1024M --slab-size 64M
sock=$work/nbd.sock
"$nbd_bin" --backend farmem --peers "$peers" --secret-file "$work/secret" \
  --resilience "$resilience" --transport tcp --size "$size" --unix "$sock" --swap-safe \
  --log-level warn "${nbd_args[@]}" 2>"$work/nbd.log" &
nbd=$!
pids+=("$nbd")
wait_file -S "$sock"
if grep -q "swap-safe: mlockall" "$work/nbd.log"; then
  echo "warning: farmem-nbd could not lock its memory: $(grep -m1 mlockall "$work/nbd.log")" >&2
fi
uri="nbd+unix:///?socket=$sock"

echo "farmem-nbd $("$nbd_bin" --version 2>&1 | head -1), --resilience $resilience, export $size," \
  "args: ${nbd_args[*]:-(none)}; $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)," \
  "$(date -u +%H:%M) UTC"
idle=$(locked_kib $nbd)
echo "idle: locked $(mib "$idle") MiB, VmLck $(mib "$(status_kib $nbd VmLck)") MiB," \
  "VmRSS $(mib "$(status_kib $nbd VmRSS)") MiB," \
  "threads $(status_kib $nbd Threads)"
case " ${nbd_args[*]} " in
  *" --ec-layout stripe "*)
    size_bytes=$(numfmt --from=iec "$size")
    echo "  of which the stripe layout's page table (16 B per page, allocated at start):" \
      "$(awk -v b="$size_bytes" 'BEGIN {printf "%.1f", b / 4096 * 16 / 1048576}') MiB" ;;
esac
if [ $detail = 1 ]; then
  echo "  locked mappings at idle:"
  locked_mappings $nbd
fi

# Each client: a qemu-io session reading commands from a fifo held open by this shell, so the
# connection stays open and idle until the fifo is closed. One 4 KiB read each first: its answer
# means the connection is past the handshake, with its buffers.
for n in $connections; do
  fds=()
  for ((c = 0; c < n; c++)); do
    mkfifo "$work/q$c"
    qemu-io -f raw "$uri" <"$work/q$c" >"$work/q$c.out" 2>&1 &
    pids+=($!)
    exec {fd}>"$work/q$c"
    fds+=("$fd")
    echo "read 0 4096" >&"$fd"
  done
  for ((c = 0; c < n; c++)); do
    for _ in $(seq 600); do grep -q "read 4096/4096" "$work/q$c.out" && break; sleep 0.05; done
    grep -q "read 4096/4096" "$work/q$c.out" || { echo "client $c: $(cat "$work/q$c.out")" >&2; exit 1; }
  done
  wait_conns $nbd "$n"
  lck=$(locked_kib $nbd)
  echo "$n conns: locked $(mib "$lck") MiB, +$(mib $(((lck - idle) / n))) MiB per connection"
  if [ $detail = 1 ] && [ "$n" = 1 ]; then
    echo "  locked mappings with 1 connection:"
    locked_mappings $nbd
  fi
  for fd in "${fds[@]}"; do exec {fd}>&-; done
  rm -f "$work"/q*
  wait_conns $nbd 0
done

[ $io = 1 ] || exit 0
nbd_prefill "$uri" "$size"
for rw in randread randwrite; do
  fio --name="$rw" --ioengine=nbd --uri="$uri" --rw=$rw --bs=4k --iodepth=16 --numjobs=1 \
    --size="$size" --time_based --runtime="$runtime" --output-format=json \
    --output="$work/$rw.json" >/dev/null &
  job=$!
  peak=0
  while kill -0 $job 2>/dev/null; do
    v=$(locked_kib $nbd)
    [ "$v" -gt "$peak" ] && peak=$v
    sleep 0.1  # the subject here is time: a sample of locked memory every 0.1 s while the job runs
  done
  wait $job
  iops=$(python3 -c 'import json,sys; j=json.load(open(sys.argv[1]))["jobs"][0]; \
print(round(j["read"]["iops"] + j["write"]["iops"]))' "$work/$rw.json")
  echo "fio $rw 4k qd16 ${runtime}s: $iops IOPS, peak locked $(mib "$peak") MiB"
done
wait_conns $nbd 0
echo "after I/O: locked $(mib "$(locked_kib $nbd)") MiB, VmLck $(mib "$(status_kib $nbd VmLck)") MiB," \
  "VmRSS $(mib "$(status_kib $nbd VmRSS)") MiB"
if [ $detail = 1 ]; then
  echo "  locked mappings after I/O:"
  locked_mappings $nbd
fi
