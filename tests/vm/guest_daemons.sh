# Sourced by the guest scripts (kmod_smoke.sh, nbd_farmem_swap.sh): starting the farmemd daemons
# a guest test lends from. Needs, from the sourcing script: $bin (where farmemd is), a `pids`
# array and a `fail MESSAGE` function.

# start_daemons WORK ADDR... -- FARMEMD_ARG...
# Makes a shared secret ($WORK/secret), starts one farmemd per ADDR listening on ADDR:0 with it
# and the given arguments (log: $WORK/farmemdI.log, port: $WORK/portI), appends their pids to
# `pids`, and waits (20 s each at most) until each has written its port. Sets `peers` (ADDR:PORT
# each) and `peer_list` (the same, comma-separated); calls fail if a daemon did not start.
start_daemons() {
  local work=$1 i
  shift
  local listen=()
  while (($# > 0)) && [[ $1 != -- ]]; do listen+=("$1"); shift; done
  (($# > 0)) && shift
  head -c 32 /dev/urandom | base64 >"$work/secret"
  chmod 600 "$work/secret"
  for ((i = 0; i < ${#listen[@]}; i++)); do
    "$bin/farmemd" --listen "${listen[$i]}:0" --port-file "$work/port$i" \
      --secret-file "$work/secret" "$@" 2>"$work/farmemd$i.log" &
    pids+=($!)
  done
  peers=()
  for ((i = 0; i < ${#listen[@]}; i++)); do
    for _ in $(seq 400); do [[ -s $work/port$i ]] && break; sleep 0.05; done
    [[ -s $work/port$i ]] || fail "farmemd $i did not start"
    peers+=("${listen[$i]}:$(cat "$work/port$i")")
  done
  peer_list=$(IFS=,; echo "${peers[*]}")
}
