#!/usr/bin/env bash
# Copies what the pip build needs but a bare GPU machine lacks (Debian's abseil: headers,
# shared libraries and pkg-config files) into the prefix .gpu_deps/absl, which the GPU runs
# carry. Run here, not there. The pip build finds it through
#   CKPT_OFFLOAD_ABSL_PREFIX="$PWD/.gpu_deps/absl"
# (setup.py reads the .pc files itself when the machine has no pkg-config). The .pc files
# name their directories relative to their own (${pcfiledir}), so the copy works wherever
# it lands. An argument puts the prefix elsewhere (tests/torch_plugin/pip_build_test.py).
set -euo pipefail
out="${1:-}"
[ -z "$out" ] || out="$(mkdir -p "$out" && cd "$out" && pwd)"
cd "$(dirname "$0")/.."
if [ -n "$out" ]; then
  trap 'du -sh "$out"' EXIT
else
  out=.gpu_deps/absl
  grep -qxF '/.gpu_deps/' .git/info/exclude 2>/dev/null || echo '/.gpu_deps/' >> .git/info/exclude
  trap 'du -sh .gpu_deps' EXIT
fi
multiarch=/usr/lib/x86_64-linux-gnu
rm -rf "$out" && mkdir -p "$out/include" "$out/lib/pkgconfig"
cp -r /usr/include/absl "$out/include/"
cp -P "$multiarch"/libabsl_*.so* "$out/lib/"
for pc in "$multiarch"/pkgconfig/absl_*.pc; do
  sed -e 's|^prefix=.*|prefix=${pcfiledir}/../..|' \
      -e "s|^libdir=.*|libdir=\${prefix}/lib|" \
      -e "s|^includedir=.*|includedir=\${prefix}/include|" "$pc" > "$out/lib/pkgconfig/$(basename "$pc")"
done
