#!/usr/bin/env bash
# Installs every Debian package farmem needs to build, test and run its demo.
# Idempotent: packages already present are skipped by apt-get. Run as root (or via sudo).
#   deploy/install-deps.sh          build + host tests + demo
#   deploy/install-deps.sh --vm     also what the qemu guest tests need
#   deploy/install-deps.sh --docker also what the container cluster guest test needs (docker.io,
#                                   debootstrap; the test runs only with -DFARMEM_DOCKER_VM_TEST=ON)
set -euo pipefail

build_pkgs=(
  build-essential cmake pkg-config ninja-build
  libisal-dev libipsec-mb-dev liburing-dev libibverbs-dev librdmacm-dev
  libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev libspdlog-dev libfmt-dev libssl-dev
  clang-14 libclang-rt-14-dev clang-16 libclang-rt-16-dev
  lld  # tests/run links with it: the ~110 executables of a tree in 11 s instead of 131 s (ld.bfd)
)
tool_pkgs=(
  nbdkit nbd-client libnbd-bin fio qemu-utils util-linux procps iproute2
  gdb  # tests/support/hang_dump.cc: the stacks of a test binary about to time out, in CI's log
  curl python3  # tests/client/metrics_status_test: scrape /metrics, parse farmemctl --json
  docker-compose shellcheck systemd  # tests/deploy: lint deploy/docker, verify deploy/systemd
  help2man dpkg-dev file  # man pages from --help; the .deb (cpack: dpkg-shlibdeps, file)
  python3-yaml  # tests/deploy/k8s_check.py: parse deploy/k8s
)
vm_pkgs=(
  qemu-system-x86 busybox-static kmod cpio rdma-core ibverbs-providers ibverbs-utils
  rdmacm-utils perftest
  "linux-headers-$(apt-cache depends linux-image-amd64 2>/dev/null |
    awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ { sub(/^linux-image-/, "", $2); print $2; exit }')"  # kmod/: farmem.ko for the guest's kernel
)

# deploy_docker_cluster_vm (by hand: FARMEM_DOCKER_VM_TEST=ON): the engine in the guest and the
# registry-free base image.
docker_pkgs=(docker.io debootstrap)

want=("${build_pkgs[@]}" "${tool_pkgs[@]}")
for arg in "$@"; do
  case $arg in
    --vm) want+=("${vm_pkgs[@]}") ;;
    --docker) want+=("${docker_pkgs[@]}") ;;
    *) echo "install-deps: unknown option $arg (--vm, --docker)" >&2; exit 2 ;;
  esac
done

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
