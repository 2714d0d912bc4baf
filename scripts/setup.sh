#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian 12 machine: Debian packages, the project venv with
# pinned Python packages. Safe to run again; it skips what is already in place.
#   CKPT_OFFLOAD_VENV  where the venv lives (default ~/.cache/ckpt_offload/venv, outside the
#                      clone so fresh clones and CI reuse it)
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
# The Axolotl test venv, over this one (about a minute from cold; see setup_axolotl.sh).
CKPT_OFFLOAD_VENV="$VENV" bash "$ROOT/scripts/setup_axolotl.sh"
echo "setup: ready (venv $VENV, $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
