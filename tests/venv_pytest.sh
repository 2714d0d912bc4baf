#!/usr/bin/env bash
# Runs pytest on the given test files with the Axolotl test venv's interpreter, importing
# ckpt_offload (and its Bazel-built _C) from this test's runfiles.
set -euo pipefail
VENV="${CKPT_OFFLOAD_AXOLOTL_VENV:-$HOME/.cache/ckpt_offload/axolotl-venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "axolotl_test: no Axolotl test venv at $VENV; run scripts/setup_axolotl.sh" >&2
  exit 1
fi
export AXOLOTL_DO_NOT_TRACK=1 DO_NOT_TRACK=1  # config loading would send telemetry
RUNFILES="${RUNFILES_DIR:-$TEST_SRCDIR}/ckpt_offload"
export PYTHONPATH="$RUNFILES/torch_plugin:$RUNFILES/hf_integration${PYTHONPATH:+:$PYTHONPATH}"
# `axolotl train` starts `accelerate launch`, found on PATH: this venv's.
export PATH="$VENV/bin:$PATH"
exec "$VENV/bin/python" "$RUNFILES/tests/pytest_main.py" "$@"
