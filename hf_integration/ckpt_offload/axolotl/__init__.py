"""ckpt_offload for Axolotl (`plugins: [ckpt_offload.axolotl.ActivationOffloadPlugin]`)."""

from ckpt_offload.axolotl.args import ActivationOffloadArgs, offload_config_from
from ckpt_offload.axolotl.plugin import ActivationOffloadPlugin

__all__ = ["ActivationOffloadArgs", "ActivationOffloadPlugin", "offload_config_from"]
