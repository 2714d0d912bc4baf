# Sourced by the scripts: puts the project venv first on PATH for Bazel's repository rules.
CKPT_OFFLOAD_VENV="${CKPT_OFFLOAD_VENV:-$HOME/.cache/ckpt_offload/venv}"
export PATH="$CKPT_OFFLOAD_VENV/bin:$PATH"
export CKPT_OFFLOAD_PYTHON="$CKPT_OFFLOAD_VENV/bin/python"
export VIRTUAL_ENV="$CKPT_OFFLOAD_VENV"
