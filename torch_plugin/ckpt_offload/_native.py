"""ckpt_offload._C, loaded only with a torch it can work with; every other case stops here
with a message that says what to install or rebuild.

What it checks, in order: torch is importable; it is a tested release (versions.py, or the
override set); the extension loads; it was compiled against this torch's minor release (a
_C built for another torch either fails to load or misbehaves).
"""

import sys

from ckpt_offload import versions

REBUILD = ("rebuild ckpt_offload against it, from its source directory: "
           "pip install --no-build-isolation --no-deps --force-reinstall .")

try:
    import torch  # loads libtorch before the extension
except ModuleNotFoundError as error:
    if error.name != "torch":
        raise
    raise ModuleNotFoundError(
        f"ckpt_offload needs torch (tested {versions.TORCH_MINORS[0]}-"
        f"{versions.TORCH_MINORS[-1]}), and this Python ({sys.executable}) has none. Install "
        f"one (pip install '{versions.torch_requirement()}'), then {REBUILD}",
        name="torch") from error

_untested = versions.untested_torch(torch.__version__)
if _untested:
    raise ImportError(_untested)

try:
    from ckpt_offload import _C
except ImportError as error:
    raise ImportError(
        f"ckpt_offload's extension (_C) does not load with torch {torch.__version__}: {error}. "
        f"It was most likely built against another torch; {REBUILD}") from error

if versions.torch_minor(_C.BUILT_WITH_TORCH) != versions.torch_minor(torch.__version__):
    raise ImportError(
        f"ckpt_offload was built against torch {_C.BUILT_WITH_TORCH} but torch "
        f"{torch.__version__} is imported; {REBUILD}")

__all__ = ["_C"]
