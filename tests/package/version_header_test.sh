#!/usr/bin/env bash
# farmem/common/version.h (cmake/FarmemVersionHeader.cmake): from a git checkout it carries
# `git describe`; from a tree without its own .git -- a tarball, also one unpacked inside some
# other checkout -- the project version alone, never another repository's commit.
#   tests/package/version_header_test.sh <source dir>
set -euo pipefail
src=${1:?usage: version_header_test.sh <source dir>}
fail() { echo "FAIL: $*" >&2; exit 1; }
script=$src/cmake/FarmemVersionHeader.cmake
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
string_of() { sed -n 's/^#define FARMEM_VERSION_STRING "\(.*\)"$/\1/p' "$1"; }

cmake -DSOURCE_DIR="$src" -DOUTPUT="$tmp/git.h" -DPROJECT_VERSION=9.8.7 -P "$script"
if git -C "$src" rev-parse --show-toplevel >/dev/null 2>&1; then
  want="9.8.7 (git $(git -C "$src" describe --tags --always --dirty))"
  [[ "$(string_of "$tmp/git.h")" == "$want" ]] || fail "checkout: '$(string_of "$tmp/git.h")', want '$want'"
fi

mkdir "$tmp/tarball"  # outside any checkout
cmake -DSOURCE_DIR="$tmp/tarball" -DOUTPUT="$tmp/tar.h" -DPROJECT_VERSION=9.8.7 -P "$script"
[[ "$(string_of "$tmp/tar.h")" == "9.8.7" ]] || fail "tarball: '$(string_of "$tmp/tar.h")'"

# Unpacked inside another repository: that repository's commit must not show.
git init -q "$tmp/other"
git -C "$tmp/other" -c user.name=t -c user.email=t@t commit -q --allow-empty -m other
mkdir "$tmp/other/farmem-0.1.0"
cmake -DSOURCE_DIR="$tmp/other/farmem-0.1.0" -DOUTPUT="$tmp/nested.h" -DPROJECT_VERSION=9.8.7 -P "$script"
[[ "$(string_of "$tmp/nested.h")" == "9.8.7" ]] || fail "tarball in another checkout: '$(string_of "$tmp/nested.h")'"

# Rewritten only when the text changes (an unchanged version rebuilds nothing).
touch -d '2000-01-01' "$tmp/tar.h"
cmake -DSOURCE_DIR="$tmp/tarball" -DOUTPUT="$tmp/tar.h" -DPROJECT_VERSION=9.8.7 -P "$script"
[[ "$(stat -c %Y "$tmp/tar.h")" == "$(date -d '2000-01-01' +%s)" ]] || fail "unchanged header rewritten"
echo "version header: git describe from the checkout, the project version alone without .git"
