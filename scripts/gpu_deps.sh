#!/usr/bin/env bash
# Copies what the pip build needs but a bare GPU machine lacks (Debian's abseil headers and
# shared libraries) into .gpu_deps/, which the GPU runs carry. Run here, not there.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu_deps/absl
rm -rf "$out" && mkdir -p "$out/include" "$out/lib"
cp -r /usr/include/absl "$out/include/"
cp -P /usr/lib/x86_64-linux-gnu/libabsl_*.so* "$out/lib/"
grep -qxF '/.gpu_deps/' .git/info/exclude 2>/dev/null || echo '/.gpu_deps/' >> .git/info/exclude
du -sh .gpu_deps
