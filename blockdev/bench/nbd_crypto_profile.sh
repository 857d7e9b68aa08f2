#!/usr/bin/env bash
# nbd_crypto_profile.sh: where page encryption's cost goes in farmem-nbd (issue 16,
# docs/benchmarks-nbd.md "The miss at depth 16, found"). An encrypted and a --no-encrypt
# farmem-nbd (--resilience none, 256 MiB) on the SAME six farmemd (tcp, loopback), fio 4 KiB
# randwrite and randread at depth 16 (nbd engine; --depth N for another, --resilience ec:4+2 for
# erasure-coded exports), each job on one export then the other, and:
#   - farmem-nbd's and the daemons' CPU per request (process CPU clocks, bench_lib.sh cpu_ns)
#   - pages per daemon frame (the daemons' data ops / READ+WRITE+BATCH frames, from their metrics)
#   - syscalls (sendmsg, recvfrom, recvmsg, poll, futex) and context switches per request, for
#     farmem-nbd and for the daemons (perf stat of tracepoints)
#   - then one more job each under `perf record -F 4999 -g` of farmem-nbd, summarised as CPU µs per
#     request by category (kernel, AES-GCM assembly of OpenSSL or intel-ipsec-mb, OpenSSL EVP layer,
#     PageCrypto, malloc, ...)
# Needs root (or perf_event_paranoid <= 0) for the tracepoints and the kernel samples.
#
#   blockdev/bench/nbd_crypto_profile.sh [--build-dir DIR] [--runtime S] [--reps N] [--out DIR]
#                                        [--resilience none|ec:4+2] [--depth N]
set -euo pipefail

build=build
runtime=5
reps=2
out=
resilience=none
depth=16
while [ $# -gt 0 ]; do
  case $1 in
    --build-dir) build=$2; shift 2 ;;
    --runtime) runtime=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --resilience) resilience=$2; shift 2 ;;
    --depth) depth=$2; shift 2 ;;
    *) echo "unknown option $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
bin=$build/bin
# shellcheck source=blockdev/bench/bench_lib.sh
source "$(dirname "$0")/bench_lib.sh"
bench_require fio perf curl python3
work=$(mktemp -d)
out=${out:-$work/out}
mkdir -p "$out"
pids=()
trap 'stop_pids; wait 2>/dev/null || true' EXIT  # perf's jobs too

peers=''
dpids=()
start_farmemds peers dpids d 6 --capacity 256M --slab-size 64M \
  --metrics-listen 127.0.0.1:0 --metrics-port-file "$work/m{i}.port"
declare -A npid
for t in enc plain; do
  extra=()
  [ $t = plain ] && extra=(--no-encrypt)
  "$bin/farmem-nbd" --backend farmem --peers "$peers" --secret-file "$work/secret" \
    --resilience "$resilience" --transport tcp --size 256M --unix "$work/$t.sock" --log-level warn \
    --no-swap-safe "${extra[@]}" 2>"$work/$t.log" &
  pids+=($!)
  npid[$t]=$!
done
for t in enc plain; do
  wait_file -S "$work/$t.sock"
  nbd_prefill "$(nbd_uri $t)" 256M
done
for i in 0 1 2 3 4 5; do wait_file -s "$work/m$i.port"; done

# daemon_counts: "FRAMES OPS" summed over the six daemons.
daemon_counts() {
  local f=0 o=0 i
  for i in 0 1 2 3 4 5; do
    curl -sf "http://127.0.0.1:$(cat "$work/m$i.port")/metrics" >"$work/scrape"
    f=$((f + $(awk '/^farmem_daemon_requests_total\{opcode="(READ|WRITE|BATCH)"/{s+=$2}
                    END{printf "%d", s}' "$work/scrape")))
    o=$((o + $(awk '/^farmem_daemon_data_ops_total/{s+=$2} END{printf "%d", s}' "$work/scrape")))
  done
  echo "$f $o"
}
job() {
  fio --name=j --ioengine=nbd --uri="$(nbd_uri "$1")" --rw="$2" --bs=4k --iodepth="$depth" --numjobs=1 \
    --size=256M --time_based --runtime="$runtime" --output-format=json --output="$3" >/dev/null
}
requests() {
  python3 -c "import json,sys; j=json.load(open(sys.argv[1]))['jobs'][0]
print(j['read']['total_ios'] + j['write']['total_ios'], int(j['read']['iops'] + j['write']['iops']))" "$1"
}
events=syscalls:sys_enter_sendmsg,syscalls:sys_enter_recvfrom,syscalls:sys_enter_recvmsg
events=$events,syscalls:sys_enter_poll,syscalls:sys_enter_futex,context-switches
dlist=$(IFS=,; echo "${dpids[*]}")

echo "--resilience $resilience, 4 KiB at depth $depth; load average $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%H:%M) UTC; out: $out"
printf '%-18s %7s %9s %9s %12s %s\n' job IOPS "nbd us/r" "daemon us/r" "pages/frame" \
  "per request (farmem-nbd | daemons): sendmsg recvfrom recvmsg poll futex cs"
for ((rep = 1; rep <= reps; rep++)); do
  for rw in randwrite randread; do
    for t in enc plain; do
      tag=$t-$rw-$rep
      m0=$(daemon_counts)
      c0=$(cpu_ns "${npid[$t]}")
      d0=$(cpu_ns "${dpids[@]}")
      perf stat -x, -e "$events" -p "${npid[$t]}" -o "$out/$tag.nbd.stat" -- sleep $((runtime + 1)) &
      s1=$!
      perf stat -x, -e "$events" -p "$dlist" -o "$out/$tag.daemons.stat" -- sleep $((runtime + 1)) &
      s2=$!
      job $t $rw "$out/$tag.json"
      wait $s1 $s2 || true
      c1=$(cpu_ns "${npid[$t]}")
      d1=$(cpu_ns "${dpids[@]}")
      m1=$(daemon_counts)
      read -r n iops <<<"$(requests "$out/$tag.json")"
      read -r f0 o0 <<<"$m0"
      read -r f1 o1 <<<"$m1"
      per() { awk -F, -v n="$n" '/^[0-9]/{printf " %.3f", $1 / n}' "$1"; }
      python3 -c "import sys; a=sys.argv; n=int(a[2])
print(f'{a[1]:<18} {a[3]:>7} {int(a[4])/n/1e3:9.2f} {int(a[5])/n/1e3:9.2f} {int(a[6])/max(1,int(a[7])):12.2f} {a[8]} |{a[9]}')" \
        "$tag" "$n" "$iops" "$((${c1%% *} - ${c0%% *}))" "$((${d1%% *} - ${d0%% *}))" \
        "$((o1 - o0))" "$((f1 - f0))" "$(per "$out/$tag.nbd.stat")" "$(per "$out/$tag.daemons.stat")"
    done
  done
done

echo
echo "perf record -F 4999 -g of farmem-nbd, one more job each: CPU us per request by category"
for rw in randwrite randread; do
  for t in enc plain; do
    perf record -F 4999 -g -p "${npid[$t]}" -o "$out/$t-$rw.perf" -- sleep $((runtime + 1)) \
      2>/dev/null &
    pr=$!
    job $t $rw "$out/$t-$rw.rec.json"
    wait $pr || true
    read -r n iops <<<"$(requests "$out/$t-$rw.rec.json")"
    perf report -i "$out/$t-$rw.perf" -n --no-children --sort dso,sym -g none --stdio \
      2>/dev/null | python3 -c '
import re, sys, collections
label, n = sys.argv[1], int(sys.argv[2])
cat, total = collections.Counter(), 0
for line in sys.stdin:
    m = re.match(r"\s*[\d.]+%\s+(\d+)\s+(\S+)\s+\[(.)\]\s+(.*)", line)
    if not m:
        continue
    k, dso, sym = int(m[1]), m[2], m[4].strip()
    total += k
    if dso.startswith("libcrypto"):
        c = "AES-GCM asm" if sym.startswith("0x") or "gcm" in sym.lower() else "EVP layer"
    elif dso.startswith("libIPSec_MB"):
        c = "AES-GCM asm"  # intel-ipsec-mb (docs/security.md), where the CPU has AES-NI
    elif "strcmp" in sym:
        c = "EVP layer"  # OSSL_PARAM_locate: OpenSSL 3.0 looks parameters up by name
    elif re.search(r"PageCrypto|aead::|SealPages|EndWrites", sym):
        c = "PageCrypto"
    elif re.fullmatch(r"malloc|cfree.*|_int_free.*|_int_malloc|operator new.*|unlink_chunk.*", sym):
        c = "malloc/free"
    elif m[3] == "k":
        c = "kernel"
    else:
        c = "other user"
    cat[c] += k
us = lambda k: k / 4999 / n * 1e6
print(f"{label:<16} {us(total):6.2f} us/req: " +
      ", ".join(f"{c} {us(k):.2f}" for c, k in cat.most_common()))' "$t-$rw ($iops IOPS)" "$n"
  done
done
echo "load average $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%H:%M) UTC"
