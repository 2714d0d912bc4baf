#!/usr/bin/env bash
# Run HERE before a GPU-machine benchmark call: fetches the peers' and the fused losses'
# packages from PyPI into .peers/ (git-ignored), which the call carries. Versions:
# CKPT_OFFLOAD_PEERS (peers: only the module files the benchmarks load, since their
# packages' __init__ pulls in much more, axolotl pins a newer torch and deepspeed builds
# ops) and CKPT_OFFLOAD_FUSED_LOSSES (whole pure-Python wheels, unpacked into
# .peers/site/, which tools/gpu_call.sh puts on PYTHONPATH).
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS="${CKPT_OFFLOAD_PEERS:-trl==1.16.0 axolotl==0.21.0}"
PEER_SDISTS="${CKPT_OFFLOAD_PEER_SDISTS:-deepspeed==0.19.8}"
FUSED_LOSSES="${CKPT_OFFLOAD_FUSED_LOSSES:-liger-kernel==0.8.5 cut-cross-entropy==25.1.1}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$work/peers" $PEERS
python3 -m pip download -q --no-deps --no-binary=:all: -d "$work/sdists" $PEER_SDISTS
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$work/losses" $FUSED_LOSSES
rm -rf .peers && mkdir -p .peers/site
python3 - "$work" <<'PY'
import glob, os, sys, tarfile, zipfile
work = sys.argv[1]
keep = ("trl/models/activation_offloading.py",
        "axolotl/monkeypatch/checkpoint_activation_offload.py",
        "deepspeed/runtime/activation_checkpointing/offload_activations.py")
for wheel_path in glob.glob(f"{work}/peers/*.whl"):
    with zipfile.ZipFile(wheel_path) as wheel:
        for name in wheel.namelist():
            if name in keep:
                wheel.extract(name, ".peers")
                print("peer module:", name, "from", os.path.basename(wheel_path))
for sdist_path in glob.glob(f"{work}/sdists/*.tar.gz"):
    with tarfile.open(sdist_path) as sdist:
        for member in sdist.getmembers():
            name = member.name.split("/", 1)[-1]
            if name in keep:
                member.name = name
                sdist.extract(member, ".peers", filter="data")
                print("peer module:", name, "from", os.path.basename(sdist_path))
for wheel_path in glob.glob(f"{work}/losses/*.whl"):
    with zipfile.ZipFile(wheel_path) as wheel:
        wheel.extractall(".peers/site")
        print("fused loss package:", os.path.basename(wheel_path))
PY
echo "$PEERS $PEER_SDISTS $FUSED_LOSSES" > .peers/VERSIONS
grep -qxF '/.peers/' .git/info/exclude 2>/dev/null || echo '/.peers/' >> .git/info/exclude
