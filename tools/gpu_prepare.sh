#!/usr/bin/env bash
# Run HERE before a GPU-machine call: builds the gtest binaries that need a GPU with Bazel
# and copies them and the libraries the GPU machine lacks into git-ignored folders the call
# carries (.gpu_deps, .gpu_bin, .peers).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash tools/gpu_deps.sh
source scripts/env.sh
targets=(//tests/gpu:cuda_device_test //tests/torch_plugin:session_test //benchmarks:pin_cuda_bench)
bazel build -c opt "${targets[@]}"
rm -rf .gpu_bin && mkdir -p .gpu_bin
for t in "${targets[@]}"; do
  path="bazel-bin/$(echo "${t#//}" | tr ':' '/')"
  cp -L "$path" .gpu_bin/
done
for d in /.gpu_bin/ /.peers/; do grep -qxF "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
du -sh .gpu_deps .gpu_bin .peers 2>/dev/null || true
