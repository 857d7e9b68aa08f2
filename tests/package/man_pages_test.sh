#!/usr/bin/env bash
# Each man page lists every option its program's --help shows (and every subcommand's, for
# farmemctl): the pages are generated from --help at build time (cmake/FarmemManPage.cmake), and
# this fails when that generation breaks or a page goes stale.
#   tests/package/man_pages_test.sh <bin dir> <man dir>
set -euo pipefail
bin=${1:?usage: man_pages_test.sh <bin dir> <man dir>}
man=${2:?}
fail() { echo "FAIL: $*" >&2; exit 1; }

# Every help text of a program: its own and, recursively, its subcommands' (CLI11 lists them under
# "Subcommands:").
help_texts() {  # <program> [subcommand...]
  local out
  out=$("$@" --help) || fail "$* --help exits non-zero"
  printf '%s\n' "$out"
  local sub
  for sub in $(printf '%s\n' "$out" | awk '/^Subcommands:/{on=1; next} on && /^  [a-z]/{print $1} on && !/^ /{on=0}'); do
    help_texts "$@" "$sub"
  done
}

checked=0
for page in farmemd.8 farmem-nbd.8 farmemctl.1; do
  program=${page%.*}
  [[ -f "$man/$page" ]] || fail "$man/$page missing"
  # The page as text: roff's \- is a dash, font changes \fB..\fR go.
  text=$(sed -e 's/\\-/-/g' -e 's/\\f[BIRP]//g' -e 's/\\&//g' "$man/$page")
  options=$(help_texts "$bin/$program" | grep -oE -- '--[a-z][a-z0-9-]*' | sort -u)
  [[ -n "$options" ]] || fail "$program --help shows no options"
  for opt in $options; do
    grep -qE -- "(^|[^a-z0-9-])$opt([^a-z0-9-]|$)" <<<"$text" || fail "$page does not list $opt"
    checked=$((checked + 1))
  done
  grep -q "^\.TH \"\?${program^^}" "$man/$page" || fail "$page: no .TH header for $program"
done
echo "man pages: $checked options, each in its page"
