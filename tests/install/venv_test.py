"""The pip-made test venv is what it claims to be (run through tests/venv_pytest.sh): the
expected torch, ckpt_offload installed by pip into it and built against that torch, with
the package metadata a pip user sees."""

import os
import sys
from importlib import metadata

import torch
from packaging.requirements import Requirement

import ckpt_offload
from ckpt_offload import versions
from ckpt_offload._native import _C


def locked(name):
    """The version the venv's lock pins for `name`."""
    with open(os.environ["CKPT_OFFLOAD_VENV_LOCK"]) as f:
        for line in f:
            package, _, version = line.strip().partition("==")
            if package.lower().replace("_", "-") == name:
                return version
    raise AssertionError(f"{name} is not pinned in {os.environ['CKPT_OFFLOAD_VENV_LOCK']}")


def test_torch_is_the_locked_tested_release():
    assert torch.__version__.split("+")[0] == locked("torch"), torch.__version__
    assert versions.torch_minor(torch.__version__) in versions.TORCH_MINORS


def test_ckpt_offload_is_the_pip_build_in_this_venv():
    assert sys.prefix != sys.base_prefix, "not in a venv"
    for module in (ckpt_offload, _C):
        assert module.__file__.startswith(sys.prefix), module.__file__
    assert _C.BUILT_WITH_TORCH == torch.__version__.split("+")[0]


def test_metadata_names_the_license_and_the_tested_torch():
    meta = metadata.metadata("ckpt_offload")
    assert meta["Version"] == ckpt_offload.__version__
    assert "Apache-2.0" in (meta.get("License-Expression") or meta.get("License") or "")
    shipped = [str(f) for f in metadata.files("ckpt_offload") or ()]
    assert any(f.endswith("LICENSE") and ".dist-info" in f for f in shipped), shipped
    requires = [Requirement(r) for r in metadata.requires("ckpt_offload") or []]
    torch_requirement = Requirement(versions.torch_requirement())
    assert any(r.name == "torch" and r.specifier == torch_requirement.specifier and not r.marker
               for r in requires), requires
    extras = {str(r.marker).split('"')[1] for r in requires if r.marker}
    assert extras == set(versions.EXTRAS), extras
    assert meta["Requires-Python"] == versions.python_requirement()
