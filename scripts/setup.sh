#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian 12 machine: Debian packages, the project venv with
# pinned Python packages (Bazel builds and tests against it), and two venvs made as pip users
# make them, with ckpt_offload built into each by pip (scripts/pip_venv.sh): PyPI's newest
# torch, and what `pip install axolotl==0.21.0` brings. Safe to run again; it skips what is
# already in place.
#   CKPT_OFFLOAD_VENV   the project venv (default ~/.cache/ckpt_offload/venv, outside the
#                       clone so fresh clones and CI reuse it)
#   CKPT_OFFLOAD_CACHE  where the pip-made venvs live (default ~/.cache/ckpt_offload)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CKPT_OFFLOAD_VENV:-$HOME/.cache/ckpt_offload/venv}"

# cmake: tests/install exercises the pip build's search of abseil's CMake config.
# libnuma-dev: only the NUMA tests call libnuma; the engine makes the system calls itself.
APT_PACKAGES=(
  bazel-bootstrap bazel-rules-java bazel-platforms
  g++ pkg-config cmake libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev libnuma-dev
  clang-14 libclang-rt-14-dev
  python3 python3-venv python3-dev
)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating venv $VENV"
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV"
fi
stamp="$VENV/.ckpt_offload_lock.sha256"
want="$(sha256sum "$ROOT/requirements/lock.txt" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing pinned Python packages (requirements/lock.txt)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -r "$ROOT/requirements/lock.txt"
  echo "$want" > "$stamp"
fi

# Python 3.12 for the pip-made venvs (Axolotl 0.21 needs it).
source "$ROOT/scripts/find_python.sh"
python312="$(find_python 3.12)"
CACHE="${CKPT_OFFLOAD_CACHE:-$HOME/.cache/ckpt_offload}"
bash "$ROOT/scripts/pip_venv.sh" "$CACHE/newest-venv" "$python312" "$ROOT/requirements/newest-lock.txt"
bash "$ROOT/scripts/pip_venv.sh" "$CACHE/axolotl-venv" "$python312" "$ROOT/requirements/axolotl-lock.txt"
echo "setup: ready (venv $VENV, $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
