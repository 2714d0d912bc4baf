"""`pip wheel --no-build-isolation` builds ckpt_offload._C and ckpt_offload._plan from the same
sources as Bazel, against abseil in a prefix of its own (the copy tools/gpu_deps.sh makes,
found through CKPT_OFFLOAD_ABSL_PREFIX: the search and RPATH path, not the system's), and
the wheel works in a fresh venv that has only torch and what torch requires."""

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata

SOURCE_DIRS = ("offload_core", "torch_plugin", "hf_integration")
SOURCE_FILES = ("setup.py", "pyproject.toml", "sources.bzl")

SMOKE = """
import os, sys, torch, ckpt_offload, ckpt_offload._C, ckpt_offload._plan
assert sys.prefix != sys.base_prefix, "not in the venv"
for absent in ("transformers", "peft", "pytest"):
    try:
        __import__(absent)
    except ImportError:
        pass
    else:
        raise AssertionError(absent + " is importable: the venv is not torch-only")
assert ckpt_offload.__file__.startswith(sys.prefix), ckpt_offload.__file__
layer = torch.nn.Linear(64, 64)
x = torch.randn(8, 64)
with ckpt_offload.offload_activations(backend="host", min_offload_bytes=0, keep_last=0) as e:
    y = ckpt_offload.checkpoint(layer, x * 1.0)
    y.sum().backward()
s = e.stats()
assert s["offloaded_tensors"] == 1 and s["restored_tensors"] == 1, s
assert '"model": "llama-1b"' in ckpt_offload._plan.run(["--preset=llama-1b", "--json"])
print("pip build ok", ckpt_offload._C.__file__, ckpt_offload._plan.__file__)
"""


def workspace_root():
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.dirname(os.path.dirname(here))


def gpu_deps_script(root):
    """tools/gpu_deps.sh from the runfiles (tests/torch_plugin/BUILD lists it), else from
    the source tree this test lives in."""
    for base in (root, os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.realpath(__file__))))):
        path = os.path.join(base, "tools", "gpu_deps.sh")
        if os.path.isfile(path):
            return path
    raise AssertionError("tools/gpu_deps.sh not found")


def torch_closure():
    """torch's distribution and every installed one it requires (markers true here, no
    extras), transitively."""
    from pip._vendor.packaging.requirements import Requirement

    seen, todo = {}, ["torch"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen[name] = dist
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name.lower().replace("_", "-"))
    return seen.values()


def torch_only_site(dest):
    """A directory of links to torch's and its requirements' files, nothing else."""
    os.makedirs(dest)
    for dist in torch_closure():
        site = str(dist.locate_file(""))
        entries = {f.parts[0] for f in dist.files or []} - {"..", "__pycache__"}
        for entry in entries:
            link = os.path.join(dest, entry)
            if not os.path.lexists(link) and os.path.exists(os.path.join(site, entry)):
                os.symlink(os.path.join(site, entry), link)
    return dest


def fresh_venv(work):
    """A new venv over this interpreter whose site-packages has only torch's files."""
    venv = os.path.join(work, "venv")
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", venv],
                   check=True)
    python = os.path.join(venv, "bin", "python")
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, "torch_only.pth"), "w") as f:
        f.write(torch_only_site(os.path.join(work, "torch_only")) + "\n")
    return python


def dynamic_section(path):
    return subprocess.run(["readelf", "-d", path], check=True, capture_output=True,
                          text=True).stdout


def test_wheel_with_abseil_from_a_prefix_imports_in_a_torch_only_venv():
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
    prefix = os.path.join(work, "absl_prefix")
    subprocess.run(["bash", gpu_deps_script(root), prefix], check=True)

    wheels = os.path.join(work, "wheels")
    env = dict(os.environ, MAX_JOBS="2", CKPT_OFFLOAD_ABSL_PREFIX=prefix)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation",
                            "--no-deps", "--no-index", "-v", "-w", wheels, src], env=env,
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-5000:] + build.stderr[-5000:]
    assert f"abseil from CKPT_OFFLOAD_ABSL_PREFIX {prefix} (pkg-config)" in \
        build.stdout + build.stderr
    wheel = [os.path.join(wheels, w) for w in os.listdir(wheels) if w.endswith(".whl")]
    assert len(wheel) == 1, wheel
    names = zipfile.ZipFile(wheel[0]).namelist()
    for module in ("ckpt_offload/plan.py", "ckpt_offload/doctor.py", "ckpt_offload/hf/__init__.py",
                   "ckpt_offload/axolotl/__init__.py"):
        assert module in names, (module, names)

    python = fresh_venv(work)
    subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel[0]],
                   check=True)
    out = subprocess.run([python, "-c", SMOKE], capture_output=True, text=True, cwd=work,
                         env=dict(os.environ, PYTHONPATH=""))
    assert out.returncode == 0, out.stderr
    assert "pip build ok" in out.stdout
    c_path, plan_path = out.stdout.split()[-2:]

    # abseil resolves from the prefix through the RPATH; the planner module needs no torch.
    prefix_lib = os.path.join(prefix, "lib")
    assert "RPATH" in dynamic_section(c_path) and prefix_lib in dynamic_section(c_path)
    ldd = subprocess.run(["ldd", c_path], capture_output=True, text=True, check=True).stdout
    assert "libabsl_status.so" in ldd and prefix_lib in ldd, ldd
    assert "libtorch" not in dynamic_section(plan_path)
    assert "libnuma" not in dynamic_section(c_path)

    venv_env = dict(os.environ, PYTHONPATH="")
    for module, args, expected in (
            ("ckpt_offload.plan", ["--preset=llama-8b", "--seq=8192"], "exposed transfer per step"),
            ("ckpt_offload.doctor", [], "round trip (host backend)")):
        run = subprocess.run([python, "-m", module, *args], capture_output=True, text=True,
                             cwd=work, env=venv_env)
        assert run.returncode == 0, (module, run.stderr)
        assert expected in run.stdout, (module, run.stdout)
