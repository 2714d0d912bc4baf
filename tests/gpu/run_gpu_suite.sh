#!/usr/bin/env bash
# The GPU suite, run on the GPU machine (which has no Bazel) from the repository root:
#   bash tests/gpu/run_gpu_suite.sh OUT_DIR
# Expects what tools/gpu_prepare.sh made here: .gpu_deps/ (abseil for the pip build) and
# .gpu_bin/ (gtest binaries built with Bazel). Logs go to OUT_DIR; exit status is the
# number of failed parts.
set -uo pipefail
OUT="${1:?usage: run_gpu_suite.sh OUT_DIR}"
mkdir -p "$OUT"
ROOT="$(pwd)"
export CKPT_OFFLOAD_ABSL_PREFIX="$ROOT/.gpu_deps/absl" MAX_JOBS=16 PYTHONUNBUFFERED=1
failures=0
part() {  # part NAME COMMAND... : runs, logs to OUT/NAME.log, counts failures
  local name=$1; shift
  echo "== $name: $*" | tee -a "$OUT/summary.log"
  local start=$SECONDS
  if "$@" > "$OUT/$name.log" 2>&1; then
    echo "   ok ($((SECONDS - start)) s)" | tee -a "$OUT/summary.log"
  else
    echo "   FAILED rc=$? ($((SECONDS - start)) s); tail:" | tee -a "$OUT/summary.log"
    tail -n 30 "$OUT/$name.log" | tee -a "$OUT/summary.log"
    failures=$((failures + 1))
  fi
}
{
  echo "commit: ${CKPT_OFFLOAD_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'
} | tee "$OUT/summary.log"

part pip_install python3 -m pip install --no-build-isolation --no-deps -v .
TORCH_LIB=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__) + "/lib")')
CUDART_LIB=$(python3 -c 'import os, nvidia.cu13 as m; print(os.path.dirname(m.__file__) + "/lib")' 2>/dev/null || true)
export LD_LIBRARY_PATH="$ROOT/.gpu_deps/absl/lib:$TORCH_LIB:${CUDART_LIB}:${LD_LIBRARY_PATH:-}"
for binary in .gpu_bin/*_test; do
  part "gtest_$(basename "$binary")" "$binary"
done
cd "$ROOT/tests"  # import the installed package, not the source tree
part pytest_gpu python3 -m pytest -q -s -p no:cacheprovider gpu/torch_gpu_test.py ${GPU_PYTEST_EXTRA:-}
for extra in ${GPU_EXTRA_TESTS:-gpu/hf_gpu_test.py gpu/fused_loss_gpu_test.py gpu/soak_gpu_test.py}; do
  part "pytest_$(basename "$extra" .py)" python3 -m pytest -q -s -p no:cacheprovider "$extra"
done
part sanitizer_memcheck timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 python3 gpu/sanitizer_step.py
part sanitizer_racecheck timeout 300 compute-sanitizer --tool racecheck --error-exitcode 9 python3 gpu/sanitizer_step.py
echo "failed parts: $failures" | tee -a "$OUT/summary.log"
exit "$failures"
