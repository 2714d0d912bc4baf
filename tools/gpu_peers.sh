#!/usr/bin/env bash
# Run HERE before a GPU-machine benchmark call: fetches the peers' wheels from PyPI and
# keeps only the module files that benchmarks/gpu_bench.py loads (their packages' own
# __init__ pulls in much more, and axolotl pins a newer torch than the GPU machine has)
# in .peers/ (git-ignored), which the call carries. Versions: CKPT_OFFLOAD_PEERS.
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS="${CKPT_OFFLOAD_PEERS:-trl==1.16.0 axolotl==0.21.0}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$work" $PEERS
rm -rf .peers && mkdir -p .peers
for wheel in "$work"/*.whl; do
  python3 - "$wheel" <<'PY'
import sys, zipfile
keep = ("trl/models/activation_offloading.py",
        "axolotl/monkeypatch/checkpoint_activation_offload.py")
with zipfile.ZipFile(sys.argv[1]) as wheel:
    for name in wheel.namelist():
        if name in keep:
            wheel.extract(name, ".peers")
            print("peer module:", name, "from", sys.argv[1].rsplit("/", 1)[-1])
PY
done
echo "$PEERS" > .peers/VERSIONS
grep -qxF '/.peers/' .git/info/exclude 2>/dev/null || echo '/.peers/' >> .git/info/exclude
