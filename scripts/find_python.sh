# Sourced by the scripts: find_python MINOR prints the path of a Python MINOR (3.12):
# python3.12 on PATH, else pyenv's; with none, it says so and fails.
find_python() {
  local candidate
  for candidate in "python$1" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$1".*/bin/"python$1"; do
    if "$candidate" -c "import sys; assert '%d.%d' % sys.version_info[:2] == '$1'" 2>/dev/null; then
      command -v "$candidate"
      return
    fi
  done
  echo "no Python $1 found (python$1 on PATH or under pyenv); install one" >&2
  return 1
}
