#!/usr/bin/env bash
# deploy/systemd: `systemd-analyze verify` accepts every unit without a single warning (it checks
# directives, sandboxing values, specifiers and that ExecStart= is executable: the templates'
# @FARMEM_SBINDIR@ is pointed at this build's binaries for the check; the installed units are
# checked by tests/package/deb_test.sh).
#   tests/deploy/systemd_verify.sh <source dir> <farmemd> <farmem-nbd> <farmemctl>
set -euo pipefail
src=${1:?usage: systemd_verify.sh <source dir> <farmemd> <farmem-nbd> <farmemctl>}
farmemd=${2:?}
nbd=${3:?}
farmemctl=${4:?}
fail() { echo "FAIL: $*" >&2; exit 1; }
command -v systemd-analyze >/dev/null ||
  fail "systemd-analyze not found: apt-get install systemd (deploy/install-deps.sh installs it)"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for in in "$src"/deploy/systemd/*.in; do
  u=$(basename "$in" .in)
  sed -e "s#@FARMEM_SBINDIR@/farmemd #$farmemd #" -e "s#@FARMEM_SBINDIR@/farmem-nbd #$nbd #" \
    -e "s#@FARMEM_BINDIR@/farmemctl #$farmemctl #" "$in" >"$tmp/$u"
done
grep -q '@[A-Z_]*@' "$tmp"/* && fail "a @VARIABLE@ of the unit templates the check does not know about"
cp "$tmp/farmemd@.service" "$tmp/farmemd@main.service"  # a template is verified as an instance
cd "$tmp"
units=(farmemd@main.service farmemd.service farmem-nbd.socket farmem-nbd.service farmem-kmod.service)
if ! out=$(systemd-analyze verify "${units[@]/#/./}" 2>&1) || [[ -n "$out" ]]; then
  fail "systemd-analyze verify: ${out:-non-zero exit}"
fi
# Stopping a lender drains it (clients move their data first), within systemd's stop timeout.
for u in farmemd@main.service farmemd.service; do
  grep -q -- '--drain-timeout 25000' "$u" || fail "$u: stopping must drain (--drain-timeout)"
  grep -q '^TimeoutStopSec=30s$' "$u" || fail "$u: TimeoutStopSec must exceed --drain-timeout"
done
# The sandbox must leave RDMA and mlock possible.
for u in farmemd@main.service farmemd.service farmem-nbd.service; do
  grep -q '^LimitMEMLOCK=infinity$' "$u" || fail "$u: no LimitMEMLOCK=infinity (mlock, RDMA registration)"
  grep -q '^PrivateDevices=yes' "$u" && fail "$u: PrivateDevices=yes hides /dev/infiniband"
  grep -q '^DeviceAllow=char-infiniband_verbs rw$' "$u" || fail "$u: uverbs devices not allowed"
  # READY=1 comes from farmemd/farmem-nbd once they listen (common/service_notify.h).
  grep -q '^Type=notify$' "$u" || fail "$u: not Type=notify"
done
grep -q '^ListenStream=' farmem-nbd.socket || fail "farmem-nbd.socket listens on nothing"
# The lease keeper: a killed one comes back and re-adopts /dev/farmem0; a detached one (exit 0)
# stays stopped; and it must be able to write /sys/kernel/farmem/control.
grep -q '^ExecStart=[^ ]*farmemctl kmod attach ' farmem-kmod.service || fail "farmem-kmod.service ExecStart="
grep -q '^Restart=on-failure$' farmem-kmod.service || fail "farmem-kmod.service: Restart=on-failure"
grep -q '^ProtectKernelTunables=yes' farmem-kmod.service && fail "farmem-kmod.service: /sys read-only"
echo "deploy/systemd: ${units[*]} verify clean"
