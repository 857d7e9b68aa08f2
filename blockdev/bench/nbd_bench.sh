#!/usr/bin/env bash
# nbd_bench.sh: farmem-nbd against the other ways to get a swap-like block device, in ONE run, with
# fio: 4 KiB random reads and writes at queue depth 1 and 16, one connection / one job each.
#
#   target        what                                                        how fio reaches it
#   nbdkit-mem    `nbdkit memory`: the local-RAM ceiling of an NBD server       nbd engine, Unix socket
#   nbdkit-nbd    `nbdkit nbd` forwarding over loopback TCP to an `nbdkit        nbd engine, Unix socket
#                 memory` on another port (remote memory behind NBD today)
#   farmem-mem    farmem-nbd --backend memory (the NBD server path alone)       nbd engine, Unix socket
#   farmem-none   farmem-nbd --backend farmem --resilience none                 nbd engine, Unix socket
#   farmem-ec     farmem-nbd --backend farmem --resilience ec:4+2               nbd engine, Unix socket
#   disk          a file on the local disk, O_DIRECT, libaio (what swap on a    fio's own engine
#                 local disk does: direct block I/O, no page cache)
#   farmem-mem-metrics, farmem-none-metrics: farmem-mem / farmem-none with --metrics-listen on
#                 loopback, scraped every second while fio runs (the cost of the metrics; not in
#                 the default targets)
#   farmem-none-prefaulted: farmem-none on six daemons of its own run with --populate-at-start
#                 (every slab populated at start, as farmemd did before memory on demand): the
#                 cost of memory on demand to steady-state I/O is farmem-none vs this; not in the
#                 default targets
#   farmem-none-plain, farmem-ec-plain: farmem-none / farmem-ec with --no-encrypt (pages stored in
#                 plaintext): the cost of page encryption (docs/security.md) is farmem-none vs
#                 farmem-none-plain; not in the default targets. With any of them the run also
#                 prints `openssl speed` for AES-256-GCM on 4 KiB blocks, one core (the raw cost of
#                 sealing a page) as the baseline.
#
# farmem-none and farmem-ec share six farmemd daemons on loopback (tcp transport, 64 MiB slabs).
# Prints IOPS, mean and p99 latency (submission to completion, fio lat_ns) per target, the ratios
# the issue asks about, and whether its targets hold (farmem-none depth 16 >= 3x nbdkit-nbd and
# >= 0.6x nbdkit-mem; farmem-ec within 1.5x of farmem-none).
#
#   blockdev/bench/nbd_bench.sh [--build-dir DIR] [--runtime SECONDS] [--repeat N] [--size SIZE]
#                               [--targets "a b ..."] [--disk-dir DIR] [--swap-safe]
#                               [--json-dir DIR] [--cpu]
#
# --cpu: also the server's CPU time per request (utime + stime of the server process — nbdkit,
# farmem-nbd; not the farmemd daemons — over each job, from /proc/PID/stat, divided by the
# requests fio completed), which a loaded machine distorts far less than IOPS and latency: the
# cost of what runs on the server's request path, e.g. page encryption (farmem-none vs
# farmem-none-plain). It drops the ramp (--ramp_time 0) so that every request of the job is
# counted; the exports are written whole beforehand either way.
#
# Defaults: build dir ./build, 10 s per job (after 2 s ramp), 3 repetitions, 1G export/file, all
# targets, the disk file in ./build (it must be a real disk, not tmpfs: O_DIRECT), swap-safe off
# (nbdkit without --swap, farmem-nbd --no-swap-safe; --swap-safe turns it on for both). All servers
# run side by side; each workload runs on every target back to back, the order rotated every
# repetition so that load drifting during the run (shared machine) hits all alike. The table shows
# the median over repetitions and every repetition's IOPS. Each export/file is written whole before
# the jobs, so reads hit allocated memory / blocks everywhere (nbdkit's memory plugin is sparse,
# farmem maps remote slabs on first write).
set -euo pipefail

build=build
runtime=10
repeat=3
size=1G
swap_safe=0
json_dir=
cpu=0
targets="nbdkit-mem nbdkit-nbd farmem-mem farmem-none farmem-ec disk"
disk_dir=
while [ $# -gt 0 ]; do
  case $1 in
    --build-dir) build=$2; shift 2 ;;
    --runtime) runtime=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --targets) targets=$2; shift 2 ;;
    --disk-dir) disk_dir=$2; shift 2 ;;
    --swap-safe) swap_safe=1; shift ;;
    --json-dir) json_dir=$2; shift 2 ;;
    --cpu) cpu=1; shift ;;
    -h|--help) sed -n '2,51p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
done
[ -n "$disk_dir" ] || disk_dir=$build
bin=$build/bin
for tool in fio nbdkit python3; do
  command -v $tool >/dev/null || { echo "$tool not found" >&2; exit 1; }
done
for b in farmem-nbd farmemd; do
  [ -x "$bin/$b" ] || { echo "$bin/$b not built (cmake --build $build --target $b)" >&2; exit 1; }
done

work=$(mktemp -d /tmp/nbd-bench.XXXXXX)
[ -n "$json_dir" ] || json_dir=$work
mkdir -p "$json_dir"
disk_file=$disk_dir/nbd-bench-disk.$$.img
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
  rm -f "$disk_file"
}
trap cleanup EXIT

wait_file() {  # -S or -s, path
  for _ in $(seq 600); do [ "$1" "$2" ] && return 0; sleep 0.05; done
  echo "timed out waiting for $2" >&2
  exit 1
}
has() { case " $targets " in *" $1 "*) return 0 ;; esac; return 1; }
declare -A server_pid  # target -> the process serving it (--cpu)
# utime + stime of a process and all its threads, dead ones included, in clock ticks.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

nbdkit_extra=()
farmem_extra=(--no-swap-safe)
if [ $swap_safe = 1 ]; then nbdkit_extra=(--swap); farmem_extra=(); fi

# ---- servers ----------------------------------------------------------------------------------------
if has nbdkit-mem; then
  nbdkit --foreground --unix "$work/nbdkit-mem.sock" "${nbdkit_extra[@]}" memory "$size" \
    2>"$work/nbdkit-mem.log" &
  pids+=($!)
  server_pid[nbdkit-mem]=$!
fi
if has nbdkit-nbd; then
  port=$((20000 + $$ % 20000))
  nbdkit --foreground --port "$port" --ipaddr 127.0.0.1 "${nbdkit_extra[@]}" memory "$size" \
    2>"$work/nbdkit-remote.log" &
  pids+=($!)
  for _ in $(seq 200); do (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.05; done
  nbdkit --foreground --unix "$work/nbdkit-nbd.sock" "${nbdkit_extra[@]}" nbd hostname=127.0.0.1 \
    port="$port" 2>"$work/nbdkit-nbd.log" &
  pids+=($!)
  server_pid[nbdkit-nbd]=$!
fi
scrape_ports=()
for t in farmem-mem farmem-mem-metrics; do
  has $t || continue
  metrics=()
  if [ $t = farmem-mem-metrics ]; then
    metrics=(--metrics-listen 127.0.0.1:0 --metrics-port-file "$work/$t.mport")
    scrape_ports+=("$work/$t.mport")
  fi
  "$bin/farmem-nbd" --backend memory --size "$size" --unix "$work/$t.sock" \
    --log-level warn "${farmem_extra[@]}" "${metrics[@]}" 2>"$work/$t.log" &
  pids+=($!)
  server_pid[$t]=$!
done
if has farmem-none || has farmem-ec || has farmem-none-metrics || has farmem-none-plain ||
  has farmem-ec-plain; then
  head -c 32 /dev/urandom | base64 >"$work/secret"
  chmod 600 "$work/secret"
  peers=""
  for i in 0 1 2 3 4 5; do
    # Room for both exports: none (1x) and ec:4+2 (1.5x) over six daemons, with placement slack.
    "$bin/farmemd" --listen 127.0.0.1:0 --port-file "$work/port$i" --capacity 768M --slab-size 64M \
      --rdma off --secret-file "$work/secret" --log-level warn 2>"$work/farmemd$i.log" &
    pids+=($!)
  done
  for i in 0 1 2 3 4 5; do
    wait_file -s "$work/port$i"
    peers="$peers${peers:+,}127.0.0.1:$(cat "$work/port$i")"
  done
  for res in none ec:4+2 none-metrics none-plain ec:4+2-plain; do
    t=farmem-${res%%:*}
    [ "$res" = none-metrics ] && t=farmem-none-metrics
    [ "$res" = none-plain ] && t=farmem-none-plain
    [ "$res" = ec:4+2-plain ] && t=farmem-ec-plain
    has "$t" || continue
    metrics=()
    if [ "$res" = none-metrics ]; then
      metrics=(--metrics-listen 127.0.0.1:0 --metrics-port-file "$work/$t.mport")
      scrape_ports+=("$work/$t.mport")
    fi
    crypt=()
    case $res in *-plain) crypt=(--no-encrypt) ;; esac
    r=${res%-metrics}
    "$bin/farmem-nbd" --backend farmem --peers "$peers" --secret-file "$work/secret" \
      --resilience "${r%-plain}" --transport tcp --size "$size" --unix "$work/$t.sock" \
      --log-level warn "${farmem_extra[@]}" "${metrics[@]}" "${crypt[@]}" 2>"$work/$t.log" &
    pids+=($!)
    server_pid[$t]=$!
  done
fi

if has farmem-none-prefaulted; then
  [ -f "$work/secret" ] || { head -c 32 /dev/urandom | base64 >"$work/secret"; chmod 600 "$work/secret"; }
  ppeers=""
  # Room for the none export alone (1x over six daemons, twice that for placement slack and
  # --max-client-share), all of it populated before the daemons listen.
  pcap=$(python3 -c "import math,re,sys; s=sys.argv[1]; m=re.fullmatch(r'(\d+)([KMG]?)',s); \
v=int(m[1])*{'':1,'K':1<<10,'M':1<<20,'G':1<<30}[m[2]]; print(max(4,math.ceil(v*2/6/(64<<20)))*64)" "$size")M
  for i in 0 1 2 3 4 5; do
    "$bin/farmemd" --listen 127.0.0.1:0 --port-file "$work/pport$i" --capacity "$pcap" \
      --slab-size 64M --rdma off --secret-file "$work/secret" --log-level warn --populate-at-start \
      2>"$work/farmemd-prefaulted$i.log" &
    pids+=($!)
  done
  for i in 0 1 2 3 4 5; do
    wait_file -s "$work/pport$i"
    ppeers="$ppeers${ppeers:+,}127.0.0.1:$(cat "$work/pport$i")"
  done
  "$bin/farmem-nbd" --backend farmem --peers "$ppeers" --secret-file "$work/secret" \
    --resilience none --transport tcp --size "$size" --unix "$work/farmem-none-prefaulted.sock" \
    --log-level warn "${farmem_extra[@]}" 2>"$work/farmem-none-prefaulted.log" &
  pids+=($!)
  server_pid[farmem-none-prefaulted]=$!
fi

uri() { echo "nbd+unix:///?socket=$work/$1.sock"; }
# fio options that reach a target
reach() {
  if [ "$1" = disk ]; then
    echo "--ioengine=libaio --direct=1 --filename=$disk_file"
  else
    echo "--ioengine=nbd --uri=$(uri "$1")"
  fi
}
for t in $targets; do
  [ "$t" = disk ] || wait_file -S "$work/$t.sock"
  # Allocate every page / block (1 MiB sequential writes).
  # shellcheck disable=SC2046
  fio --name=prefill $(reach "$t") --rw=write --bs=1m --iodepth=8 --size="$size" >/dev/null
done

# The metrics targets are scraped every second for the whole run, as a (busy) Prometheus would.
for f in "${scrape_ports[@]}"; do
  wait_file -s "$f"
  mport=$(cat "$f")
  (while curl -sf "http://127.0.0.1:$mport/metrics" -o /dev/null; do sleep 1; done) &
  pids+=($!)
done
echo "fio $(fio --version | sed 's/fio-//'), nbdkit $(nbdkit --version | awk '{print $2}')," \
  "$(nproc) CPUs, export $size, ${runtime}s x $repeat per job, swap-safe=$swap_safe," \
  "disk file on $(df --output=source,fstype "$disk_dir" | tail -1 | tr -s ' ')," \
  "load average $(cut -d' ' -f1-3 /proc/loadavg)"
if has farmem-none-plain || has farmem-ec-plain; then
  # The raw cost of sealing one page on one core: AES-256-GCM, 4 KiB blocks (openssl's EVP, the
  # same AES-NI/PCLMUL code farmem-nbd calls). Opening costs the same.
  echo "baseline: $(openssl speed -seconds 3 -bytes 4096 -evp aes-256-gcm 2>/dev/null |
    awk 'tolower($1) ~ /^aes-256-gcm/ {kb=$NF; sub(/k$/,"",kb); printf "openssl AES-256-GCM 4 KiB, 1 core: %.0f MB/s = %.2f us per page", kb*1000/1e6, 4096/(kb*1000)*1e6}')"
fi
read -r -a tlist <<<"$targets"
n=${#tlist[@]}
ramp=2
[ $cpu = 1 ] && ramp=0
for rep in $(seq "$repeat"); do
  for rw in randread randwrite; do
    for qd in 1 16; do
      for ((i = 0; i < n; i++)); do
        t=${tlist[$(((i + rep) % n))]}
        sp=${server_pid[$t]:-}
        [ $cpu = 1 ] && [ -n "$sp" ] && c0=$(cpu_ticks "$sp")
        # shellcheck disable=SC2046
        fio --name="$t-$rw-qd$qd" $(reach "$t") --rw="$rw" --bs=4k --iodepth="$qd" \
          --numjobs=1 --size="$size" --time_based --runtime="$runtime" --ramp_time=$ramp \
          --lat_percentiles=1 --output-format=json \
          --output="$json_dir/$t-$rw-qd$qd-$rep.json" >/dev/null
        if [ $cpu = 1 ] && [ -n "$sp" ]; then
          echo "$(($(cpu_ticks "$sp") - c0)) $(getconf CLK_TCK)" >"$json_dir/$t-$rw-qd$qd-$rep.cpu"
        fi
      done
    done
  done
done
echo "load average at the end $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$json_dir" "$repeat" "$targets" <<'EOF'
import json, math, os, statistics, sys
d, reps, targets = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
def one(t, rw, qd, rep):
    j = json.load(open(f"{d}/{t}-{rw}-qd{qd}-{rep}.json"))["jobs"][0]
    s = j["read" if rw == "randread" else "write"]
    lat = s["lat_ns"]
    cpu = math.nan  # server CPU per request, us (--cpu)
    f = f"{d}/{t}-{rw}-qd{qd}-{rep}.cpu"
    if os.path.exists(f) and s["total_ios"] > 0:
        ticks, hz = map(int, open(f).read().split())
        cpu = ticks / hz * 1e6 / s["total_ios"]
    return s["iops"], lat["mean"] / 1000.0, lat["percentile"]["99.000000"] / 1000.0, cpu
res = {}
print()
print(f"{'workload':<16}{'target':<21}{'IOPS':>10}{'mean us':>10}{'p99 us':>10}{'CPU us/req':>12}"
      "   IOPS per run; CPU us/req per run")
for rw in ("randread", "randwrite"):
    for qd in (1, 16):
        for t in targets:
            runs = [one(t, rw, qd, r) for r in range(1, reps + 1)]
            med = tuple(statistics.median(x[i] for x in runs) for i in range(4))
            res[(t, rw, qd)] = med
            per_run = " ".join(f"{r[0]:.0f}" for r in runs)
            if not math.isnan(med[3]):
                per_run += "; " + " ".join(f"{r[3]:.1f}" for r in runs)
            cpu = "-" if math.isnan(med[3]) else f"{med[3]:.1f}"
            print(f"{rw + ' qd' + str(qd):<16}{t:<21}{med[0]:>10.0f}{med[1]:>10.1f}{med[2]:>10.1f}"
                  f"{cpu:>12}   {per_run}")
ratios = [("farmem-none", "nbdkit-nbd"), ("farmem-none", "nbdkit-mem"), ("farmem-ec", "farmem-none"),
          ("farmem-mem", "nbdkit-mem"), ("farmem-none", "disk"), ("farmem-ec", "disk"),
          ("farmem-mem-metrics", "farmem-mem"), ("farmem-none-metrics", "farmem-none"),
          ("farmem-none", "farmem-none-plain"), ("farmem-ec", "farmem-ec-plain"),
          ("farmem-none", "farmem-none-prefaulted")]
ratios = [(a, b) for a, b in ratios if a in targets and b in targets]
if ratios:
    print()
    print("IOPS ratios (medians)")
    print(f"{'':<36}" + "".join(f"{rw[4:] + ' qd' + str(qd):>14}" for rw in ("randread", "randwrite")
                                for qd in (1, 16)))
    for a, b in ratios:
        print(f"{a + ' / ' + b:<36}" + "".join(
            f"{res[(a, rw, qd)][0] / res[(b, rw, qd)][0]:>14.2f}"
            for rw in ("randread", "randwrite") for qd in (1, 16)))
lat = [(a, b) for a, b in (("farmem-none", "farmem-none-plain"), ("farmem-ec", "farmem-ec-plain"))
       if a in targets and b in targets]
if lat:
    print()
    print("Encryption: added mean latency at qd1, us (target <= 3 us)")
    for a, b in lat:
        print(f"{a + ' - ' + b:<36}" + "".join(
            f"{rw + ' ' + format(res[(a, rw, 1)][1] - res[(b, rw, 1)][1], '+.1f'):>20}"
            for rw in ("randread", "randwrite")))
    if not math.isnan(res[(lat[0][0], "randread", 1)][3]):
        print()
        print("Encryption: farmem-nbd CPU added per request, us (medians; qd1 / qd16)")
        for a, b in lat:
            print(f"{a + ' - ' + b:<36}" + "".join(
                f"{rw + ' ' + format(res[(a, rw, 1)][3] - res[(b, rw, 1)][3], '+.1f') + ' / ' + format(res[(a, rw, 16)][3] - res[(b, rw, 16)][3], '+.1f'):>28}"
                for rw in ("randread", "randwrite")))
checks = [("farmem-none", "nbdkit-nbd", 3.0, "farmem-none qd16 IOPS >= 3x nbdkit-nbd"),
          ("farmem-none", "nbdkit-mem", 0.6, "farmem-none qd16 IOPS >= 0.6x nbdkit-mem"),
          ("farmem-ec", "farmem-none", 1 / 1.5, "farmem-ec qd16 IOPS within 1.5x of farmem-none"),
          ("farmem-none-metrics", "farmem-none", 0.98, "metrics on costs <= 2% IOPS (qd16)"),
          ("farmem-none", "farmem-none-plain", 0.90, "none: encryption costs <= 10% IOPS (qd16)"),
          ("farmem-ec", "farmem-ec-plain", 0.90, "ec:4+2: encryption costs <= 10% IOPS (qd16)"),
          ("farmem-none", "farmem-none-prefaulted", 0.95,
           "memory on demand costs <= 5% IOPS (qd16)")]
checks = [c for c in checks if c[0] in targets and c[1] in targets]
if checks:
    print()
    for a, b, want, text in checks:
        for rw in ("randread", "randwrite"):
            r = res[(a, rw, 16)][0] / res[(b, rw, 16)][0]
            print(f"target {text:<48} {rw:<10} {r:5.2f}  {'met' if r >= want else 'MISSED'}")
EOF
