#!/usr/bin/env bash
# The torch matrix (CPU, minutes per row; not part of CI, which covers the lock's torch, the
# newest and Axolotl's): for each torch release below, a fresh venv of PyPI packages as a pip
# user makes it (scripts/pip_venv.sh), `pip install --no-build-isolation .` into it, then
# the venv check and HF Trainer runs of a tiny Llama with the callback, bit-identical to the
# run without it. Prints one table row per release, with the seconds each part took.
#
#   scripts/torch_matrix.sh [TORCH==PYTHON ...]     default: every row of ROWS
#   CKPT_OFFLOAD_CACHE   where the venvs live (default ~/.cache/ckpt_offload; matrix-*/)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${CKPT_OFFLOAD_CACHE:-$HOME/.cache/ckpt_offload}"
# One row per tested minor release (ckpt_offload/versions.py), its newest patch, spread over
# the tested Pythons.
ROWS=(2.11.0==3.10 2.12.0==3.11 2.13.0==3.12 2.14.1==3.12 2.15.0==3.12)
((${#@})) && ROWS=("$@")
# The Hugging Face releases of the project's lock, for every row.
HF_PINS=$(grep -E '^(transformers|peft|accelerate|tokenizers|safetensors)==' "$ROOT/requirements/lock.txt")

source "$ROOT/scripts/find_python.sh"

TESTS=(
  "$ROOT/tests/install/venv_test.py"
  "$ROOT/tests/hf_integration/trainer_test.py::test_trainer_bit_identical_with_offload_figures_and_restored_model"
  "$ROOT/tests/hf_integration/trainer_test.py::test_lora_with_tied_embeddings"
)
results=()
for row in "${ROWS[@]}"; do
  torch_version="${row%%==*}" python_version="${row##*==}"
  venv="$CACHE/matrix-torch-$torch_version"
  requirements="$CACHE/matrix-torch-$torch_version.txt"
  mkdir -p "$CACHE"
  printf 'torch==%s\n%s\npytest\nninja\nsetuptools>=70.1\n' "$torch_version" "$HF_PINS" > "$requirements"
  start=$SECONDS
  log="$CACHE/matrix-torch-$torch_version.log"
  if ! bash "$ROOT/scripts/pip_venv.sh" "$venv" "$(find_python "$python_version")" "$requirements" 2>&1 | tee "$log"; then
    results+=("| $torch_version | $python_version | build failed ($log) | | |")
    continue
  fi
  setup_s=$((SECONDS - start)) start=$SECONDS
  status=passed
  CKPT_OFFLOAD_VENV_LOCK="$requirements" OMP_NUM_THREADS=1 \
    PYTHONPATH="$ROOT/tests/hf_integration:$ROOT/tests/torch_plugin" \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}" 2>&1 | tee -a "$log" || status=FAILED
  summary="$(tail -n 1 "$log")"
  results+=("| $torch_version | $python_version | $(grep -E 'packages installed|built in' "$log" | sed -E 's/.*(packages installed in|built in) //' | paste -sd/ - || true) ($setup_s s in all) | $status: $summary | $((SECONDS - start)) s |")
done
echo
echo "| torch | Python | install / build s (this run) | tests | tests s |"
echo "|---|---|---|---|---|"
printf '%s\n' "${results[@]}"
