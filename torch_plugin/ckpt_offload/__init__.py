"""ckpt_offload: activation offload for non-reentrant activation checkpointing.

    import ckpt_offload
    with ckpt_offload.offload_activations(keep_last=1) as engine:
        for layer in layers:
            h = ckpt_offload.checkpoint(layer, h)
        loss = head(h)
        loss.backward()
    print(engine.stats())

The names below load torch and the extension on first use (ckpt_offload/_native.py checks
both), so that `python -m ckpt_offload.plan` and `ckpt_offload.versions` work without torch.
"""

import importlib
import pkgutil

# ckpt_offload.hf and ckpt_offload.axolotl live in hf_integration/ in the source tree.
__path__ = pkgutil.extend_path(__path__, __name__)

from ckpt_offload.versions import VERSION as __version__  # noqa: E402

# Public name -> the submodule that defines it.
_EXPORTS = {
    "BACKENDS": "config",
    "SCOPES": "config",
    "OffloadConfig": "config",
    "parse_host_memory_limit": "config",
    "STAT_KEYS": "engine",
    "OffloadEngine": "engine",
    "checkpoint": "engine",
    "current_engine": "engine",
    "mark_checkpoint_inputs": "engine",
    "offload_activations": "engine",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ckpt_offload' has no attribute {name!r}")
    importlib.import_module("ckpt_offload._native")
    value = getattr(importlib.import_module(f"ckpt_offload.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
