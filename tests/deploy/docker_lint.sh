#!/usr/bin/env bash
# deploy/docker: the compose files parse and say what the README promises (`docker-compose
# config`, Compose v1 from Debian), the entrypoint passes shellcheck. The Dockerfile is not built
# and nothing is started here (CI's host has no Docker engine: deploy_docker_cluster_vm does that
# in the qemu guest). hadolint is not in Debian 12.
#   tests/deploy/docker_lint.sh <source dir>
set -euo pipefail
src=${1:?usage: docker_lint.sh <source dir>}
dir=$src/deploy/docker
fail() { echo "FAIL: $*" >&2; exit 1; }
need() { command -v "$1" >/dev/null || fail "$1 not found: apt-get install $2 (deploy/install-deps.sh installs it)"; }
need docker-compose docker-compose
need shellcheck shellcheck

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
head -c 32 /dev/urandom | base64 >"$tmp/secret"
chmod 600 "$tmp/secret"
export FARMEM_SECRET_PATH=$tmp/secret

# Runs `docker-compose config` on a compose file; prints the resolved file.
config() { docker-compose -f "$1" config 2>"$tmp/err" || fail "docker-compose config $1: $(cat "$tmp/err")"; }
expect() {  # expect <what> <text> <pattern>: the resolved file contains the line
  grep -qE -- "$3" <<<"$2" || fail "$1: no line matching '$3' in:
$2"
}

# The bridge cluster: N farmemd replicas (3 unless FARMEM_NODES), each able to make and use rxe.
out=$(config "$dir/compose.yaml")
expect compose.yaml "$out" '^ +replicas: 3$'
expect compose.yaml "$out" '^ +- NET_ADMIN$'
expect compose.yaml "$out" '^ +- IPC_LOCK$'
expect compose.yaml "$out" '^ +memlock: -1$'
expect compose.yaml "$out" '^ +- /dev/infiniband:/dev/infiniband'
expect compose.yaml "$out" '^ +- c 231:\* rwm$'
expect compose.yaml "$out" '^ +driver: bridge$'
expect compose.yaml "$out" '^ +- farmemd:7411$'
out=$(FARMEM_NODES=5 config "$dir/compose.yaml")
expect "compose.yaml with FARMEM_NODES=5" "$out" '^ +replicas: 5$'

# Host networking: three daemons on three ports of FARMEM_HOST_ADDR, which is required.
out=$(FARMEM_HOST_ADDR=192.0.2.10 config "$dir/compose.host.yaml")
[[ $(grep -cE '^ +network_mode: host$' <<<"$out") == 3 ]] || fail "compose.host.yaml: not 3 host-network services"
for port in 7411 7421 7431; do expect compose.host.yaml "$out" "^ +FARMEM_PORT: '$port'$"; done
expect compose.host.yaml "$out" '^ +FARMEM_ADDR: 192\.0\.2\.10$'
if env -u FARMEM_HOST_ADDR docker-compose -f "$dir/compose.host.yaml" config >/dev/null 2>&1; then
  fail "compose.host.yaml accepted a missing FARMEM_HOST_ADDR"
fi

shellcheck "$dir/entrypoint.sh" || fail "shellcheck deploy/docker/entrypoint.sh"
# The image copies these; a rename would break the build only on a machine with Docker.
grep -q '^COPY deploy/docker/entrypoint.sh ' "$dir/Dockerfile" || fail "Dockerfile does not copy the entrypoint"
[[ -x "$dir/entrypoint.sh" ]] || fail "entrypoint.sh is not executable"
echo "deploy/docker: compose.yaml and compose.host.yaml resolve as documented; entrypoint.sh is shellcheck-clean"
