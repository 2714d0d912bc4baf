"""What ckpt_offload is tested with, and what a torch needs to build against: one place.

Read by setup.py (metadata, build checks), by Bazel's torch repository rule (the C++
standard), by the package at import (the torch check) and by the test that keeps the
README's supported-versions table true. Standard library only: it runs before anyone knows
that torch can be imported.
"""

from __future__ import annotations

import os
import re
from typing import Mapping, Optional, Tuple

# This release of ckpt_offload.
VERSION = "0.1.0"

# torch minor releases CI or the torch matrix (scripts/torch_matrix.sh) builds and tests.
TORCH_MINORS = ("2.11", "2.12", "2.13", "2.14", "2.15")
# Python minor releases the tests run on (the project venv, the newest-torch and Axolotl venvs).
PYTHON_MINORS = ("3.10", "3.11", "3.12")
# Set to 1 to build or import with a torch outside TORCH_MINORS anyway.
ALLOW_UNTESTED_TORCH_ENV = "CKPT_OFFLOAD_ALLOW_UNTESTED_TORCH"

# pip extras: the Hugging Face integration and the Axolotl plugin, each bounded by the
# releases the tests ran (lowest tested, below the next untested minor).
EXTRAS = {
    "hf": ("transformers>=5.17,<5.26", "peft>=0.21,<0.23", "accelerate>=1.15,<1.17"),
    "axolotl": ("axolotl>=0.21,<0.22",),
}

# The C++ standard each `#error` in ATen/ATen.h asks for, by its __cplusplus value.
_CPLUSPLUS_STANDARDS = {"201703": "c++17", "202002": "c++20", "202302": "c++23"}


def _minor_key(minor: str) -> Tuple[int, int]:
    major, rest = minor.split(".")[:2]
    return int(major), int(rest)


def torch_minor(version: str) -> str:
    """'2.14' for '2.14.1+cu130'."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        raise ValueError(f"not a torch version: {version!r}")
    return f"{match.group(1)}.{match.group(2)}"


def torch_requirement() -> str:
    """The install requirement for torch: the tested minors."""
    low = TORCH_MINORS[0]
    major, minor = _minor_key(TORCH_MINORS[-1])
    return f"torch>={low},<{major}.{minor + 1}"


def python_requirement() -> str:
    return f">={PYTHON_MINORS[0]}"


def untested_torch(version: str, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """None when `version` is a tested torch or the override is set; else the message."""
    env = os.environ if env is None else env
    if torch_minor(version) in TORCH_MINORS or env.get(ALLOW_UNTESTED_TORCH_ENV) == "1":
        return None
    return (f"ckpt_offload: found torch {version}; tested {TORCH_MINORS[0]}-{TORCH_MINORS[-1]}. "
            f"Install a tested torch (pip install '{torch_requirement()}'), or set "
            f"{ALLOW_UNTESTED_TORCH_ENV}=1 to use this one anyway.")


def cxx_standard(torch_include_dir: str) -> str:
    """The -std= value the installed torch's headers require ('c++17', 'c++20'), read from
    ATen/ATen.h's own check; the highest one it names."""
    path = os.path.join(torch_include_dir, "ATen", "ATen.h")
    with open(path) as f:
        found = re.findall(r"__cplusplus\s*<\s*(\d{6})L", f.read())
    if not found:
        return "c++17"
    value = max(found)
    if value not in _CPLUSPLUS_STANDARDS:
        raise ValueError(f"{path}: unknown C++ standard __cplusplus < {value}L")
    return _CPLUSPLUS_STANDARDS[value]
