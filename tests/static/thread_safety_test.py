"""clang's thread-safety analysis over every C++ translation unit of offload_core/ and
torch_plugin/csrc/ (-fsyntax-only -Wthread-safety -Werror=thread-safety).

Include paths are the ones the builds use: abseil from /usr/include, torch's headers (and
its pybind11) from the interpreter's torch, Python's headers, and CUDA's from
/usr/local/cuda/include when present. Without CUDA headers the CUDA-only sources are
reported as skipped and the rest is still checked."""

import concurrent.futures
import os
import pathlib
import shutil
import subprocess
import sysconfig

import pytest
import torch

CLANG = os.environ.get("CKPT_OFFLOAD_CLANG", "clang++-14")
CUDA_INCLUDE = pathlib.Path(os.environ.get("CKPT_OFFLOAD_CUDA_HOME", "/usr/local/cuda")) / "include"
HAS_CUDA = (CUDA_INCLUDE / "cuda_runtime.h").exists()
# Sources that include CUDA's headers unconditionally.
CUDA_ONLY = {"offload_core/cuda_device.cc"}


def workspace_root():
    """The runfiles' copy of the repository (the directory holding offload_core/)."""
    runfiles = pathlib.Path(os.environ.get("TEST_SRCDIR", ""))
    workspace = os.environ.get("TEST_WORKSPACE", "ckpt_offload")
    for root in (runfiles / workspace, pathlib.Path(__file__).resolve().parents[2]):
        if (root / "offload_core").is_dir():
            return root
    raise RuntimeError("no offload_core/ in the runfiles")


ROOT = workspace_root()
SOURCES = sorted(str(p.relative_to(ROOT)) for p in
                 [*ROOT.glob("offload_core/*.cc"), *ROOT.glob("torch_plugin/csrc/*.cc")])


def flags():
    torch_include = pathlib.Path(torch.__file__).parent / "include"
    args = [
        "-std=c++17", "-fsyntax-only",
        # torch's headers are not clean under clang's other warnings; only ours matter.
        "-Wno-everything", "-Wthread-safety", "-Werror=thread-safety",
        f"-I{ROOT}",
        "-isystem", str(torch_include),
        "-isystem", str(torch_include / "torch/csrc/api/include"),
        "-isystem", sysconfig.get_paths()["include"],
        "-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H",
    ]
    if HAS_CUDA:
        args += ["-isystem", str(CUDA_INCLUDE)]
        if torch.version.cuda:
            args += ["-DCKPT_OFFLOAD_WITH_CUDA"]
    return args


def check(source):
    command = [CLANG, *flags(), str(ROOT / source)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    return source, result.returncode, result.stderr


def test_sources_found():
    assert "offload_core/engine.cc" in SOURCES
    assert "torch_plugin/csrc/tensor_offloader.cc" in SOURCES


def test_every_translation_unit_passes_thread_safety_analysis():
    if shutil.which(CLANG) is None:
        pytest.fail(f"{CLANG} not found: scripts/setup.sh installs clang-14")
    sources = [s for s in SOURCES if HAS_CUDA or s not in CUDA_ONLY]
    skipped = sorted(set(SOURCES) - set(sources))
    if skipped:
        print(f"no CUDA headers at {CUDA_INCLUDE}: not checked: {', '.join(skipped)}")
    workers = max(1, min(4, len(os.sched_getaffinity(0))))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(check, sources))
    failures = [f"--- {source} (exit {code})\n{stderr}" for source, code, stderr in results
                if code != 0]
    assert not failures, "\n".join(failures)
