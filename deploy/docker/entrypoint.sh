#!/bin/bash
# Entrypoint of the farmem container image (deploy/docker/Dockerfile, compose.yaml).
#
#   farmem-entrypoint [farmemd [farmemd options...]]   the default: serve this container's memory
#   farmem-entrypoint <any command...>                  e.g. farmemctl stat --peers-dns farmemd:7411
#
# Before either, it makes sure an RDMA device serves the container's network device, so that
# farmemd (--rdma auto) and farmemctl (--transport auto) can use verbs:
#   - a device already there (host networking with the host's rxe0, or a real RoCE NIC) is used;
#   - otherwise it creates soft-RoCE on the container's own interface (`rdma link add`; needs
#     CAP_NET_ADMIN, the host's rdma_rxe module and the host's /dev/infiniband bind-mounted, since
#     the device node appears after the container started);
#   - then it checks that RoCE can arrive here: rdma_rxe must have its UDP port 4791 socket in this
#     network namespace. Older kernels (Debian 12's 6.1 among them) open it only in the host's
#     namespace: a device in a container namespace then sends but never receives, and every queue
#     pair would time out. In that case the device is removed again and data moves over TCP (with a
#     message saying why); use compose.host.yaml for RDMA on such a kernel.
#
# Environment (all optional):
#   FARMEM_NETDEV      interface to serve on (default eth0)
#   FARMEM_ADDR        address to listen on (default: the first IPv4 address of FARMEM_NETDEV)
#   FARMEM_PORT        TCP port (default 7411; rdma_cm listens on port + 1)
#   FARMEM_RXE         auto (default) | off: whether to create soft-RoCE when no device serves
#   FARMEM_RDMA        farmemd --rdma: auto (default) | on (fail without RDMA) | off
#   FARMEM_CAPACITY    farmemd --capacity (default 1G)
#   FARMEM_SLAB_SIZE   farmemd --slab-size (default 64M)
#   FARMEM_SECRET_FILE farmemd --secret-file (default /run/secrets/farmem_secret if it exists)
set -euo pipefail

log() { echo "farmem-entrypoint: $*" >&2; }

netdev=${FARMEM_NETDEV:-eth0}
rxe_mode=${FARMEM_RXE:-auto}
rdma_mode=${FARMEM_RDMA:-auto}

# The RDMA device (ibdev name) whose port is bound to $netdev, if any. `rdma link` names a port's
# netdev only when that netdev is in the caller's network namespace.
ib_device_on_netdev() {
  rdma link show 2>/dev/null | awk -v nd="$netdev" '
    { for (i = 1; i < NF; i++) if ($i == "netdev" && $(i + 1) == nd) { split($2, a, "/"); print a[1]; exit } }'
}

# True when a RoCE v2 (UDP 4791 = 0x12B7) socket is bound in this network namespace.
roce_socket_here() {
  awk 'FNR > 1 && $2 ~ /:12B7$/ { found = 1 } END { exit !found }' /proc/net/udp /proc/net/udp6 \
    2>/dev/null
}

created=""
ibdev=$(ib_device_on_netdev)
if [[ -z "$ibdev" && "$rxe_mode" != off ]]; then
  # RDMA device names are global, not per namespace: name it after the interface's MAC address.
  mac=$(tr -d ':' <"/sys/class/net/$netdev/address" 2>/dev/null || true)
  name="rxe_${mac:-$netdev}"
  if rdma link add "$name" type rxe netdev "$netdev" 2>/tmp/rxe.err; then
    created=$name
    ibdev=$name
    log "created soft-RoCE device $name on $netdev"
  else
    log "no RDMA device serves $netdev and creating one failed ($(tr '\n' ' ' </tmp/rxe.err)):" \
      "it needs the host's rdma_rxe module (modprobe rdma_rxe) and CAP_NET_ADMIN"
  fi
fi
# A software device (rxe has no parent bus device) must be able to receive in this namespace.
if [[ -n "$ibdev" && ! -e "/sys/class/infiniband/$ibdev/device" ]] && ! roce_socket_here; then
  log "RDMA device $ibdev serves $netdev, but no RoCE socket (UDP 4791) listens in this network" \
    "namespace: this kernel's rdma_rxe receives only in the host's namespace, so queue pairs from" \
    "other containers could never connect. Data moves over TCP here; for RDMA on this kernel use" \
    "host networking (deploy/docker/compose.host.yaml)."
  if [[ -n "$created" ]]; then rdma link delete "$created" || true; fi
  ibdev=""
  if [[ "$rdma_mode" == on ]]; then
    log "FARMEM_RDMA=on: giving up"
    exit 1
  fi
  rdma_mode=off
fi
if [[ -n "$ibdev" && ! -e /dev/infiniband/rdma_cm ]]; then
  log "RDMA device $ibdev exists but /dev/infiniband/rdma_cm is not in this container:" \
    "pass the host's /dev/infiniband (see deploy/docker/compose.yaml)"
fi

if [[ $# -gt 0 && "$1" != farmemd ]]; then exec "$@"; fi
if [[ $# -gt 0 ]]; then shift; fi

addr=${FARMEM_ADDR:-$(ip -4 -o addr show dev "$netdev" 2>/dev/null | awk '{ split($4, a, "/"); print a[1]; exit }')}
if [[ -z "$addr" ]]; then
  log "no IPv4 address on $netdev: set FARMEM_ADDR or FARMEM_NETDEV"
  exit 1
fi
# Options given on the command line win over these (farmemd takes each option once).
given=" $* "
args=()
default() { if [[ "$given" != *" $1 "* && "$given" != *" $1="* ]]; then args+=("$1" "$2"); fi; }
default --listen "$addr:${FARMEM_PORT:-7411}"
default --rdma "$rdma_mode"
default --capacity "${FARMEM_CAPACITY:-1G}"
default --slab-size "${FARMEM_SLAB_SIZE:-64M}"
secret=${FARMEM_SECRET_FILE:-}
if [[ -z "$secret" && -f /run/secrets/farmem_secret ]]; then secret=/run/secrets/farmem_secret; fi
if [[ -n "$secret" ]]; then default --secret-file "$secret"; fi
log "farmemd ${args[*]} $*"
exec farmemd "${args[@]}" "$@"
