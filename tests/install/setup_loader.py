"""setup.py as a module, for the tests of its checks and its abseil search: the source
tree's root, the files a build of setup.py alone reads, and the loader."""

import importlib.util
import pathlib
import shutil

ROOT = pathlib.Path(__file__).resolve().parents[2]
# What setup.py reads before it compiles anything (its checks, the abseil search).
BUILD_FILES = ("setup.py", "pyproject.toml", "sources.bzl",
               "torch_plugin/ckpt_offload/versions.py")


def load_setup():
    spec = importlib.util.spec_from_file_location("ckpt_offload_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def copy_build_files(dest):
    """BUILD_FILES under `dest`, laid out as in the tree."""
    for name in BUILD_FILES:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, dest / name)
