#!/usr/bin/env bash
# One GPU-machine call: the GPU suite and/or benchmarks, logs packed into $OUT/gpu_logs.tgz
# (the device tool returns at most 8 files). Usage on the GPU machine, from the repo root:
#   CKPT_OFFLOAD_COMMIT=<hash> bash tools/gpu_call.sh "suite" "bench:<gpu_bench args>" ...
# Write the hash out here: the device's copy of the tree may carry stale git metadata, so
# `$(git rev-parse HEAD)` run there can name an older commit than the one that runs.
# Jobs: suite | pytest:<args> | py:<args> (python3 <args> from tests/) | bench:<args> |
#       packbench:<source tree of the base to compare with> | real:<real_bench args> |
#       trl:<trl_bench args>
set -uo pipefail
LOGS=/tmp/gpu_logs
rm -rf "$LOGS" && mkdir -p "$LOGS"
export CKPT_OFFLOAD_PEERS_DIR="$(pwd)/.peers" PYTHONUNBUFFERED=1
export CKPT_OFFLOAD_PEERS="$(cat .peers/VERSIONS 2>/dev/null)"
# The fused losses' pure-Python packages (tools/gpu_peers.sh).
export PYTHONPATH="$(pwd)/.peers/site${PYTHONPATH:+:$PYTHONPATH}"
status=0
installed=0
# A warm machine keeps what an earlier call installed: skip the build when this commit is in.
STAMP="/tmp/ckpt_offload_installed_${CKPT_OFFLOAD_COMMIT:-unknown}"
[ -f "$STAMP" ] && [ -n "${CKPT_OFFLOAD_COMMIT:-}" ] && installed=1
install_once() {
  [ "$installed" = 1 ] && return
  CKPT_OFFLOAD_ABSL_PREFIX="$(pwd)/.gpu_deps/absl" MAX_JOBS=16 \
    python3 -m pip install --no-build-isolation --no-deps -q . > "$LOGS/pip_install.log" 2>&1 \
    || { tail -30 "$LOGS/pip_install.log"; status=1; }
  [ "$status" = 0 ] && touch "$STAMP"
  installed=1
}
for job in "$@"; do
  case "$job" in
    suite)
      bash tests/gpu/run_gpu_suite.sh "$LOGS/suite" || status=1
      python3 -c "import ckpt_offload" 2>/dev/null && touch "$STAMP"
      installed=1 ;;
    pytest:*)
      install_once
      # shellcheck disable=SC2086
      (cd tests && python3 -m pytest -q -s -p no:cacheprovider ${job#pytest:}) 2>&1 \
        | tee -a "$LOGS/pytest.log" || status=1 ;;
    py:*)
      install_once
      # shellcheck disable=SC2086
      (cd tests && python3 ${job#py:}) 2>&1 | tee -a "$LOGS/py.log" || status=1 ;;
    packbench:*)
      # pack_bench of this tree against another source tree (its path after the colon,
      # e.g. a `git archive` of the base commit), alternating processes, 3 rounds each.
      install_once
      base_src=${job#packbench:}
      CKPT_OFFLOAD_ABSL_PREFIX="$(pwd)/.gpu_deps/absl" MAX_JOBS=16 python3 -m pip install \
        --no-build-isolation --no-deps -q --target /tmp/pack_base "$base_src" \
        > "$LOGS/pack_base_install.log" 2>&1 || status=1
      for round in 1 2 3; do
        for side in base current; do
          path=/tmp/pack_base; [ "$side" = current ] && path=""
          echo "== round $round: $side" | tee -a "$LOGS/pack_bench.log"
          (cd /tmp && PYTHONPATH="$path" python3 "$OLDPWD/benchmarks/pack_bench.py") 2>&1 \
            | tee -a "$LOGS/pack_bench.log" || status=1
        done
      done ;;
    bench:*)
      install_once
      mkdir -p "$LOGS/bench"
      # shellcheck disable=SC2086
      (cd /tmp && python3 "$OLDPWD/benchmarks/gpu_bench.py" ${job#bench:} --out "$LOGS/bench") \
        2>&1 | tee -a "$LOGS/bench/bench.log" || status=1 ;;
    real:*)
      install_once
      mkdir -p "$LOGS/real"
      # shellcheck disable=SC2086
      (cd /tmp && python3 "$OLDPWD/benchmarks/real_bench.py" ${job#real:} --out "$LOGS/real") \
        2>&1 | tee -a "$LOGS/real/real.log" || status=1 ;;
    trl:*)
      install_once
      mkdir -p "$LOGS/trl"
      # shellcheck disable=SC2086
      (cd /tmp && python3 "$OLDPWD/benchmarks/trl_bench.py" ${job#trl:} --out "$LOGS/trl") \
        2>&1 | tee -a "$LOGS/trl/trl.log" || status=1 ;;
    *) echo "unknown job $job"; status=1 ;;
  esac
  # After every job: a call that runs past its time limit still returns what finished.
  tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
done
exit $status
