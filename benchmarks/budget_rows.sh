#!/bin/bash
# The memory-budget rows of benchmarks/results, on the device machine, in parts that each fit
# one device call: bash benchmarks/budget_rows.sh PART (OUT: where logs go; CKPT_OFFLOAD_COMMIT:
# the tree's commit, the device copy has no usable git metadata).
#   caps   today's memory (--budget 29GiB: ckpt_offload alone allocates 27.4 GiB at its peak
#          and runs out of memory with the allocator held to 28), 40 and 80 GiB caps, s8k
#   full   the whole card and 80 GiB at s16k; the GPU budget tests
#   var    100 steps of random lengths in [4096, 32768] under "auto", 80 GiB
#   held   the budget as the cap (the allocator may reserve no more than the budget):
#          38 GiB at s8k, 75 GiB at s16k (at 28 GiB, s8k, ckpt_offload alone runs out)
#   shares copy-window shares side by side (budget@S) at today's memory (29) and 40 GiB, s8k;
#          the GPU budget tests and the doctor's copy figures
#   res    resident layers offloading saved storages (budget_res) beside the default budget:
#          the whole card at s8k and 80 GiB at s16k
#   fair   the fair baselines beside the budget: no checkpointing and the best every_n_layers
#          (whole card and 80 GiB, s8k), s32k at 80 GiB, and the 1B shape on the whole card
#          (1B s32k under 40 GiB runs out of memory in every mode, checkpointing included:
#          the model's own loss asks for 15.7 GiB of float32 logits)
#   predict the planner's time and peak against the measured step: 1B and 8B s8k on the whole
#          card (no checkpointing beside them: what a layer really costs), 8B s8k at 80 GiB
#          and s16k at 80 GiB; the GPU budget tests
#   long   12 steps of random lengths in [28672, 32768] under "auto", the whole card (80 GiB
#          on the H100): the long changed-length steps whose logits reserve leaves no room
#          beside their checkpointed peak
#   liger  Liger's fused linear cross-entropy (.peers/site, tools/gpu_peers.sh): 8B at 80 GiB,
#          s8k and s16k, with ckpt_offload today beside the budget
set -u
part=$1
export PYTHONUNBUFFERED=1
# The fused losses' pure-Python packages, where tools/gpu_peers.sh put them.
[ -d .peers/site ] && export PYTHONPATH="$PWD/.peers/site${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c "import ckpt_offload._native" 2>/dev/null; then
  CKPT_OFFLOAD_ABSL_PREFIX=$PWD/.gpu_deps/absl MAX_JOBS=16 \
    python3 -m pip install --no-build-isolation --no-deps -q . > "$OUT/pip_$part.log" 2>&1
fi
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
bench=$PWD/benchmarks/budget_bench.py
tests=$PWD/tests
cd /tmp
case $part in
  caps)
    timeout 150 python3 "$bench" --configs llama3-8b:8192:full \
      --modes ckpt,ckpt_offload,budget,budget_keep --budget 29GiB --rounds 3 --empty-cache \
      --out "$OUT/today" > "$OUT/today.log" 2>&1
    timeout 300 python3 "$bench" --configs llama3-8b:8192:40,llama3-8b:8192:80 \
      --modes ckpt,budget,budget_keep --rounds 3 --empty-cache \
      --out "$OUT/caps" > "$OUT/caps.log" 2>&1 ;;
  full)
    timeout 150 python3 "$bench" --configs llama3-8b:8192:full --modes ckpt,budget,none \
      --rounds 3 --empty-cache --out "$OUT/full" > "$OUT/full.log" 2>&1
    timeout 240 python3 "$bench" --configs llama3-8b:16384:80 --modes ckpt,budget,budget_keep \
      --rounds 2 --empty-cache --out "$OUT/s16k" > "$OUT/s16k.log" 2>&1
    (cd "$tests" && timeout 100 python3 -m pytest -q -s -p no:cacheprovider \
      gpu/budget_gpu_test.py) > "$OUT/pytest.log" 2>&1 ;;
  var)
    timeout 560 python3 "$bench" --var llama3-8b:4096:32768:100:80 \
      --out "$OUT/var" > "$OUT/var.log" 2>&1 ;;
  held)
    for row in 8192:38:ckpt,budget 16384:75:ckpt,budget; do
      IFS=: read -r seq gib modes <<< "$row"
      timeout 170 python3 "$bench" --configs "llama3-8b:$seq:$gib" --modes "$modes" \
        --budget "${gib}GiB" --rounds 2 --empty-cache \
        --out "$OUT/held_${seq}_$gib" > "$OUT/held_${seq}_$gib.log" 2>&1
      rm -f "$OUT/held_${seq}_$gib/budget_bench.md"  # the log has its table (8 files come back)
    done ;;
  shares)
    timeout 220 python3 "$bench" --configs llama3-8b:8192:full \
      --modes ckpt,budget,budget@0.8,budget@0.95,budget@1.0 --budget 29GiB --rounds 3 \
      --empty-cache --out "$OUT/shares_29" > "$OUT/shares_29.log" 2>&1
    timeout 150 python3 "$bench" --configs llama3-8b:8192:40 --modes ckpt,budget,budget@0.95 \
      --rounds 3 --empty-cache --out "$OUT/shares_40" > "$OUT/shares_40.log" 2>&1
    rm -f "$OUT"/shares_*/budget_bench.md  # the logs have their tables (8 files come back)
    (cd "$tests" && timeout 120 python3 -m pytest -q -s -p no:cacheprovider \
      gpu/budget_gpu_test.py "gpu/torch_gpu_test.py::test_doctor_reports_the_engines_own_pinning_and_the_copies") \
      > "$OUT/pytest.log" 2>&1 ;;
  res)
    timeout 160 python3 "$bench" --configs llama3-8b:8192:full --modes ckpt,budget,budget_res \
      --rounds 3 --empty-cache --out "$OUT/res_8k" > "$OUT/res_8k.log" 2>&1
    timeout 260 python3 "$bench" --configs llama3-8b:16384:80 --modes ckpt,budget,budget_res \
      --rounds 2 --empty-cache --out "$OUT/res_16k" > "$OUT/res_16k.log" 2>&1
    rm -f "$OUT"/res_*/budget_bench.md ;;
  fair)
    timeout 200 python3 "$bench" --configs llama3-8b:8192:full,llama3-8b:8192:80 \
      --modes ckpt,budget,none,every_n --rounds 2 --empty-cache \
      --out "$OUT/fair_8k" > "$OUT/fair_8k.log" 2>&1
    timeout 200 python3 "$bench" --configs llama3-8b:32768:80 --modes ckpt,ckpt_offload,budget \
      --rounds 2 --empty-cache --out "$OUT/fair_32k" > "$OUT/fair_32k.log" 2>&1
    timeout 120 python3 "$bench" --configs llama3-1b:8192:full \
      --modes ckpt,budget,none,every_n --rounds 3 --empty-cache \
      --out "$OUT/fair_1b" > "$OUT/fair_1b.log" 2>&1
    rm -f "$OUT"/fair_*/budget_bench.md ;;
  predict)
    timeout 100 python3 "$bench" --configs llama3-1b:8192:full --modes ckpt,budget,none \
      --rounds 3 --empty-cache --out "$OUT/predict_1b" > "$OUT/predict_1b.log" 2>&1
    timeout 200 python3 "$bench" --configs llama3-8b:8192:full,llama3-8b:8192:80,llama3-8b:16384:80 \
      --modes ckpt,budget,none --rounds 2 --empty-cache \
      --out "$OUT/predict_8b" > "$OUT/predict_8b.log" 2>&1
    rm -f "$OUT"/predict_*/budget_bench.md
    (cd "$tests" && timeout 130 python3 -m pytest -q -s -p no:cacheprovider \
      gpu/budget_gpu_test.py) > "$OUT/pytest.log" 2>&1 ;;
  long)
    timeout 200 python3 "$bench" --var llama3-8b:28672:32768:12:80 \
      --out "$OUT/long" > "$OUT/long.log" 2>&1 ;;
  liger)
    timeout 200 python3 "$bench" --loss liger --configs llama3-8b:8192:80,llama3-8b:16384:80 \
      --modes ckpt,ckpt_offload,budget --rounds 2 --empty-cache \
      --out "$OUT/liger" > "$OUT/liger.log" 2>&1
    rm -f "$OUT"/liger/budget_bench.md ;;
esac
echo "part $part done"
