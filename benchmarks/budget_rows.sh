#!/bin/bash
# The memory-budget rows of benchmarks/results, on the device machine, in parts that each fit
# one device call: bash benchmarks/budget_rows.sh PART (OUT: where logs go; CKPT_OFFLOAD_COMMIT:
# the tree's commit, the device copy has no usable git metadata). Every row runs through
# budget_retries.py: budget_bench.py with each step's allocator retries, CPU time and host
# load in its log, so that a slow row says whether the allocator or the host made it slow.
#   caps   today's memory (--budget 29GiB: ckpt_offload alone allocates 27.4 GiB at its peak
#          and runs out of memory with the allocator held to 28), 40 and 80 GiB caps, s8k
#   full   the whole card and 80 GiB at s16k
#   tests  the GPU budget tests (tests/gpu/budget_gpu_test.py: plans at a cap, step times,
#          the back-off after a real out-of-memory error)
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
#   var_ratio the var run with measured_length_ratio 2: a step more than twice as short as
#          every measured one is measured itself (MEASURED_LENGTH_RATIO, off by default)
#   liger  Liger's fused linear cross-entropy (.peers/site, tools/gpu_peers.sh): 8B at 80 GiB,
#          s8k and s16k, with ckpt_offload today beside the budget
#   liger_full the same with Liger's default model patch (its rotary embedding, RMSNorm and
#          SwiGLU too: what Axolotl's Liger plugin turns on)
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
bench_py=$PWD/benchmarks/budget_retries.py
tests=$PWD/tests
# bench NAME SECONDS ARGS...: budget_retries.py ARGS, its report in $OUT/NAME and its output in
# $OUT/NAME.log, stopped after SECONDS.
bench() {
  local name=$1 seconds=$2
  shift 2
  timeout "$seconds" python3 "$bench_py" "$@" --out "$OUT/$name" > "$OUT/$name.log" 2>&1
}
# gpu_tests SECONDS TESTS...: pytest of TESTS (under tests/), its output in $OUT/pytest.log.
gpu_tests() {
  local seconds=$1
  shift
  (cd "$tests" && timeout "$seconds" python3 -m pytest -q -s -p no:cacheprovider "$@") \
    > "$OUT/pytest.log" 2>&1
}
cd /tmp
case $part in
  caps)
    bench today 150 --configs llama3-8b:8192:full \
      --modes ckpt,ckpt_offload,budget,budget_keep --budget 29GiB --rounds 3 --empty-cache
    bench caps 300 --configs llama3-8b:8192:40,llama3-8b:8192:80 \
      --modes ckpt,budget,budget_keep --rounds 3 --empty-cache ;;
  full)
    bench full 150 --configs llama3-8b:8192:full --modes ckpt,budget,none --rounds 3 \
      --empty-cache
    bench s16k 240 --configs llama3-8b:16384:80 --modes ckpt,budget,budget_keep --rounds 2 \
      --empty-cache ;;
  tests)
    gpu_tests 400 gpu/budget_gpu_test.py ;;
  var)
    bench var 560 --var llama3-8b:4096:32768:100:80 ;;
  held)
    for row in 8192:38:ckpt,budget 16384:75:ckpt,budget; do
      IFS=: read -r seq gib modes <<< "$row"
      bench "held_${seq}_$gib" 170 --configs "llama3-8b:$seq:$gib" --modes "$modes" \
        --budget "${gib}GiB" --rounds 2 --empty-cache
      rm -f "$OUT/held_${seq}_$gib/budget_bench.md"  # the log has its table (8 files come back)
    done ;;
  shares)
    bench shares_29 220 --configs llama3-8b:8192:full \
      --modes ckpt,budget,budget@0.8,budget@0.95,budget@1.0 --budget 29GiB --rounds 3 \
      --empty-cache
    bench shares_40 150 --configs llama3-8b:8192:40 --modes ckpt,budget,budget@0.95 \
      --rounds 3 --empty-cache
    rm -f "$OUT"/shares_*/budget_bench.md  # the logs have their tables (8 files come back)
    gpu_tests 120 gpu/budget_gpu_test.py \
      "gpu/torch_gpu_test.py::test_doctor_reports_the_engines_own_pinning_and_the_copies" ;;
  res)
    bench res_8k 160 --configs llama3-8b:8192:full --modes ckpt,budget,budget_res --rounds 3 \
      --empty-cache
    bench res_16k 260 --configs llama3-8b:16384:80 --modes ckpt,budget,budget_res --rounds 2 \
      --empty-cache
    rm -f "$OUT"/res_*/budget_bench.md ;;
  fair)
    bench fair_8k 200 --configs llama3-8b:8192:full,llama3-8b:8192:80 \
      --modes ckpt,budget,none,every_n --rounds 2 --empty-cache
    bench fair_32k 200 --configs llama3-8b:32768:80 --modes ckpt,ckpt_offload,budget \
      --rounds 2 --empty-cache
    bench fair_1b 120 --configs llama3-1b:8192:full \
      --modes ckpt,budget,none,every_n --rounds 3 --empty-cache
    rm -f "$OUT"/fair_*/budget_bench.md ;;
  predict)
    bench predict_1b 100 --configs llama3-1b:8192:full --modes ckpt,budget,none --rounds 3 \
      --empty-cache
    bench predict_8b 200 \
      --configs llama3-8b:8192:full,llama3-8b:8192:80,llama3-8b:16384:80 \
      --modes ckpt,budget,none --rounds 2 --empty-cache
    rm -f "$OUT"/predict_*/budget_bench.md
    gpu_tests 130 gpu/budget_gpu_test.py ;;
  long)
    bench long 200 --var llama3-8b:28672:32768:12:80 ;;
  var_ratio)
    bench var_ratio 560 --var llama3-8b:4096:32768:100:80 --measured-length-ratio 2 ;;
  liger)
    bench liger 200 --loss liger --configs llama3-8b:8192:80,llama3-8b:16384:80 \
      --modes ckpt,ckpt_offload,budget --rounds 2 --empty-cache
    rm -f "$OUT"/liger/budget_bench.md ;;
  liger_full)
    bench liger_full 200 --loss liger_full --configs llama3-8b:8192:80,llama3-8b:16384:80 \
      --modes ckpt,ckpt_offload,budget --rounds 2 --empty-cache
    rm -f "$OUT"/liger_full/budget_bench.md ;;
esac
echo "part $part done"
