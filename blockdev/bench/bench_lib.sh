# shellcheck shell=bash
# shellcheck disable=SC2154  # bin and work are the caller's (see below)
# bench_lib.sh: what the NBD benchmark scripts share (sourced, not run): checking what a run
# needs, stopping what it started, waiting for a daemon's file, the cluster secret, a set of
# farmemd daemons on loopback with their ports collected, and a process set's CPU time. One place
# for each, so nbd_bench.sh, nbd_subpage_bench.sh, nbd_fill_bench.sh and nbd_crypto_profile.sh
# start and stop their daemons the same way.
#
# The caller defines before using it:
#   bin    the directory with farmemd (e.g. build/bin)
#   work   the run's scratch directory (port files, logs, the secret)
#   pids   an array: every process started here is appended, for the caller's cleanup trap

# bench_require TOOL...: exit with a message unless every TOOL is on PATH and farmem-nbd and
# farmemd are built in $bin.
bench_require() {
  local tool b
  for tool in "$@"; do
    command -v "$tool" >/dev/null || { echo "$tool not found" >&2; exit 1; }
  done
  for b in farmem-nbd farmemd; do
    [ -x "$bin/$b" ] || { echo "$bin/$b not built (cmake --build ${bin%/bin} --target $b)" >&2; exit 1; }
  done
}

# stop_pids: kill every process in pids and wait for it to end (for the caller's EXIT trap).
stop_pids() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
}

# bench_cleanup [RC]: the caller's EXIT trap (`trap bench_cleanup EXIT`; a trap function of the
# caller's own passes the run's exit status, `local rc=$?` first): stops what was started and
# removes $work. A run that ends with an error (a failed fio job, a
# server that did not start) keeps the logs of every server and daemon first, in a directory it
# names on stderr: a failure seen once is otherwise gone with its scratch directory.
bench_cleanup() {
  local rc=${1:-$?} kept
  stop_pids
  if [ "$rc" -ne 0 ] && compgen -G "$work/*.log" >/dev/null; then
    kept=$(mktemp -d /tmp/nbd-bench-failed.XXXXXX)
    cp "$work"/*.log "$kept"/
    echo "the run failed (exit $rc): the servers' and daemons' logs are kept in $kept" >&2
  fi
  rm -rf "$work"
}

# wait_file -S|-s PATH: wait (up to 30 s) until PATH is a socket (-S) or a non-empty file (-s).
wait_file() {
  for _ in $(seq 600); do test "$1" "$2" && return 0; sleep 0.05; done
  echo "timed out waiting for $2" >&2
  exit 1
}

# bench_secret: $work/secret (32 random bytes, base64, mode 600), made once per run.
bench_secret() {
  [ -f "$work/secret" ] && return 0
  head -c 32 /dev/urandom | base64 >"$work/secret"
  chmod 600 "$work/secret"
}

# start_farmemds PEERS_VAR PIDS_VAR TAG COUNT [farmemd args...]: start COUNT farmemd on loopback
# (tcp, --rdma off, the run's secret, --log-level warn, a port file and a log $work/TAG<i>.port
# and .log), wait until each listens, and set PEERS_VAR to "127.0.0.1:P0,127.0.0.1:P1,..." and
# append their pids to the array PIDS_VAR (and to pids). In the extra arguments `{i}` is replaced
# by the daemon's index, e.g. --metrics-port-file "$work/m{i}.port".
start_farmemds() {
  local -n peers_out=$1 dpids_out=$2
  local tag=$3 count=$4 i
  shift 4
  bench_secret
  for ((i = 0; i < count; i++)); do
    "$bin/farmemd" --listen 127.0.0.1:0 --port-file "$work/$tag$i.port" --rdma off \
      --secret-file "$work/secret" --log-level warn "${@//\{i\}/$i}" 2>"$work/$tag$i.log" &
    pids+=($!)
    dpids_out+=($!)
  done
  peers_out=""
  for ((i = 0; i < count; i++)); do
    wait_file -s "$work/$tag$i.port"
    peers_out="$peers_out${peers_out:+,}127.0.0.1:$(cat "$work/$tag$i.port")"
  done
}

# cpu_ns PID...: CPU time (user + system) the processes have used so far, summed, in ns, with
# every thread counted, those that exited included (a server's per-connection thread ends with the
# fio job that it served): read through each process's CPU clock (clock_gettime on
# clock_getcpuclockid's id, ns resolution). Where the kernel refuses that clock it falls back to
# /proc/PID/stat utime + stime (clock ticks, 10 ms: coarse for a few-second job) and prints the
# sum followed by " ticks" so that the caller can say so.
#
# It runs the interpreter python3 resolves to directly: a version manager's shim in front of it
# (pyenv's is a bash script) took seconds per call on the loaded machine, twice per job.
# Without python3 it stays "python3": bench_require then names what is missing.
bench_python=$(python3 -c 'import sys; print(sys.executable)' 2>/dev/null || echo python3)
cpu_ns() {
  "$bench_python" -c '
import os, sys, time
total, ticks = 0, False
hz = os.sysconf("SC_CLK_TCK")
for pid in map(int, sys.argv[1:]):
    try:
        total += time.clock_gettime_ns(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, SCHED)
    except OSError:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        total += (int(f[11]) + int(f[12])) * 10**9 // hz
        ticks = True
print(total, "ticks" if ticks else "")' "$@"
}
# nbd_uri NAME: fio's nbd engine URI of the NBD server listening on $work/NAME.sock.
nbd_uri() { echo "nbd+unix:///?socket=$work/$1.sock"; }
# nbd_prefill URI SIZE: writes the export whole once (1 MiB writes, depth 8), so that the jobs
# after it read pages that were written.
nbd_prefill() {
  fio --name=prefill --ioengine=nbd --uri="$1" --rw=write --bs=1m --iodepth=8 --size="$2" \
    >/dev/null
}
# page_faults PID...: minor + major page faults of those processes so far (/proc/PID/stat fields
# 10 and 12), every thread included: memory touched for the first time on the data path shows here.
page_faults() {
  local pid fields total=0
  for pid in "$@"; do
    read -r -a fields <<<"$(cut -d')' -f2- "/proc/$pid/stat")"
    # after "pid (comm)": state is fields[0], minflt fields[7], majflt fields[9]
    total=$((total + fields[7] + fields[9]))
  done
  echo "$total"
}
