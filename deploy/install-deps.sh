#!/usr/bin/env bash
# Installs every Debian package farmem needs to build, test and run its demo.
# Idempotent: packages already present are skipped by apt-get. Run as root (or via sudo).
#   deploy/install-deps.sh          build + host tests + demo
#   deploy/install-deps.sh --vm     also what the qemu guest tests need
set -euo pipefail

build_pkgs=(
  build-essential cmake pkg-config ninja-build
  libisal-dev libsystemd-dev liburing-dev libibverbs-dev librdmacm-dev
  libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev libspdlog-dev libfmt-dev libssl-dev
  clang-14 libclang-rt-14-dev clang-16 libclang-rt-16-dev
)
tool_pkgs=(
  nbdkit nbd-client libnbd-bin fio qemu-utils util-linux procps iproute2
  curl python3  # tests/client/metrics_status_test: scrape /metrics, parse farmemctl --json
  docker-compose shellcheck systemd  # tests/deploy: lint deploy/docker, verify deploy/systemd
  help2man dpkg-dev file  # man pages from --help; the .deb (cpack: dpkg-shlibdeps, file)
  python3-yaml  # tests/deploy/k8s_check.py: parse deploy/k8s
)
vm_pkgs=(
  qemu-system-x86 busybox-static kmod cpio rdma-core ibverbs-providers ibverbs-utils
  rdmacm-utils perftest
  docker.io debootstrap  # tests/deploy/docker_cluster_vm.sh: the engine in the guest, a registry-free base
  "linux-headers-$(apt-cache depends linux-image-amd64 2>/dev/null |
    awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ { sub(/^linux-image-/, "", $2); print $2; exit }')"  # kmod/: farmem.ko for the guest's kernel
)

want=("${build_pkgs[@]}" "${tool_pkgs[@]}")
if [[ "${1:-}" == "--vm" ]]; then want+=("${vm_pkgs[@]}"); fi

missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#want[@]} packages present"
  exit 0
fi
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO=sudo; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
