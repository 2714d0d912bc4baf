"""What stops a build or an import with a torch ckpt_offload cannot use: versions.py's
checks, and the import of ckpt_offload._C through _native with a torch outside the tested
range or other than the one _C was built against."""

import os
import subprocess
import sys

import pytest
import torch

from ckpt_offload import versions
from ckpt_offload._native import _C


def test_every_tested_minor_passes_and_others_stop_with_the_range():
    for minor in versions.TORCH_MINORS:
        assert versions.untested_torch(f"{minor}.1+cu130", env={}) is None
    message = versions.untested_torch("2.16.0", env={})
    assert message.startswith(f"ckpt_offload: found torch 2.16.0; tested "
                              f"{versions.TORCH_MINORS[0]}-{versions.TORCH_MINORS[-1]}.")
    assert versions.ALLOW_UNTESTED_TORCH_ENV in message
    assert versions.untested_torch("2.10.0", env={}) is not None
    assert versions.untested_torch("2.16.0", env={versions.ALLOW_UNTESTED_TORCH_ENV: "1"}) is None


def test_torch_requirement_spans_the_tested_minors():
    low, high = versions.TORCH_MINORS[0], versions.TORCH_MINORS[-1]
    major, minor = high.split(".")
    assert versions.torch_requirement() == f"torch>={low},<{major}.{int(minor) + 1}"


@pytest.mark.parametrize("header,expected", [
    ("#if !defined(_MSC_VER) && __cplusplus < 201703L\n#error C++17\n#endif\n", "c++17"),
    ("#if (defined(_MSVC_LANG) && _MSVC_LANG < 202002L) || \\\n"
     "    (!defined(_MSVC_LANG) && __cplusplus < 202002L)\n#error C++20\n#endif\n", "c++20"),
    ("#pragma once\n", "c++17"),
])
def test_cxx_standard_is_read_from_aten_h(tmp_path, header, expected):
    (tmp_path / "ATen").mkdir()
    (tmp_path / "ATen" / "ATen.h").write_text(header)
    assert versions.cxx_standard(str(tmp_path)) == expected


def test_cxx_standard_of_the_installed_torch():
    include = os.path.join(os.path.dirname(torch.__file__), "include")
    assert versions.cxx_standard(include) in ("c++17", "c++20")


def test_extension_reports_the_torch_it_was_built_against():
    assert _C.BUILT_WITH_TORCH == torch.__version__.split("+")[0]


def import_with_torch_version(version, extra_env=None):
    """Imports ckpt_offload's API in a child whose torch claims to be `version`."""
    code = ("import torch; torch.__version__ = %r; import ckpt_offload; "
            "ckpt_offload.checkpoint; print('imported')" % version)
    env = {k: v for k, v in os.environ.items() if k != versions.ALLOW_UNTESTED_TORCH_ENV}
    env.update(PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **(extra_env or {}))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)


def test_import_with_an_untested_torch_stops_unless_allowed():
    result = import_with_torch_version("2.99.0")
    assert result.returncode != 0
    assert "ImportError: ckpt_offload: found torch 2.99.0; tested" in result.stderr
    allowed = import_with_torch_version(
        "2.99.0", {versions.ALLOW_UNTESTED_TORCH_ENV: "1"})
    # Allowed past the range check, it then meets the minor-release check: _C was built
    # against the real torch, not 2.99.
    assert "built against torch" in allowed.stderr and "2.99.0" in allowed.stderr
    assert "--force-reinstall" in allowed.stderr


def test_import_with_another_tested_minor_than_the_build_says_to_rebuild():
    built = versions.torch_minor(_C.BUILT_WITH_TORCH)
    other = next(m for m in versions.TORCH_MINORS if m != built)
    result = import_with_torch_version(f"{other}.0")
    assert result.returncode != 0
    assert f"ckpt_offload was built against torch {_C.BUILT_WITH_TORCH}" in result.stderr
    assert "pip install --no-build-isolation --no-deps --force-reinstall ." in result.stderr
