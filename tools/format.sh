#!/usr/bin/env bash
# Formats the tree in place: clang-format (.clang-format) over the C++ sources, and ruff's
# lint (pyproject.toml's [tool.ruff]) over the Python ones with its safe fixes. The Python
# is formatted by hand (continuation lines aligned with their bracket); `ruff format` would
# rewrite most of it, so it is not run.
#
#   tools/format.sh           # format and fix everything tracked by git
#   tools/format.sh --check   # change nothing; exit 1 when something is not formatted
#
# Needs clang-format (Debian: clang-format-14; CLANG_FORMAT names another) and ruff in the
# project venv (`pip install ruff`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/env.sh

check=0
[ "${1:-}" = "--check" ] && check=1
CLANG_FORMAT="${CLANG_FORMAT:-$(command -v clang-format-14 || command -v clang-format || true)}"
if [ -z "$CLANG_FORMAT" ]; then
  echo "format.sh: clang-format not found (apt-get install clang-format-14)" >&2
  exit 1
fi
if ! command -v ruff >/dev/null; then
  echo "format.sh: ruff not found (\"$CKPT_OFFLOAD_VENV/bin/python\" -m pip install ruff)" >&2
  exit 1
fi

# Tracked files and new ones git does not ignore.
files() { git ls-files --cached --others --exclude-standard "$@" ':!:third_party/**'; }
mapfile -t cc_files < <(files '*.cc' '*.h')
mapfile -t py_files < <(files '*.py')
status=0
if [ "$check" = 1 ]; then
  "$CLANG_FORMAT" --dry-run --Werror "${cc_files[@]}" || status=1
  ruff check "${py_files[@]}" || status=1
else
  "$CLANG_FORMAT" -i "${cc_files[@]}"
  ruff check --fix "${py_files[@]}" || status=1
fi
exit $status
