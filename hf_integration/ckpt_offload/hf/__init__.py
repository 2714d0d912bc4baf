"""ckpt_offload for Hugging Face transformers: Trainer callback, argument dataclass and an
installer for custom training loops.

    from ckpt_offload.hf import ActivationOffloadCallback
    trainer = Trainer(..., callbacks=[ActivationOffloadCallback(keep_last=1)])

    from ckpt_offload.hf import enable_activation_offload
    handle = enable_activation_offload(model, keep_last=1)   # custom loop / accelerate
    handle = enable_activation_offload(model, compile=True)  # ... compiled, region by region
    ...
    handle.disable()
    disable_activation_offload(model)    # uninstalls what a lost handle left on the model
"""

from ckpt_offload.hf.arguments import OffloadArguments
from ckpt_offload.hf.callback import ActivationOffloadCallback
from ckpt_offload.hf.compile import CompiledRegions, compile_regions
from ckpt_offload.hf.install import (
    OffloadHandle, checkpointing_layers, disable_activation_offload, enable_activation_offload,
    installations)

__all__ = [
    "ActivationOffloadCallback", "CompiledRegions", "OffloadArguments", "OffloadHandle",
    "checkpointing_layers", "compile_regions",
    "disable_activation_offload", "enable_activation_offload", "installations",
]
