"""ActivationOffloadPlugin: `activation_offloading: true` in Axolotl, done by ckpt_offload.

With `activation_offloading: true`, Axolotl would (0.21) turn HF gradient checkpointing off
in the trainer arguments, wrap full-finetune layers with torch's CheckpointWrapper, and run
every training step inside TRL's OffloadActivations context. The plugin switches all of that
off before the model loads, by setting `activation_offloading` back to false in the loaded
config, so Axolotl keeps HF non-reentrant gradient checkpointing; once the trainer exists it
registers ActivationOffloadCallback, which offloads the checkpointed layers' inputs.

Axolotl's other modes ("legacy", "disk", "hidden_states") are left to Axolotl.
"""

from __future__ import annotations

import contextlib
import logging

from axolotl.integrations.base import BasePlugin

from ckpt_offload.axolotl.args import CONFIG_FIELDS, offload_config_from
from ckpt_offload.hf import ActivationOffloadCallback

LOG = logging.getLogger("axolotl.integrations.ckpt_offload")


class ActivationOffloadPlugin(BasePlugin):
    """Axolotl plugin: `plugins: [ckpt_offload.axolotl.ActivationOffloadPlugin]`."""

    def __init__(self):
        super().__init__()
        self.offload_config = None  # set once this plugin took activation offloading over
        self.callback = None

    def get_input_args(self) -> str:
        return "ckpt_offload.axolotl.args.ActivationOffloadArgs"

    def pre_model_load(self, cfg):
        # After validation (Axolotl's checks saw `activation_offloading: true`, e.g. that it
        # needs gradient_checkpointing) and before anything that acts on it.
        mode = cfg.activation_offloading
        if mode is True:
            self.offload_config = offload_config_from(cfg)
            cfg.activation_offloading = False
            LOG.info(
                "ckpt_offload: activation_offloading: true is done by ckpt_offload (%s); "
                "Axolotl's own offloading (TRL OffloadActivations) is switched off and HF "
                "gradient checkpointing stays on", self.offload_config)
            return
        self.offload_config = None
        if mode:
            LOG.info("ckpt_offload: activation_offloading: %r is Axolotl's own mode; left to "
                     "Axolotl, ckpt_offload stays off", mode)
        elif any(cfg.get(key) is not None for key in CONFIG_FIELDS):
            LOG.warning("ckpt_offload: ckpt_offload_* settings are ignored because "
                        "activation_offloading is not true")

    def post_trainer_create(self, cfg, trainer):
        if self.offload_config is None:
            return
        context = getattr(trainer, "activation_offload_context", None)
        if getattr(trainer.args, "activation_offloading", None) or not (
                context is None or isinstance(context, contextlib.nullcontext)):
            raise RuntimeError(
                "ckpt_offload: Axolotl's own activation offloading is still active in this "
                "trainer, so the plugin's pre_model_load did not run before the model was "
                "loaded; load the model through Axolotl's ModelLoader with the plugin listed")
        # Ahead of the report_to integrations, so wandb & co. receive the offload/ figures.
        # Axolotl's sequence_len bounds every sample (packed or not): the host pool is sized
        # for its longest micro-batch before the first step. Its info lines (the peak
        # breakdown) go through this plugin's logger: Axolotl shows only axolotl.* loggers'.
        tokens = None
        if isinstance(cfg.sequence_len, int) and cfg.sequence_len > 0:
            tokens = cfg.sequence_len * max(1, int(cfg.micro_batch_size or 1))
        self.callback = ActivationOffloadCallback(
            self.offload_config, tokens_hint=tokens, logger=LOG).attach(trainer)
        LOG.info("ckpt_offload: ActivationOffloadCallback registered")
