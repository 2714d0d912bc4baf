"""ActivationOffloadCallback: ckpt_offload for transformers.Trainer.

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[ActivationOffloadCallback(keep_last=1)])
    trainer.train()
"""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from typing import Any, Dict, Optional

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler

from ckpt_offload import OffloadConfig
from ckpt_offload.config import INT64_MAX, check_int, make_config
from ckpt_offload.hf.arguments import OffloadArguments
from ckpt_offload.hf.install import OffloadHandle
from ckpt_offload.hf.peak import report_lines

GIB = float(1 << 30)

logger = logging.getLogger("ckpt_offload.hf")

# TrainingArguments fields (of trainers built on it) that bound a sample's length in tokens:
# TRL's SFTConfig and DPOConfig call it max_length.
_MAX_LENGTH_ARGS = ("max_length", "max_seq_length")

# on_log keys of the peak breakdown, and the breakdown's figures they show.
PEAK_FIGURES = {
    "offload/peak_step_gib": "step_peak_bytes",
    "offload/peak_head_loss_gib": "head_loss_bytes",
    "offload/peak_layer_recompute_gib": "layer_recompute_bytes",
    "offload/peak_hidden_states_kept_gib": "hidden_states_kept_bytes",
    "offload/peak_offload_removed_gib": "offload_removed_bytes",
}

# on_log keys of a memory budget's plan (the latest planned micro-step), and their stats().
BUDGET_FIGURES = {
    "offload/budget_resident_layers": ("budget_resident_layers", 1),
    "offload/budget_selective_layers": ("budget_selective_layers", 1),
    "offload/budget_checkpointed_layers": ("budget_checkpointed_layers", 1),
    "offload/budget_kept_output_gib": ("budget_kept_output_bytes", GIB),
    "offload/budget_offloading_layers": ("budget_offloading_layers", 1),
    "offload/budget_offloaded_output_gib": ("budget_offloaded_output_bytes", GIB),
    "offload/budget_resident_offloaded_gib": ("budget_resident_offloaded_bytes", GIB),
    "offload/budget_predicted_peak_gib": ("budget_predicted_peak_bytes", GIB),
    "offload/budget_predicted_allocated_gib": ("budget_predicted_allocated_bytes", GIB),
    "offload/budget_measured_peak_gib": ("budget_measured_peak_bytes", GIB),
    "offload/budget_predicted_saved_ms": ("budget_predicted_saved_ms", 1),
    "offload/budget_checkpointed_step_ms": ("budget_checkpointed_step_ms", 1),
    "offload/budget_predicted_step_ms": ("budget_predicted_step_ms", 1),
    "offload/budget_measured_step_ms": ("budget_measured_step_ms", 1),
    "offload/budget_kept_share": ("budget_kept_share", 1),
}


def budget_figures(stats: Dict[str, float]) -> Dict[str, float]:
    """on_log figures of OffloadHandle.budget_stats() (none without a budget)."""
    if not stats:
        return {}
    return {key: stats[name] / scale for key, (name, scale) in BUDGET_FIGURES.items()}


# How far up the call stack the Trainer is looked for (it is a few frames above a callback).
_MAX_FRAMES = 64


class ActivationOffloadCallback(TrainerCallback):
    """Offloads checkpointed layers' inputs to host memory while Trainer.train() runs.

    - on_init_end (registered with `Trainer(callbacks=[...])`) or attach(): moves itself
      ahead of every other callback, so that report_to integrations (wandb, tensorboard,
      ...) and other callbacks receive the offload/ figures, and makes the Trainer's
      train() uninstall when it raises (the exception goes on unchanged). Registered with
      `trainer.add_callback`, it does both at on_train_begin: the figures reach the
      trackers from then on, and an exception in that first train() leaves the
      installation until the next install replaces it (or disable_activation_offload).
    - on_train_begin: installs on the Trainer's model instance (after the Trainer enabled
      gradient checkpointing). Checkpointing is made non-reentrant (use_reentrant=True is
      changed, with a warning) and turned on if it was off. Each training forward, that is
      each micro-batch of gradient accumulation, is one engine step; evaluation and
      prediction run without grad and offload nothing. An installation left on the model
      by another callback whose train() raised is replaced, with a warning; one by
      enable_activation_offload(), or by another callback of the same Trainer, raises
      RuntimeError.
    - on_log: adds `offload/...` figures (per optimizer step, averaged since the last log).
    - After the profiled micro-step (the second; see OffloadHandle.peak_breakdown()): logs
      where its device-memory peak is, once, and adds `offload/peak_*_gib` figures to the
      next on_log. With `skip_memory_metrics=False` no step is profiled (it would reset the
      allocator's peak counter, which the Trainer's memory metrics read).
    - on_train_end: uninstalls; the model's forward and checkpoint functions are the same
      objects as before.

    Overrides are OffloadConfig fields (keep_last, prefetch_depth, host_memory_limit, ...);
    bad values raise ValueError naming the field, here, before training starts. `logger`:
    where the callback's info lines go (default: the "ckpt_offload.hf" logger).

    The Trainer stores each log in state.log_history before any callback sees it; the
    history entry is updated here too.
    """

    def __init__(self, config: Optional[OffloadConfig] = None, *,
                 tokens_hint: Optional[int] = None,
                 logger: Optional[logging.Logger] = None, **overrides):
        self.config = make_config(config, **overrides)
        if tokens_hint is not None:
            check_int("tokens_hint", tokens_hint, 1, INT64_MAX)
        if logger is not None and not isinstance(logger, (logging.Logger,
                                                          logging.LoggerAdapter)):
            raise ValueError(f"logger: expected a logging.Logger, got "
                             f"{type(logger).__name__} {logger!r}")
        self.tokens_hint = tokens_hint
        self.log = logger if logger is not None else logging.getLogger("ckpt_offload.hf")
        self.peak_breakdown: Optional[Dict[str, Any]] = None  # the latest one reported
        self._peak_figures: Optional[Dict[str, float]] = None  # for the next on_log
        self._advised = False  # the memory-budget advice was logged
        self.handle: Optional[OffloadHandle] = None
        self.final_totals: Optional[Dict[str, float]] = None
        self._logged_totals: Optional[Dict[str, float]] = None
        self._logged_step = 0
        self._trainer = None  # weakref to the Trainer this callback serves, once known
        self._training = False

    @classmethod
    def from_args(cls, args: OffloadArguments) -> Optional["ActivationOffloadCallback"]:
        """The callback that parsed OffloadArguments ask for, or None when offloading is off."""
        if not args.activation_offloading:
            return None
        return cls(args.to_config())

    def attach(self, trainer) -> "ActivationOffloadCallback":
        """Registers on `trainer` (a Trainer made without this callback) ahead of every other
        callback, as `Trainer(callbacks=[...])` does; returns the callback."""
        self._serve(trainer)
        return self

    def on_init_end(self, args, state, control, **kwargs):
        trainer = self._calling_trainer()
        if trainer is not None:
            self._serve(trainer)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        trainer = self._calling_trainer()
        if trainer is not None:
            self._serve(trainer)  # registered with add_callback: not served yet
        kept_share = 1.0
        if self.handle is not None:
            # Left by a train() that raised before on_train_end: a retry after running out
            # of memory (auto_find_batch_size) keeps the budget's back-off.
            kept_share = self.handle.budget_kept_share
            self.handle.disable()
        if model is None:
            raise ValueError("ActivationOffloadCallback: the Trainer passed no model")
        self.handle = OffloadHandle(model, self.config, owner=self, replace=self._is_stale)
        self.handle.budget_kept_share = kept_share
        self.peak_breakdown = self._peak_figures = None
        self._advised = False
        if not getattr(args, "skip_memory_metrics", True):
            # The profiled step resets the allocator's peak counter, which the Trainer's
            # memory metrics read.
            self.handle._peak.withhold()
            self.log.info("ckpt_offload.hf: skip_memory_metrics=False, so the step's peak is "
                          "not broken down (that would reset the peak counter the Trainer's "
                          "memory metrics read)")
        self._reserve_up_front(args)
        self._training = True
        self.final_totals = None
        self._logged_totals = self.handle.totals()
        self._logged_step = state.global_step

    def _reserve_up_front(self, args) -> None:
        """Sizes the host pool for the longest micro-batch before the first step: from
        tokens_hint, else from a maximum length the arguments carry (TRL's max_length)
        times the per-device batch size. Without either the pool grows with the steps."""
        tokens, source = self.tokens_hint, "tokens_hint"
        if tokens is None:
            for name in _MAX_LENGTH_ARGS:
                length = getattr(args, name, None)
                if isinstance(length, int) and length > 0:
                    tokens = length * max(1, int(args.per_device_train_batch_size))
                    source = f"{name} x per_device_train_batch_size"
                    break
        if tokens is None or self.handle.engine.backend is None:
            return
        try:
            reserved = self.handle.reserve_for_tokens(tokens)
        except (RuntimeError, ValueError) as error:
            logger.warning("ckpt_offload.hf: the host pool was not sized up front (%s); it "
                           "grows as steps need it", error)
            return
        self.log.info("ckpt_offload.hf: host pool sized up front for %d tokens per "
                      "micro-batch (%s): %.2f GiB", tokens, source, reserved / GIB)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._report_peak(state)  # before the optimizer: the CPU meter leaves with it

    def on_step_end(self, args, state, control, **kwargs):
        self._report_peak(state)
        if self.handle is not None and not self._advised:
            advice = self.handle.budget_advice()
            if advice is not None:
                self._advised = True
                if state.is_world_process_zero:
                    self.log.info("ckpt_offload.hf: %s", advice)

    def _report_peak(self, state) -> None:
        """Logs a breakdown not reported yet (one per run, unless profile_next_step()) and
        keeps its figures for the next on_log."""
        if self.handle is None:
            return
        breakdown = self.handle.peak_breakdown()
        if breakdown is None or breakdown == self.peak_breakdown:
            return
        self.peak_breakdown = breakdown
        self._peak_figures = {key: breakdown[name] / GIB for key, name in PEAK_FIGURES.items()}
        if state.is_world_process_zero:
            self.log.info("\n".join(report_lines(breakdown)))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.handle is None or logs is None:
            return
        totals = self.handle.totals()
        if totals["micro_steps"] == self._logged_totals["micro_steps"]:
            return  # no training step since the last log: an evaluation or the summary
        figures = self._figures(totals, steps=max(1, state.global_step - self._logged_step))
        figures.update(budget_figures(self.handle.budget_stats()))
        self._report_peak(state)
        if self._peak_figures is not None:
            figures.update(self._peak_figures)
            self._peak_figures = None
        logs.update(figures)
        # The Trainer appended its copy of these logs to the history before callbacks ran.
        history = state.log_history[-1] if state.log_history else None
        if history is not None and history.get("step") == state.global_step and all(
                key in history for key in logs if key not in figures):
            history.update(figures)
        self._logged_totals = totals
        self._logged_step = state.global_step

    def on_train_end(self, args, state, control, **kwargs):
        self._uninstall()

    def _uninstall(self) -> None:
        self._training = False
        if self.handle is None:
            return
        self.final_totals = self.handle.totals()
        self.handle.disable()
        self.handle = None

    # Finding and serving the Trainer.

    def _serve(self, trainer) -> None:
        """Puts this callback first in `trainer`'s callbacks (the Trainer itself lists its
        report_to integrations first) and guards its train() once."""
        self._trainer = weakref.ref(trainer)
        callbacks = trainer.callback_handler.callbacks
        if not (callbacks and callbacks[0] is self):
            # Also while the handler iterates over this list (on_init_end, on_train_begin):
            # the callbacks after this one keep their positions, so none is skipped.
            if any(cb is self for cb in callbacks):
                callbacks.remove(self)
            callbacks.insert(0, self)
        current = trainer.__dict__.get("train")
        if getattr(current, "__ckpt_offload_callback__", None) is self:
            return
        train = trainer.train
        callback = self

        @functools.wraps(train)
        def train_then_uninstall_on_error(*args, **kwargs):
            try:
                return train(*args, **kwargs)
            except BaseException:
                if callback.handle is not None:
                    logger.info("ckpt_offload.hf: train() raised; activation offload "
                                "uninstalled, the model is as before")
                callback._uninstall()
                raise

        train_then_uninstall_on_error.__ckpt_offload_callback__ = self
        trainer.train = train_then_uninstall_on_error

    def _calling_trainer(self):
        """The Trainer whose CallbackHandler is calling this callback now, from the stack
        (the handler's `self` a few frames up, then the Trainer's), or None."""
        frame = sys._getframe(2)
        handler = None
        try:
            for _ in range(_MAX_FRAMES):
                if frame is None:
                    return None
                owner = frame.f_locals.get("self")
                if handler is None:
                    if isinstance(owner, CallbackHandler) and any(
                            cb is self for cb in owner.callbacks):
                        handler = owner
                elif getattr(owner, "callback_handler", None) is handler:
                    return owner
                frame = frame.f_back
            return None
        finally:
            del frame

    def _is_stale(self, handle: OffloadHandle) -> bool:
        """Whether an installation found on the model may be replaced: one left by another
        ActivationOffloadCallback that is not part of this training (its train() raised)."""
        owner = handle.owner
        if not isinstance(owner, ActivationOffloadCallback) or owner is self:
            return owner is self
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is not None:
            return all(cb is not owner for cb in trainer.callback_handler.callbacks)
        return not owner._training

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
