#!/usr/bin/env bash
# README command 2: set up, then every test (C++ and Python) with Bazel.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
bazel test //... "$@"
bash "$ROOT/scripts/fuzz.sh"  # libFuzzer targets, FUZZ_SECONDS each (default 60)
