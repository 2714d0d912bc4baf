#!/usr/bin/env bash
# README command 1: set up, then a tiny Llama fine-tune with HF Trainer with and without
# offload (GPU if present, else CPU through the host backend), printing a comparison table.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
bazel run //benchmarks:demo -- "$@"
