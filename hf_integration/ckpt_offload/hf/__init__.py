"""ckpt_offload for Hugging Face transformers: Trainer callback, argument dataclass and an
installer for custom training loops.

    from ckpt_offload.hf import ActivationOffloadCallback
    trainer = Trainer(..., callbacks=[ActivationOffloadCallback(keep_last=1)])

    from ckpt_offload.hf import enable_activation_offload
    handle = enable_activation_offload(model, keep_last=1)   # custom loop / accelerate
    ...
    handle.disable()
"""

from ckpt_offload.hf.arguments import OffloadArguments
from ckpt_offload.hf.callback import ActivationOffloadCallback
from ckpt_offload.hf.install import OffloadHandle, checkpointing_layers, enable_activation_offload

__all__ = [
    "ActivationOffloadCallback", "OffloadArguments", "OffloadHandle", "checkpointing_layers",
    "enable_activation_offload",
]
