#!/usr/bin/env bash
# `cmake --install` into a fresh prefix puts every program, unit, man page, header and library
# where docs/operations.md says, the units name the installed binaries, and an outside project
# (tests/package/consumer) builds against the installed package both ways -- find_package(farmem)
# and pkg-config farmem -- and runs against a farmemd started from the installed sbin/.
#   tests/package/install_test.sh <build dir> <source dir>
set -euo pipefail
build=${1:?usage: install_test.sh <build dir> <source dir>}
src=${2:?}
fail() { echo "FAIL: $*" >&2; exit 1; }
tmp=$(mktemp -d)
daemon_pid=""
cleanup() {
  if [[ -n "$daemon_pid" ]]; then kill "$daemon_pid" 2>/dev/null || true; wait "$daemon_pid" || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
prefix=$tmp/prefix

cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" || fail "cmake --install: $(tail "$tmp/install.log")"

version=$(sed -n 's/^#define FARMEM_VERSION "\(.*\)"$/\1/p' "$prefix/include/farmem/common/version.h")
[[ -n "$version" ]] || fail "include/farmem/common/version.h has no FARMEM_VERSION"
for f in sbin/farmemd sbin/farmem-nbd bin/farmemctl; do
  [[ -x "$prefix/$f" ]] || fail "$f not installed"
  name=$(basename "$f")
  out=$("$prefix/$f" --version) || fail "$f --version exits non-zero"
  [[ "$out" == "$name $version"* ]] || fail "$f --version says '$out', not '$name $version...'"
done
for f in share/man/man8/farmemd.8 share/man/man8/farmem-nbd.8 share/man/man1/farmemctl.1 \
         include/farmem/far_ptr.h include/farmem/client/cluster.h lib/pkgconfig/farmem.pc \
         lib/cmake/farmem/farmemConfig.cmake lib/cmake/farmem/farmemConfigVersion.cmake \
         lib/libfarmem_farptr.a lib/libfarmem_client.a; do
  [[ -f "$prefix/$f" ]] || fail "$f not installed"
done
units=$prefix/lib/systemd/system
for u in farmemd.service farmemd@.service farmem-nbd.service farmem-nbd.socket farmem-kmod.service; do
  [[ -f "$units/$u" ]] || fail "unit $u not installed"
done
for u in farmemd.service farmemd@.service farmem-nbd.service farmem-kmod.service; do
  exe=$(sed -n 's/^ExecStart=\([^ ]*\).*/\1/p' "$units/$u")
  [[ "$exe" == "$prefix/"*bin/* && -x "$exe" ]] || fail "$u: ExecStart=$exe is not an installed binary"
done
grep -rq '@[A-Z_]*@' "$units" && fail "an unsubstituted @VARIABLE@ in the installed units"
[[ -e "$prefix/include/farmem/common/command_line.h" ]] && fail "command_line.h (programs only) installed"

# A daemon from the installed prefix for the consumer to use (loopback, no secret).
"$prefix/sbin/farmemd" --listen 127.0.0.1:0 --port-file "$tmp/port" --capacity 64M --slab-size 1M \
  --no-mlock --log-level warn 2>"$tmp/farmemd.log" &
daemon_pid=$!
for _ in $(seq 1 600); do  # waits on the port file (state), 60 s at most
  [[ -s "$tmp/port" ]] && break
  kill -0 "$daemon_pid" 2>/dev/null || fail "installed farmemd exited: $(cat "$tmp/farmemd.log")"
  sleep 0.1
done
[[ -s "$tmp/port" ]] || fail "installed farmemd wrote no port file in 60 s"
peer=127.0.0.1:$(cat "$tmp/port")

run_consumer() {  # <label> <cmake args...>
  local label=$1 dir=$tmp/consumer-$1
  shift
  cmake -S "$src/tests/package/consumer" -B "$dir" "$@" >"$dir.log" 2>&1 ||
    fail "$label: configure failed: $(tail -20 "$dir.log")"
  cmake --build "$dir" >>"$dir.log" 2>&1 || fail "$label: build failed: $(tail -30 "$dir.log")"
  out=$("$dir/consumer" --peers "$peer" 2>&1) || fail "$label: consumer failed: $out"
  # The library logs to stdout too (spdlog's default logger), from its own threads as well, so a
  # log line can come after the result: the result is the line that starts "consumer ok".
  local result
  result=$(grep '^consumer ok' <<<"$out" | tail -n1)
  [[ "$result" == "consumer ok 5000050000 (farmem $version"* ]] ||
    fail "$label: consumer said '$(tail -n5 <<<"$out")'"
  echo "$label: $result"
}
# Nothing of the build tree may leak in: only the prefix is given.
run_consumer find_package -DCMAKE_PREFIX_PATH="$prefix"
PKG_CONFIG_PATH=$prefix/lib/pkgconfig run_consumer pkg-config -DFARMEM_CONSUMER_PKG_CONFIG=ON
echo "install: every program, unit, man page, header and library in $prefix; consumer built both ways"
