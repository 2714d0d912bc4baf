#!/usr/bin/env bash
# Runs pytest with the interpreter of one of the pip-made test venvs (scripts/pip_venv.sh,
# which scripts/setup.sh runs), over test files from this test's runfiles. ckpt_offload is
# the one pip built into that venv, not the Bazel build: the tests see what a pip user has.
#
#   venv_pytest.sh VENV_NAME LOCK [pytest args and test files...]
#     VENV_NAME  a folder under ${CKPT_OFFLOAD_CACHE:-$HOME/.cache/ckpt_offload}
#     LOCK       the requirements file that pins the venv's packages (venv_test.py checks
#                the venv against it)
set -euo pipefail
VENV="${CKPT_OFFLOAD_CACHE:-$HOME/.cache/ckpt_offload}/$1"
export CKPT_OFFLOAD_VENV_LOCK="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"
shift 2
if [ ! -x "$VENV/bin/python" ]; then
  echo "venv_pytest: no test venv at $VENV; run scripts/setup.sh" >&2
  exit 1
fi
export AXOLOTL_DO_NOT_TRACK=1 DO_NOT_TRACK=1  # axolotl's config loading would send telemetry
RUNFILES="${RUNFILES_DIR:-$TEST_SRCDIR}/ckpt_offload"
# The tests' own helpers (tiny.py, models.py); ckpt_offload itself comes from the venv.
export PYTHONPATH="$RUNFILES/tests/hf_integration:$RUNFILES/tests/torch_plugin"
# `axolotl train` starts `accelerate launch`, found on PATH: the venv's.
export PATH="$VENV/bin:$PATH"
exec "$VENV/bin/python" "$RUNFILES/tests/pytest_main.py" "$@"
