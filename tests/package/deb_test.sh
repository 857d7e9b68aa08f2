#!/usr/bin/env bash
# The Debian package: cpack makes farmem_<version>_<arch>.deb; it installs into a fresh root
# (dpkg --root on an empty dpkg database, dependencies checked against this machine by apt-get's
# simulation), holds every program, unit and man page under /usr, its programs run, and its
# installed units pass `systemd-analyze verify` with ExecStart= pointing at the packaged binaries.
#   tests/package/deb_test.sh <build dir>
set -euo pipefail
build=${1:?usage: deb_test.sh <build dir>}
fail() { echo "FAIL: $*" >&2; exit 1; }
for tool in cpack dpkg-deb dpkg dpkg-shlibdeps systemd-analyze apt-get; do
  command -v "$tool" >/dev/null || fail "$tool not found (deploy/install-deps.sh installs dpkg-dev and systemd)"
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

(cd "$tmp" && cpack --config "$build/CPackConfig.cmake" -G DEB -B "$tmp/out") >"$tmp/cpack.log" 2>&1 ||
  fail "cpack: $(tail -20 "$tmp/cpack.log")"
shopt -s nullglob
debs=("$tmp"/out/farmem_*.deb)
((${#debs[@]} == 1)) || fail "cpack made ${#debs[@]} farmem_*.deb: $(ls "$tmp/out")"
deb=${debs[0]}
echo "package: $(basename "$deb") ($(du -k "$deb" | cut -f1) KiB)"
depends=$(dpkg-deb -f "$deb" Depends)
[[ "$depends" == *libc6* ]] || fail "Depends: '$depends' (dpkg-shlibdeps did not run)"
# Installable here: every dependency resolves (a simulation changes nothing).
apt-get -s install "$deb" >"$tmp/apt.log" 2>&1 || fail "apt-get -s install: $(tail "$tmp/apt.log")"

# Installed into an empty root with dpkg itself. The root has no shell, so the maintainer scripts
# run outside it (--force-script-chrootless, with DPKG_ROOT set: they then leave the host's systemd
# alone). Dependencies live on the host, not in the empty root.
root=$tmp/root
mkdir -p "$root/var/lib/dpkg/updates" "$root/var/lib/dpkg/info"
touch "$root/var/lib/dpkg/status"
dpkg --root="$root" --force-depends --force-not-root --force-script-chrootless --log=/dev/null -i "$deb" >"$tmp/dpkg.log" 2>&1 ||
  fail "dpkg -i: $(tail "$tmp/dpkg.log")"
dpkg --root="$root" -s farmem | grep -q '^Status: install ok installed' || fail "dpkg says farmem is not installed"
for f in usr/sbin/farmemd usr/sbin/farmem-nbd usr/bin/farmemctl; do
  [[ -x "$root/$f" ]] || fail "$f not in the package"
  "$root/$f" --version >/dev/null || fail "$f --version fails from the package"
done
for f in usr/share/man/man8/farmemd.8 usr/share/man/man8/farmem-nbd.8 usr/share/man/man1/farmemctl.1 \
         usr/include/farmem/far_ptr.h usr/lib/cmake/farmem/farmemConfig.cmake; do
  [[ -f "$root/$f" ]] || fail "$f not in the package"
done
[[ -n $(find "$root/usr/lib" -name farmem.pc) ]] || fail "farmem.pc not in the package"

units=$root/usr/lib/systemd/system
for u in farmemd.service farmemd@.service farmem-nbd.service farmem-nbd.socket farmem-kmod.service; do
  [[ -f "$units/$u" ]] || fail "unit $u not in the package"
done
grep -q '^ExecStart=/usr/sbin/farmemd ' "$units/farmemd.service" || fail "farmemd.service: $(grep ExecStart "$units/farmemd.service")"
grep -q '^ExecStart=/usr/sbin/farmem-nbd ' "$units/farmem-nbd.service" || fail "farmem-nbd.service ExecStart="
grep -q '^ExecStart=/usr/bin/farmemctl kmod attach ' "$units/farmem-kmod.service" || fail "farmem-kmod.service ExecStart="
# systemd-analyze verify on the installed units, with the host's systemd units around them
# (--root would need a whole systemd in the root). The only change: /usr/sbin/ -> the root's, so
# that ExecStart= is checked against the packaged binaries, not whatever the host has.
check=$tmp/verify
mkdir "$check"
for u in farmemd.service farmemd@.service farmem-nbd.service farmem-nbd.socket farmem-kmod.service; do
  sed -e "s#^ExecStart=/usr/sbin/#ExecStart=$root/usr/sbin/#" \
    -e "s#^ExecStart=/usr/bin/#ExecStart=$root/usr/bin/#" "$units/$u" >"$check/$u"
done
mv "$check/farmemd@.service" "$check/farmemd@main.service"  # a template is verified as an instance
verify=(farmemd.service farmemd@main.service farmem-nbd.socket farmem-nbd.service farmem-kmod.service)
if ! out=$(cd "$check" && systemd-analyze verify "${verify[@]/#/./}" 2>&1) || [[ -n "$out" ]]; then
  fail "systemd-analyze verify of the installed units: ${out:-non-zero exit}"
fi
dpkg --root="$root" --force-not-root --force-script-chrootless --log=/dev/null -r farmem >"$tmp/dpkg-r.log" 2>&1 || fail "dpkg -r: $(tail "$tmp/dpkg-r.log")"
[[ -e "$root/usr/sbin/farmemd" ]] && fail "dpkg -r left /usr/sbin/farmemd behind"
echo "deb: installs into an empty root, programs run, units verify clean, removes cleanly"
