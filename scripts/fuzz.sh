#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/reliability/fuzz with clang-14
# (-fsanitize=fuzzer,address,undefined) and fuzzes each for a bounded time; fails when a
# target crashes or reports a broken invariant (the reproducer is kept and named).
#
#   scripts/fuzz.sh                      # every target, 60 s each
#   FUZZ_SECONDS=600 scripts/fuzz.sh arena_fuzz
#
# Environment: FUZZ_SECONDS (per target, default 60), FUZZ_OUT (binaries, the growing corpus
# and crash artifacts; default ${TMPDIR:-/tmp}/ckpt_offload_fuzz), CXX (default clang++-14).
# The seed corpus in tests/reliability/corpus/<target>/ is read, never written.
#
# The targets are compiled directly rather than through Bazel: Bazel 4.2.3's auto-configured
# toolchain is gcc, and switching it to clang (CC=clang-14) would reconfigure the C++
# toolchain for every other build of this shared workspace. They need only a few
# offload_core sources and Debian's abseil.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SECONDS_PER_TARGET="${FUZZ_SECONDS:-60}"
OUT="${FUZZ_OUT:-${TMPDIR:-/tmp}/ckpt_offload_fuzz}"
CXX="${CXX:-clang++-14}"

declare -A SOURCES=(
  [arena_fuzz]="offload_core/host_arena.cc"
  [engine_roundtrip_fuzz]="offload_core/host_arena.cc offload_core/fault_injection.cc
                           offload_core/host_device.cc offload_core/engine.cc"
)
ALL_TARGETS=(arena_fuzz engine_roundtrip_fuzz)
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then TARGETS=("${ALL_TARGETS[@]}"); fi

if ! command -v "$CXX" >/dev/null; then
  echo "fuzz.sh: $CXX not found (apt-get install clang-14 libclang-rt-14-dev)" >&2
  exit 1
fi
ABSL_LIBS="$(pkg-config --libs absl_status absl_statusor absl_strings)"
FLAGS=(-std=c++17 -g -O1 -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined
       -fno-sanitize-recover=undefined -I"$ROOT")

status=0
summary=()
for target in "${TARGETS[@]}"; do
  if [ -z "${SOURCES[$target]:-}" ]; then
    echo "fuzz.sh: unknown target '$target' (known: ${ALL_TARGETS[*]})" >&2
    exit 2
  fi
  dir="$OUT/$target"
  mkdir -p "$dir/corpus" "$dir/artifacts"
  sources=("$ROOT/tests/reliability/fuzz/$target.cc")
  for s in ${SOURCES[$target]}; do sources+=("$ROOT/$s"); done
  echo "fuzz.sh: building $target"
  # shellcheck disable=SC2086
  "$CXX" "${FLAGS[@]}" "${sources[@]}" -o "$dir/$target" $ABSL_LIBS
  echo "fuzz.sh: fuzzing $target for ${SECONDS_PER_TARGET}s"
  log="$dir/fuzz.log"
  rc=0
  # The first corpus directory receives new inputs; the seeds are only read.
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$dir/$target" -max_total_time="$SECONDS_PER_TARGET" -timeout=30 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="$dir/artifacts/" \
      "$dir/corpus" "$ROOT/tests/reliability/corpus/$target" >"$log" 2>&1 || rc=$?
  runs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)"
  corpus="$(find "$dir/corpus" -type f | wc -l)"
  if [ "$rc" -ne 0 ]; then
    status=1
    tail -n 60 "$log" >&2
    summary+=("$target: FAILED (exit $rc) after ${runs:-?} executions; artifacts in $dir/artifacts")
  else
    summary+=("$target: ok, ${runs:-?} executions in ${SECONDS_PER_TARGET}s, corpus $corpus inputs")
  fi
done
printf 'fuzz.sh: %s\n' "${summary[@]}"
exit "$status"
