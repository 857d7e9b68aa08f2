#!/usr/bin/env bash
# The rxe test cluster of deploy/docker really run: Debian's Docker engine (docker.io) inside the
# qemu test guest (ctest label vm), its data root on the guest's tmpfs, no registry anywhere.
#   1. `docker import` of the base that deploy/docker/base-image made with debootstrap (the
#      ctest fixture deploy_docker_base_image builds it on the host, cached in the vm cache);
#   2. `docker build` of deploy/docker/Dockerfile on it with FARMEM_PREBUILT (the binaries of this
#      build tree, debug info stripped: compiling under emulation is not practical), from a
#      context of just the files the image takes;
#   3. `docker-compose up` of compose.host.yaml: farmemd containers on the guest's rxe0;
#   4. `farmemctl demo` in a container of the image against them: must move its data over verbs
#      and verify every byte;
#   5. farmem-nbd (this build tree's, in the guest: one container start less) with its page store
#      on the cluster (verbs, --resilience replicate:2) exporting a Unix socket, the kernel's
#      nbd-client attached to it: bytes written to /dev/nbd0 read back (O_DIRECT) equal, and the
#      daemons lend two copies of the export.
# Prints the image size and the start-up time (compose up until every daemon answers farmemctl
# stat). Short form (CI): 2 daemons, an 8 MiB demo, a 16 MiB write. FARMEM_DOCKER_LONG=1: all 3
# daemons of compose.host.yaml, a 64 MiB demo, a 64 MiB write.
# Exit 77 when docker.io or docker-compose is missing (deploy/install-deps.sh --docker installs them),
# or the base image was not built; with FARMEM_VM_REQUIRED=1 those fail instead.
set -euo pipefail
bin=${FARMEM_BIN_DIR:?}
src=${FARMEM_SOURCE_DIR:?}
say() { echo "[docker_cluster] $*"; }
work=$(mktemp -d /tmp/farmem-docker.XXXXXX)
fail() {
  echo "[docker_cluster] FAIL: $*"
  for f in "$work"/*.log; do [[ -s $f ]] && { echo "--- last lines of $f"; tail -n 15 "$f"; }; done
  exit 1
}
unavailable() {
  [[ ${FARMEM_VM_REQUIRED:-0} == 1 ]] && fail "$* (FARMEM_VM_REQUIRED=1)"
  say "SKIP: $*"
  exit 77
}
[[ ${FARMEM_VM:-} == 1 && -n ${FARMEM_VM_RXE:-} ]] || fail "run me in the test guest with rxe (ctest -R deploy_docker_cluster_vm)"
addr=${FARMEM_VM_ADDRS%% *}
# Debian's client, not another docker on PATH.
docker=/usr/bin/docker
for t in /usr/sbin/dockerd "$docker" /usr/bin/containerd /usr/sbin/runc /usr/bin/docker-compose; do
  [[ -x $t ]] || unavailable "$t not found: apt-get install docker.io docker-compose (deploy/install-deps.sh --docker)"
done
base=$("$src/deploy/docker/base-image" --print) ||
  unavailable "no base image at $base: deploy/docker/base-image builds it (ctest fixture deploy_docker_base_image)"
if [[ ${FARMEM_DOCKER_LONG:-0} == 1 ]]; then
  services=(farmemd-1 farmemd-2 farmemd-3) ports=(7411 7421 7431) demo_size=64M nbd_mib=64
  export FARMEM_CAPACITY=128M
else
  services=(farmemd-1 farmemd-2) ports=(7411 7421) demo_size=8M nbd_mib=16
fi
peers=$(printf "$addr:%s," "${ports[@]}")
peers=${peers%,}
t_start=$(date +%s.%N)
now() { awk -v a="$t_start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

# ---- the engine ---------------------------------------------------------------------------------
# The guest's / is the host's, read-only: dockerd writes its trust key under /etc/docker, and its
# data root and state go to the guest's tmpfs. Host networking only: no bridge, no iptables.
mount -t tmpfs -o mode=0700 etc-docker /etc/docker || fail "cannot mount a tmpfs on /etc/docker"
mkdir -p /tmp/docker-data && mount -t tmpfs -o mode=0711 docker-data /tmp/docker-data
modprobe -d "$FARMEM_VM_MODULES_DIR" overlay 2>/dev/null || true
driver=vfs
grep -qw overlay /proc/filesystems && driver=overlay2
# containerd is started here and waited for: dockerd gives the one it would start itself a fixed
# time, which an emulated guest on a loaded host overran. Its CRI plugin (Kubernetes) is not needed.
cat >"$work/containerd.toml" <<'TOML'
version = 2
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.aufs", "io.containerd.internal.v1.opt"]
TOML
containerd --config "$work/containerd.toml" --root /tmp/docker-data/containerd \
  --state /run/containerd --address /run/containerd/containerd.sock >"$work/containerd.log" 2>&1 &
containerd_pid=$!
export DOCKER_HOST=unix:///run/docker.sock
dockerd_pid=""
cleanup() {
  set +e
  [[ -n ${nbd_dev:-} ]] && nbd-client -d "$nbd_dev" >/dev/null 2>&1
  [[ -n ${nbd_pid:-} ]] && kill "$nbd_pid" 2>/dev/null
  [[ -n $dockerd_pid ]] && kill "$dockerd_pid" 2>/dev/null && wait "$dockerd_pid" 2>/dev/null
  kill "$containerd_pid" 2>/dev/null && wait "$containerd_pid" 2>/dev/null
}
trap cleanup EXIT
for _ in $(seq 300); do
  [[ -S /run/containerd/containerd.sock ]] && break
  kill -0 "$containerd_pid" 2>/dev/null || fail "containerd exited"
  sleep 0.5
done
[[ -S /run/containerd/containerd.sock ]] || fail "containerd did not listen"
dockerd --data-root /tmp/docker-data --exec-root /run/docker --pidfile /run/docker.pid \
  --containerd /run/containerd/containerd.sock \
  --host "$DOCKER_HOST" --storage-driver "$driver" --bridge none --iptables=false \
  --ip6tables=false --ip-masq=false --userland-proxy=false \
  --exec-opt native.cgroupdriver=cgroupfs --log-level warn >"$work/dockerd.log" 2>&1 &
dockerd_pid=$!
for _ in $(seq 300); do
  "$docker" version >/dev/null 2>&1 && break
  kill -0 "$dockerd_pid" 2>/dev/null || fail "dockerd exited"
  sleep 0.5
done
"$docker" version >/dev/null 2>&1 || fail "dockerd did not answer"
say "dockerd up at $(now) s (storage driver $driver, data root on tmpfs)"

# ---- the images ---------------------------------------------------------------------------------
t=$(date +%s.%N)
"$docker" import "$base" farmem-base:bookworm >/dev/null || fail "docker import $base"
say "base imported in $(since "$t") s: $(du -m "$base" | cut -f1) MB tar ($base)"
ctx=$work/context
mkdir -p "$ctx/deploy/docker" "$ctx/bin"
cp "$src/deploy/docker/Dockerfile" "$src/deploy/docker/entrypoint.sh" \
  "$src/deploy/docker/runtime-packages" "$ctx/deploy/docker/"
for b in farmemd farmemctl farmem-nbd; do
  objcopy --strip-debug "$bin/$b" "$ctx/bin/$b" || fail "no $bin/$b (build farmemd farmemctl farmem-nbd)"
done
# BuildKit (the engine's own, no buildx needed in 20.10) builds only the stages the image needs and
# runs no container for COPY and metadata steps; the classic builder is the fallback.
build=("$docker" build --network host -t farmem:latest -f "$ctx/deploy/docker/Dockerfile"
  --build-arg FARMEM_BASE=farmem-base:bookworm --build-arg FARMEM_BUILD_BASE=farmem-base:bookworm
  --build-arg FARMEM_PREBUILT=bin "$ctx")
t=$(date +%s.%N)
builder=buildkit
if ! DOCKER_BUILDKIT=1 "${build[@]}" --progress plain >"$work/build.log" 2>&1; then
  say "BuildKit build failed ($(grep -m1 -i error "$work/build.log")): the classic builder then"
  builder=classic
  t=$(date +%s.%N)
  DOCKER_BUILDKIT=0 "${build[@]}" >"$work/build.log" 2>&1 || fail "docker build"
fi
build_s=$(since "$t")
size=$("$docker" image inspect -f '{{.Size}}' farmem:latest)
base_size=$("$docker" image inspect -f '{{.Size}}' farmem-base:bookworm)
say "image farmem:latest built ($builder) in $build_s s: $((size / 1000000)) MB ($((base_size / 1000000)) MB of it the base)"
# The runtime stage found everything of runtime-packages in the base: nothing was installed.
grep -q "runtime-packages: all in the base image" "$work/build.log" ||
  fail "the runtime stage had to install packages the base should have"

# ---- the cluster --------------------------------------------------------------------------------
secret=$work/secret
head -c 32 /dev/urandom | base64 >"$secret"
chmod 600 "$secret"
export FARMEM_HOST_ADDR=$addr FARMEM_SECRET_PATH=$secret FARMEM_CAPACITY=${FARMEM_CAPACITY:-64M} FARMEM_SLAB_SIZE=4M
compose=(docker-compose -f "$src/deploy/docker/compose.host.yaml" -p farmem)
t=$(date +%s.%N)
"${compose[@]}" up -d --no-build "${services[@]}" >"$work/compose.log" 2>&1 || fail "compose up"
stat_ok=""
for _ in $(seq 600); do
  if "$bin/farmemctl" stat --peers "$peers" --secret-file "$secret" >"$work/stat.log" 2>&1; then
    stat_ok=1
    break
  fi
  sleep 0.2
done
[[ -n $stat_ok ]] || { "${compose[@]}" logs >"$work/containers.log" 2>&1; fail "the daemons did not all answer farmemctl stat"; }
startup_s=$(since "$t")
say "compose up -> ${#services[@]} daemons answering: $startup_s s"
"${compose[@]}" logs >"$work/containers.log" 2>&1
grep -c "RDMA: listening with rdma_cm on $addr" "$work/containers.log" | grep -qx "${#services[@]}" ||
  fail "not every daemon serves RDMA on $addr"

# ---- farmemctl demo, in a container of the image ------------------------------------------------
run=("$docker" run --pull never --rm --network host --device /dev/infiniband --cap-add IPC_LOCK --ulimit memlock=-1
  -v "$secret:/run/secrets/farmem_secret:ro")
t=$(date +%s.%N)
"${run[@]}" farmem:latest farmemctl demo --peers "$peers" --secret-file /run/secrets/farmem_secret \
  --size "$demo_size" >"$work/demo.log" 2>&1 || fail "farmemctl demo: exit $?"
cat "$work/demo.log"
grep -q "verified: every byte read back is the byte written" "$work/demo.log" || fail "demo did not verify"
grep -q "over verbs" "$work/demo.log" || fail "the demo's data did not move over verbs"
grep -q "over tcp" "$work/demo.log" && fail "some of the demo's data moved over tcp"
say "demo ($demo_size over verbs) in $(since "$t") s"

# ---- an NBD export on the cluster: farmem-nbd (this build's) in the guest, the kernel's client ----
say "farmem-nbd: ${nbd_mib} MiB export, replicate:2 over verbs"
t=$(date +%s.%N)
"$bin/farmem-nbd" --backend farmem --peers "$peers" --secret-file "$secret" --transport verbs \
  --resilience replicate:2 --size "${nbd_mib}M" --unix "$work/nbd.sock" >"$work/nbd.log" 2>&1 &
nbd_pid=$!
for _ in $(seq 240); do
  [[ -S $work/nbd.sock ]] && break
  kill -0 "$nbd_pid" 2>/dev/null || fail "farmem-nbd exited"
  sleep 0.5
done
[[ -S $work/nbd.sock ]] || fail "farmem-nbd did not listen"
say "farmem-nbd listening in $(since "$t") s"
t=$(date +%s.%N)
nbd_dev=/dev/nbd0
timeout 120 nbd-client -unix "$work/nbd.sock" "$nbd_dev" -b 4096 -N '' >"$work/nbd-client.log" 2>&1 ||
  { nbd_dev=""; fail "nbd-client"; }
say "nbd-client attached in $(since "$t") s (at $(now) s)"
head -c "$((nbd_mib * 1048576))" /dev/urandom >"$work/data"
t=$(date +%s.%N)
timeout 120 dd if="$work/data" of="$nbd_dev" bs=1M oflag=direct status=none || fail "write to $nbd_dev"
say "${nbd_mib} MiB written (O_DIRECT) in $(since "$t") s"
t=$(date +%s.%N)
timeout 120 dd if="$nbd_dev" of="$work/back" bs=1M iflag=direct count="$nbd_mib" status=none || fail "read $nbd_dev"
say "${nbd_mib} MiB read back in $(since "$t") s"
cmp "$work/data" "$work/back" || fail "the export read back other bytes than were written"
"$bin/farmemctl" stat --json --peers "$peers" --secret-file "$secret" >"$work/stat.json" 2>&1 ||
  fail "farmemctl stat after the export"
lent=$(python3 -c 'import json, sys
d = json.load(open(sys.argv[1]))
assert all("rdma" in x["transports"] for x in d["daemons"]), "a daemon without rdma"
print(sum(x.get("lent_bytes") or 0 for x in d["daemons"]))' "$work/stat.json") || fail "stat --json: $(cat "$work/stat.json")"
((lent >= 2 * nbd_mib * 1048576)) || fail "the daemons lend $lent bytes, less than 2 copies of the ${nbd_mib} MiB export"
nbd-client -d "$nbd_dev" >/dev/null 2>&1 && nbd_dev=""
kill "$nbd_pid" && wait "$nbd_pid" 2>/dev/null || true
say "NBD: ${nbd_mib} MiB written through /dev/nbd0 and read back equal; the daemons lend $((lent / 1048576)) MiB"
"${compose[@]}" down >/dev/null 2>&1 || fail "compose down"
say "RESULT image_mb=$((size / 1000000)) startup_s=$startup_s build_s=$build_s daemons=${#services[@]} total_s=$(now)"
echo "PASS"
