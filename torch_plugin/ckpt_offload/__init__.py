"""ckpt_offload: activation offload for non-reentrant activation checkpointing.

    import ckpt_offload
    with ckpt_offload.offload_activations(keep_last=1) as engine:
        for layer in layers:
            h = ckpt_offload.checkpoint(layer, h)
        loss = head(h)
        loss.backward()
    print(engine.stats())
"""

import pkgutil

# ckpt_offload.hf and ckpt_offload.axolotl live in hf_integration/ in the source tree.
__path__ = pkgutil.extend_path(__path__, __name__)

import torch  # noqa: E402, F401  (loads libtorch before the extension)

from ckpt_offload import _C  # noqa: E402, F401
from ckpt_offload.config import (  # noqa: E402
    BACKENDS, SCOPES, OffloadConfig, parse_host_memory_limit)
from ckpt_offload.engine import (  # noqa: E402
    STAT_KEYS, OffloadEngine, checkpoint, current_engine, mark_checkpoint_inputs,
    offload_activations)

__version__ = "0.1.0"

__all__ = [
    "BACKENDS", "SCOPES", "STAT_KEYS", "OffloadConfig", "OffloadEngine", "checkpoint",
    "current_engine", "mark_checkpoint_inputs", "offload_activations",
    "parse_host_memory_limit", "__version__",
]
