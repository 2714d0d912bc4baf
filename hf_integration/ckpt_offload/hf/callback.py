"""ActivationOffloadCallback: ckpt_offload for transformers.Trainer.

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[ActivationOffloadCallback(keep_last=1)])
    trainer.train()
"""

from __future__ import annotations

from typing import Dict, Optional

from transformers import TrainerCallback

from ckpt_offload import OffloadConfig
from ckpt_offload.config import make_config
from ckpt_offload.hf.arguments import OffloadArguments
from ckpt_offload.hf.install import OffloadHandle, enable_activation_offload

GIB = float(1 << 30)


class ActivationOffloadCallback(TrainerCallback):
    """Offloads checkpointed layers' inputs to host memory while Trainer.train() runs.

    - on_train_begin: installs on the Trainer's model instance (after the Trainer enabled
      gradient checkpointing). Checkpointing is made non-reentrant (use_reentrant=True is
      changed, with a warning) and turned on if it was off. Each training forward, that is
      each micro-batch of gradient accumulation, is one engine step; evaluation and
      prediction run without grad and offload nothing.
    - on_log: adds `offload/...` figures (per optimizer step, averaged since the last log).
    - on_train_end: uninstalls; the model's forward and checkpoint functions are the same
      objects as before.

    Overrides are OffloadConfig fields (keep_last, prefetch_depth, host_memory_limit, ...);
    bad values raise ValueError naming the field, here, before training starts.

    The Trainer runs its report_to integrations before user callbacks, and stores each log
    in state.log_history before any callback sees it. The history entry is updated here; for
    wandb/tensorboard to receive the figures, register with `callback.attach(trainer)`.
    """

    def __init__(self, config: Optional[OffloadConfig] = None, **overrides):
        self.config = make_config(config, **overrides)
        self.handle: Optional[OffloadHandle] = None
        self.final_totals: Optional[Dict[str, float]] = None
        self._logged_totals: Optional[Dict[str, float]] = None
        self._logged_step = 0

    @classmethod
    def from_args(cls, args: OffloadArguments) -> Optional["ActivationOffloadCallback"]:
        """The callback that parsed OffloadArguments ask for, or None when offloading is off."""
        if not args.activation_offloading:
            return None
        return cls(args.to_config())

    def attach(self, trainer) -> "ActivationOffloadCallback":
        """Registers on `trainer` ahead of its report_to integrations, so that they log the
        offload/ figures too (Trainer.add_callback would append after them)."""
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)
        return self

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.handle is not None:
            self.handle.disable()  # left by a train() that raised before on_train_end
        if model is None:
            raise ValueError("ActivationOffloadCallback: the Trainer passed no model")
        self.handle = enable_activation_offload(model, self.config)
        self.final_totals = None
        self._logged_totals = self.handle.totals()
        self._logged_step = state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.handle is None or logs is None:
            return
        totals = self.handle.totals()
        if totals["micro_steps"] == self._logged_totals["micro_steps"]:
            return  # no training step since the last log: an evaluation or the summary
        figures = self._figures(totals, steps=max(1, state.global_step - self._logged_step))
        logs.update(figures)
        # The Trainer appended its copy of these logs to the history before callbacks ran.
        history = state.log_history[-1] if state.log_history else None
        if history is not None and history.get("step") == state.global_step and all(
                key in history for key in logs if key not in figures):
            history.update(figures)
        self._logged_totals = totals
        self._logged_step = state.global_step

    def on_train_end(self, args, state, control, **kwargs):
        if self.handle is None:
            return
        self.final_totals = self.handle.totals()
        self.handle.disable()
        self.handle = None

    def _figures(self, totals: Dict[str, float], steps: int) -> Dict[str, float]:
        """Per optimizer step since the last log, except the host pool's standing figures."""
        previous = self._logged_totals

        def per_step(key):
            return (totals.get(key, 0) - previous.get(key, 0)) / steps

        return {
            "offload/offloaded_gib": per_step("offloaded_bytes") / GIB,
            "offload/offloaded_tensors": per_step("offloaded_tensors"),
            "offload/kept_resident_tensors": per_step("kept_resident_tensors"),
            "offload/prefetched_tensors": per_step("prefetched_tensors"),
            "offload/reclaimed_tensors": per_step("reclaimed_tensors"),
            "offload/exposed_wait_ms": per_step("exposed_wait_ms"),
            "offload/cap_fallbacks": totals["cap_fallbacks"] - previous["cap_fallbacks"],
            "offload/host_pool_gib": totals["host_reserved_bytes"] / GIB,
            "offload/host_peak_gib": totals["host_peak_bytes"] / GIB,
            "offload/pinned_allocations": totals["pinned_allocations"],
        }
