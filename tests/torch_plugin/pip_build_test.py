"""`pip install --no-build-isolation .` builds ckpt_offload._C from the same sources as Bazel
and the installed package works (host backend round trip)."""

import os
import shutil
import subprocess
import sys
import tempfile

SOURCE_DIRS = ("offload_core", "torch_plugin", "hf_integration")
SOURCE_FILES = ("setup.py", "pyproject.toml", "sources.bzl")

SMOKE = """
import torch, ckpt_offload, ckpt_offload._C, ckpt_offload.hf
layer = torch.nn.Linear(64, 64)
x = torch.randn(8, 64)
with ckpt_offload.offload_activations(backend="host", min_offload_bytes=0, keep_last=0) as e:
    y = ckpt_offload.checkpoint(layer, x * 1.0)
    y.sum().backward()
s = e.stats()
assert s["offloaded_tensors"] == 1 and s["restored_tensors"] == 1, s
print("pip build ok", ckpt_offload._C.__file__)
"""


def workspace_root():
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.dirname(os.path.dirname(here))


def test_pip_build_from_the_same_sources_imports_and_offloads():
    root = workspace_root()
    work = os.environ.get("TEST_TMPDIR") or tempfile.mkdtemp()
    src = os.path.join(work, "src")
    shutil.rmtree(src, ignore_errors=True)
    os.makedirs(src)
    for name in SOURCE_DIRS:
        shutil.copytree(os.path.join(root, name), os.path.join(src, name), symlinks=False,
                        ignore=shutil.ignore_patterns("BUILD", "*.so", "__pycache__"))
    for name in SOURCE_FILES:
        shutil.copy(os.path.join(root, name), src)
    wheels = os.path.join(work, "wheels")
    env = dict(os.environ, MAX_JOBS="2")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                    "--no-index", "-q", "-w", wheels, src], check=True, env=env)
    site = os.path.join(work, "site")
    wheel = [os.path.join(wheels, w) for w in os.listdir(wheels) if w.endswith(".whl")]
    assert len(wheel) == 1, wheel
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                    "--target", site, wheel[0]], check=True)
    out = subprocess.run([sys.executable, "-c", SMOKE], check=True, capture_output=True,
                         text=True, cwd=work, env=dict(os.environ, PYTHONPATH=site))
    assert "pip build ok" in out.stdout
    assert out.stdout.strip().endswith(".so") and site in out.stdout
