"""Installs ckpt_offload on one Hugging Face model instance (never on its class).

What an installation changes, and `OffloadHandle.disable()` puts back exactly:
- each checkpointing module's `_gradient_checkpointing_func` (set by
  `gradient_checkpointing_enable`) becomes a non-reentrant torch checkpoint that tags the
  layer's positional tensor inputs as one ckpt_offload group. The installation owns these
  functions for as long as it is installed: whatever sets them anew in the meantime
  (`gradient_checkpointing_disable()` then `..._enable(...)` around a reference forward, as
  TRL's trainers do; `every_n_layers`; peft's toggles; an assignment), each training forward
  first wraps the function it finds, remembering it as the user's latest, so every step
  keeps the tagging, the prefetch and the peak profiler's view of recomputes. disable()
  puts back the user's latest function on each module;
- `forward` of the instance passed in, and of each transformers model inside it that holds
  the layers (a peft model's causal LM, the causal LM's decoder), is wrapped so that every
  training forward (grad enabled, training mode: one micro-step) runs inside the offload
  engine's context, also one that calls the decoder directly and computes its own loss;
- when gradient checkpointing was off, it is turned on (and off again on disable, whoever
  toggled it in between: every flag, function and input-grad hook as before installation);
- forward hooks that `enable_input_require_grads` (transformers, peft) put on the input
  embeddings are swapped for one that makes the embeddings require grad without turning
  them into a leaf (see `_RequireGradWithoutLeaf`); the original hook goes back on
  disable.

Only the forward runs inside the engine's context: saved-tensor hooks pack during forward,
and autograd unpacks (restores) during backward whether or not the context is still active.

Copies: every object an installation puts on the model (the forward wrapper, the checkpoint
functions, the swapped hook) deep-copies and pickles as the object it replaced, so
`copy.deepcopy(model)` and `torch.save(model)` give the model without ckpt_offload (install
on the copy separately), whose forward runs the copy's own weights. The one difference:
gradient checkpointing that the installation turned on stays on in the copy. Such a pickle
loads without ckpt_offload (only standard-library callables stand in for the replaced objects).

Leftovers: an installation is found from the model itself (each patched object carries its
handle). Installing again over a live one raises RuntimeError; an installer that may replace
stale leftovers (ActivationOffloadCallback: those of a callback whose train() raised) passes
`replace`, and the stale installation is uninstalled first, with a warning.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import operator
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.utils.checkpoint
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

import ckpt_offload
from ckpt_offload import STAT_KEYS, OffloadConfig
from ckpt_offload.budget import RESIDENT
from ckpt_offload.config import INT64_MAX, check_int, make_config
from ckpt_offload.hf.compile import (
    CompiledRegions, backend_of, enclosing_compiled_module, tell_once)
from ckpt_offload.hf.layer_budget import LayerBudget, keeping, saving_outputs
from ckpt_offload.hf.peak import STAT_KEYS as PEAK_STAT_KEYS
from ckpt_offload.hf.peak import PeakTracker

logger = logging.getLogger("ckpt_offload.hf")

_MISSING = object()

_FUNC = "_gradient_checkpointing_func"

# Attributes that gradient checkpointing sets on modules; saved before and restored after.
_CHECKPOINTING_ATTRS = (
    "gradient_checkpointing", "_gradient_checkpointing_func",
    "_require_grads_hooks", "_require_grads_hook",
)

# Keyword options of torch.utils.checkpoint.checkpoint that a wrapped function may carry.
_TORCH_CHECKPOINT_OPTIONS = (
    "preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop",
    "respect_saved_tensors_hooks")

# Whether this torch's checkpoint asks where selective checkpointing's kept outputs go (from
# torch 2.15: through saved-tensor hooks or not). A selective layer's kept outputs stay on
# the device, as they always did: they are the plan's, and the plan counts them there.
_ASKS_SAC_HOOKS = ("respect_saved_tensors_hooks"
                   in inspect.signature(torch.utils.checkpoint.checkpoint).parameters)

# Engine figures that describe the host pool and the device right now, or count over the
# pool's lifetime: read as they are. Peaks: the maximum over micro-steps. Every other figure
# restarts with each micro-step (the engine's __enter__) and is summed across micro-steps.
STANDING_FIGURES = (
    "device_held_bytes", "host_reserved_bytes", "host_live_bytes", "host_live_blocks",
    "pinned_allocations", "pinned_allocation_seconds", "host_cap_rejections",
    "host_backend_failures", "micro_steps",
)
STEP_PEAKS = ("peak_device_held_bytes", "host_peak_bytes")

# How far up a forward without offload looks for torch.compile (see _OffloadingForward):
# far enough for torch.compile(model) called directly (the wrapper, dynamo's disable frame,
# the module's call frames, dynamo's compile frame, the OptimizedModule's call frame).
# A compile further up (of a wrapper around the model) is found by the first training
# forward, which looks 24 frames up.
_NEAR_FRAMES = 8

_HF_OFFLOAD_MODULE = "transformers.modeling_utils"

# Names of the forward hooks that transformers' enable_input_require_grads and peft's
# fallbacks register on the input embeddings: `output.requires_grad_(True)`.
_REQUIRE_GRADS_HOOK_NAMES = ("make_inputs_require_grads", "make_inputs_require_grad")


def enable_activation_offload(model: nn.Module, config: Optional[OffloadConfig] = None, *,
                              compile: Any = None, **overrides) -> "OffloadHandle":
    """Offloads the checkpointed layers' inputs of `model` (this instance only).

        handle = enable_activation_offload(model, keep_last=1)
        for batch in loader:
            model(**batch).loss.backward()   # each forward+backward is one engine step
            ...
        print(handle.stats())
        handle.disable()                      # model exactly as before

    `model` may be a PreTrainedModel, a peft.PeftModel, or a DDP/FSDP/accelerate wrapper of
    one: layers are found through `model.modules()`, and `model.forward` is wrapped (and the
    forward of the transformers models inside it that hold the layers, for loops that call
    the decoder and compute their own loss).
    Overrides are OffloadConfig fields. Raises ValueError (naming the field) for bad
    settings and for a model without any transformers GradientCheckpointingLayer, and
    RuntimeError when ckpt_offload is already installed on the model; nothing is changed then.

    `compile`: True, or a dict of torch.compile options, compiles the model region by region
    (see ckpt_offload.hf.compile); disable() undoes it. `torch.compile(model)` of an
    offloaded model gets the same regional compile, with the options it was given.
    """
    return OffloadHandle(model, make_config(config, **overrides), compile=compile)


def installations(model: nn.Module) -> List["OffloadHandle"]:
    """The handles whose patches are on `model` (any of its modules), oldest first."""
    found: List[OffloadHandle] = []
    for module in model.modules():
        candidates = (module.__dict__.get("forward"),
                      module.__dict__.get("_gradient_checkpointing_func"),
                      *module._forward_hooks.values())
        for value in candidates:
            if isinstance(value, _PATCHES) and all(value.handle is not h for h in found):
                found.append(value.handle)
    return found


def disable_activation_offload(model: nn.Module) -> int:
    """Uninstalls every ckpt_offload installation on `model`, also one whose handle is lost
    (after an exception); returns how many there were."""
    handles = installations(model)
    for handle in handles:
        handle.disable()
    return len(handles)


def checkpointing_layers(model: nn.Module) -> List[GradientCheckpointingLayer]:
    """The transformers GradientCheckpointingLayers inside `model`, in module order."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


class OffloadHandle:
    """One installation of ckpt_offload on a model; see enable_activation_offload().

    `owner`: who installed it (ActivationOffloadCallback, or None for a user's own call).
    `replace(old_handle) -> bool`: whether an installation found on the model is stale and
    may be uninstalled first; without it, any installation found raises RuntimeError.

    The second training micro-step after installation is profiled: peak_breakdown() says
    where its device-memory peak is (see ckpt_offload.hf.peak). On CUDA the allocator's
    peak counter (torch.cuda.max_memory_allocated) is reset during that one step.
    """

    def __init__(self, model: nn.Module, config: OffloadConfig, *, owner: Any = None,
                 replace: Optional[Callable[["OffloadHandle"], bool]] = None,
                 compile: Any = None):
        compile_options = _compile_options(compile)
        layers = checkpointing_layers(model)
        if not layers:
            raise ValueError(
                f"ckpt_offload.hf: {type(model).__name__} contains no "
                "transformers.modeling_layers.GradientCheckpointingLayer, so there are no "
                "checkpointed layers whose inputs could be offloaded. Models whose decoder "
                "layers do not subclass GradientCheckpointingLayer can call "
                "ckpt_offload.checkpoint() in their own forward instead")
        found = installations(model)
        if found and (replace is None or not all(replace(old) for old in found)):
            raise RuntimeError(
                "ckpt_offload.hf: activation offload is already installed on this model (by "
                "enable_activation_offload(), or by an ActivationOffloadCallback of the "
                "Trainer that is training it: register one per Trainer); call disable() on "
                "that handle first, or ckpt_offload.hf.disable_activation_offload(model)")
        for old in found:
            warnings.warn(
                "ckpt_offload.hf: replacing the activation offload that an earlier, failed "
                "train() left on this model", UserWarning, stacklevel=3)
            old.disable()
        self.model = model
        self.owner = owner
        self.config = config
        self.engine = ckpt_offload.offload_activations(config)
        self._layers = layers
        # A layer's input brought back ahead of need waits on the device for that layer's
        # backward; fetched as the layer above starts its backward, it adds to that layer's
        # peak (its MLP's backward). So it is fetched once the MLP's backward is done (see
        # _PrefetchAfterMlp), except under a regional compile, whose compiled layers the
        # hook put on their MLP around each call would recompile.
        self._defer_prefetch = config.prefetch_depth > 0
        self.engine.set_prefetch_on_acquire(not self._defer_prefetch)
        self._saved_attrs: Dict[nn.Module, Dict[str, Any]] = {}
        self._saved_hooks: Dict[nn.Module, list] = {}
        # Each wrapped module's own forward attribute (_MISSING: the class's), outermost first.
        self._saved_forwards: Dict[nn.Module, Any] = {}
        # The modules whose checkpoint function this installation owns, with their __dict__
        # (read at every training forward: see _own_checkpoint_funcs), and the wrapper each
        # got from it last.
        self._owned: List[tuple] = []
        self._wrapped: Dict[nn.Module, "_OffloadingCheckpoint"] = {}
        self._last_wrapper: Optional[_OffloadingCheckpoint] = None
        self._notes: set = set()  # notes on replaced functions, warned once each
        # The input embeddings' forward hook ids at install (see disable()).
        self._hooks_before: Dict[nn.Module, set] = {}
        self._turned_on = False
        self._warned_layers: set = set()
        self._embeddings = _input_embeddings(model)
        # (embedding module, hook id) -> the require-grads hook function swapped out.
        self._swapped_hooks: Dict[tuple, Callable] = {}
        self._installed = False
        self._looking = False  # a forward without offload is looking for a torch.compile
        self.regions: Optional[CompiledRegions] = None
        self._step_open = False
        self._latest: Dict[str, float] = {key: 0 for key in STAT_KEYS}
        self._totals: Dict[str, float] = {}
        self._micro_steps = 0
        # reserve_for_tokens: the token count still to be sized from a measured step, and
        # the tokens of the step that runs now.
        self._reserve_tokens: Optional[int] = None
        self._step_tokens = 0
        self._peak = PeakTracker(self)
        # Measures the second step's layers; with config.memory_budget, plans the later ones.
        self._budget = LayerBudget(self, config.memory_budget)
        try:
            self._install()
            if compile_options is not None:
                self._prefetch_on_acquire()
                self.regions = CompiledRegions(model, compile_options)
        except BaseException:
            self.disable()
            raise
        if self.engine.backend is None:
            logger.warning(
                "ckpt_offload.hf: backend='auto' found no CUDA device, so nothing will be "
                "offloaded (backend='host' moves CPU tensors through host memory, for tests)")

    # Installing and uninstalling.

    def _install(self) -> None:
        self._save_checkpointing_attrs()
        self._hooks_before = {module: set(module._forward_hooks) for module in self._embeddings}
        if not any(layer.gradient_checkpointing for layer in self._layers):
            self._turn_on_checkpointing()
            self._turned_on = True
        owned = [module for module in self.model.modules()
                 if module in self._saved_attrs or _FUNC in module.__dict__]
        self._owned = [(module, module.__dict__) for module in owned]
        self._own_checkpoint_funcs(stacklevel=5)
        self._wrap_forward()
        self._swap_require_grads_hooks()
        self._installed = True

    def _save_checkpointing_attrs(self) -> None:
        for module in self.model.modules():
            if hasattr(module, "gradient_checkpointing") or isinstance(module, PreTrainedModel):
                self._saved_attrs[module] = {
                    name: module.__dict__.get(name, _MISSING) for name in _CHECKPOINTING_ATTRS}
                self._saved_hooks[module] = list(module.__dict__.get("_require_grads_hooks") or [])

    def _turn_on_checkpointing(self) -> None:
        pretrained = next((m for m in self.model.modules() if isinstance(m, PreTrainedModel)
                           and m.supports_gradient_checkpointing), None)
        if pretrained is not None and hasattr(pretrained, "activation_checkpointing_enable"):
            # transformers 5.23 renamed gradient_checkpointing_enable; the old name warns.
            pretrained.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False})
        elif pretrained is not None:
            pretrained.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            for layer in self._layers:
                layer.gradient_checkpointing = True
                layer._gradient_checkpointing_func = functools.partial(
                    torch.utils.checkpoint.checkpoint, use_reentrant=False)
        logger.warning(
            "ckpt_offload.hf: gradient checkpointing was off; turned it on (non-reentrant) "
            "for %d layers, since activation offload moves the checkpointed layers' inputs",
            len(self._layers))

    def _own_checkpoint_funcs(self, stacklevel: int = 4) -> None:
        """Wraps every owned module's checkpoint function that is not this installation's
        wrapper: at install, and at the start of every training forward, so that a
        function set while installed (gradient_checkpointing_disable/enable around a
        reference or generation forward, every_n_layers, a plain assignment) is offloaded
        through ckpt_offload's checkpoint, prefetch included, from the next step on. The
        function found is the user's latest: the wrapper remembers it, and disable() puts
        it back. A few dictionary reads per layer and step when nothing changed."""
        for module, attrs in self._owned:
            current = attrs.get(_FUNC, _MISSING)
            if current is _MISSING or current is self._wrapped.get(module):
                continue
            wrapper = self._wrapper_for(current, stacklevel + 1)
            setattr(module, _FUNC, wrapper)  # through the module's own __setattr__
            self._wrapped[module] = wrapper

    def _wrapper_for(self, function: Any, stacklevel: int) -> "_OffloadingCheckpoint":
        """The wrapper of `function` (one per function: transformers sets the same one on
        every layer), warning once per note on what the replacement changes."""
        if isinstance(function, _OffloadingCheckpoint):
            function = function.original  # another installation's, left on a copied layer
        wrapper = self._last_wrapper
        if wrapper is not None and wrapper.original is function:
            return wrapper
        options, notes = _checkpoint_options(function)
        new = [note for note in notes if note not in self._notes]
        if new:
            self._notes.update(new)
            warnings.warn("ckpt_offload.hf: " + "; ".join(new), UserWarning,
                          stacklevel=stacklevel)
        self._last_wrapper = _OffloadingCheckpoint(self, options, function)
        return self._last_wrapper

    def _restore_checkpoint_funcs(self) -> None:
        """Each owned module's checkpoint function back to the user's latest: the function
        its wrapper replaced, or the one set since the last training forward."""
        for module, attrs in self._owned:
            current = attrs.get(_FUNC, _MISSING)
            if current is not _MISSING and current is self._wrapped.get(module):
                attrs[_FUNC] = current.original

    def _swap_require_grads_hooks(self) -> None:
        """Replaces enable_input_require_grads' hooks (also ones registered since the last
        call: gradient_checkpointing_enable on a peft model registers them anew).

        That hook makes the embedding output a leaf that requires grad, and autograd's
        AccumulateGrad node holds such a leaf until backward: the first layer's input could
        never leave the device. Non-reentrant checkpointing (the only kind installed here)
        does not need the inputs to require grad at all; the substitute keeps them requiring
        grad, as the model was set up, through a node that holds nothing."""
        for module in self._embeddings:
            for hook_id, hook in list(module._forward_hooks.items()):
                if (not isinstance(hook, _RequireGradWithoutLeaf)
                        and getattr(hook, "__name__", "") in _REQUIRE_GRADS_HOOK_NAMES):
                    substitute = _RequireGradWithoutLeaf(self, hook)
                    self._swapped_hooks[(module, hook_id)] = substitute
                    module._forward_hooks[hook_id] = substitute

    def _restore_require_grads_hooks(self) -> None:
        for (module, hook_id), substitute in self._swapped_hooks.items():
            if module._forward_hooks.get(hook_id) is substitute:
                module._forward_hooks[hook_id] = substitute.original
        self._swapped_hooks.clear()

    def _wrap_forward(self) -> None:
        """Wraps the forward of the model and of every transformers model inside it that holds
        the checkpointed layers (a peft model's causal LM, the causal LM's decoder): a loop
        that calls the decoder itself and computes its own loss on the hidden states (a
        fused loss such as Cut Cross-Entropy) is a step too. A call through an outer level
        is one step: the inner wrappers find its engine context entered."""
        layers = set(self._layers)
        levels = [self.model] + [
            module for module in self.model.modules()
            if module is not self.model and isinstance(module, PreTrainedModel)
            and any(m in layers for m in module.modules())]
        for module in levels:
            self._saved_forwards[module] = module.__dict__.get("forward", _MISSING)
            module.forward = _OffloadingForward(self, module, module.forward)

    def _forward_reduction(self, module: nn.Module):
        """What `module`'s forward wrapper pickles and deep-copies as: the forward it
        replaced."""
        saved = self._saved_forwards.get(module, _MISSING)
        if saved is _MISSING:
            # The class's forward, bound to the copy (the copy is made before its attributes).
            return getattr, (module, "forward")
        return _reduced_as(saved)

    def disable(self) -> None:
        """Uninstalls: forward, checkpoint functions and checkpointing flags as before.

        Idempotent. Figures stay readable through stats() and totals()."""
        if self._step_open:
            self._harvest(synchronize=True)
        self._budget.close()
        self._peak.cancel()
        self._peak.remove_meters()
        if self.regions is not None:
            self.regions.remove()
            self.regions = None
        for module, saved in self._saved_forwards.items():
            forward = module.__dict__.get("forward")
            if isinstance(forward, _OffloadingForward) and forward.handle is self:
                if saved is _MISSING:
                    del module.forward
                else:
                    module.forward = saved
        self._saved_forwards.clear()
        self._restore_require_grads_hooks()
        self._restore_checkpoint_funcs()
        if self._turned_on:
            # Checkpointing was off: off again, also after toggles while installed (a
            # trainer's helper re-enabling it is not the user turning it on).
            for module, saved in self._saved_attrs.items():
                for hook in module.__dict__.get("_require_grads_hooks") or []:
                    if hook not in self._saved_hooks[module]:
                        hook.remove()
                for name, value in saved.items():
                    if value is _MISSING:
                        module.__dict__.pop(name, None)
                    else:
                        module.__dict__[name] = value
            # Each gradient_checkpointing_enable registers another require-grads hook
            # (gradient_checkpointing_disable leaves them): those of the toggles go too.
            for module, before in self._hooks_before.items():
                for hook_id, hook in list(module._forward_hooks.items()):
                    if (hook_id not in before
                            and getattr(hook, "__name__", "") in _REQUIRE_GRADS_HOOK_NAMES):
                        for hooks in (module._forward_hooks, module._forward_hooks_with_kwargs,
                                      module._forward_hooks_always_called):
                            hooks.pop(hook_id, None)
        self._hooks_before = {}
        self._saved_attrs.clear()
        self._saved_hooks.clear()
        self._owned = []
        self._wrapped.clear()
        self._last_wrapper = None
        self._turned_on = False
        self._installed = False

    @property
    def installed(self) -> bool:
        return self._installed

    def __enter__(self) -> "OffloadHandle":
        return self

    def __exit__(self, *exc) -> bool:
        self.disable()
        return False

    def reserve_for_tokens(self, tokens: int) -> int:
        """Grows the host pool up front for micro-batches of up to `tokens` tokens (batch x
        sequence length), so that no step after the first waits for new pinned memory;
        returns the bytes reserved now. Now: an estimate (every checkpointed layer's input
        and the LM head's, hidden size x the embeddings' element size per token); after the
        first step, what that step held per token, scaled to `tokens`."""
        check_int("tokens", tokens, 1, INT64_MAX)
        hidden = _hidden_size(self.model)
        weight = getattr(self._embeddings[0], "weight", None) if self._embeddings else None
        element = weight.element_size() if isinstance(weight, torch.Tensor) else 4
        num_bytes = (len(self._layers) + 1) * tokens * hidden * element
        self.engine.reserve_host(num_bytes)
        self._reserve_tokens = tokens
        return num_bytes

    def _prefetch_on_acquire(self) -> None:
        self._defer_prefetch = False
        self.engine.set_prefetch_on_acquire(True)

    def _compile_like_enclosing(self, max_frames: int = 24) -> None:
        """Under torch.compile(model): compiles this model's regions with that compile's
        backend, mode and options, once, and says so once. `max_frames`: how far up the
        stack the compiled module is looked for."""
        optimized = enclosing_compiled_module(max_frames)
        if optimized is None:
            return
        backend = backend_of(optimized)
        self._prefetch_on_acquire()
        self.regions = CompiledRegions(self.model, {} if backend is None else
                                       {"backend": backend})
        layers = self.regions.layer_count
        tell_once(
            f"ckpt_offload.hf: torch.compile(model) with activation offload compiles the "
            f"model region by region: {layers} checkpointed layers, the norms outside them "
            f"and the loss function, with the same backend and options; the offload "
            f"boundary between layers runs eagerly (one whole-model graph would need every "
            f"offloaded input back at once, and would break at every layer). Nothing to "
            f"do; to choose the options yourself, pass "
            f"enable_activation_offload(model, compile={{...}}) and skip torch.compile.")

    # Figures.

    def _begin_step(self, tokens: int = 0) -> None:
        if self._step_open:
            self._harvest(synchronize=False)
            if self._reserve_tokens and self._step_tokens:
                self._reserve_measured()
        self._budget.begin_step(self._micro_steps + 1, tokens)
        self._micro_steps += 1
        self._step_open = True
        self._step_tokens = tokens

    def _reserve_measured(self) -> None:
        """After the first step of a run sized with reserve_for_tokens: its pool peak per
        token, scaled to the hint, reserved before the second step (the estimate did not
        know which tensors the LM head's stretch saves, nor their types)."""
        tokens, self._reserve_tokens = self._reserve_tokens, None
        per_token = self._latest.get("host_peak_bytes", 0) / self._step_tokens
        try:
            self.engine.reserve_host(int(per_token * tokens))
        except RuntimeError as error:
            logger.warning("ckpt_offload.hf: the host pool was not sized for %d tokens (%s); "
                           "it grows as steps need it", tokens, error)

    def _harvest(self, synchronize: bool) -> None:
        """Adds the figures of the step that ran last to the totals (stats reset on the
        engine's next __enter__). Its backward has run: the next forward or log comes after."""
        if synchronize:
            self.engine.synchronize()
        self._latest = self.engine.stats()
        _accumulate(self._totals, self._latest)
        self._step_open = False

    def stats(self) -> Dict[str, float]:
        """Engine figures of the latest training micro-step (its forward and, once run, its
        backward), with micro_steps: the training forwards run since enable, and once a
        profiled step has finished, its peak breakdown's figures (peak_step_bytes,
        peak_head_loss_bytes, peak_layer_recompute_bytes, peak_hidden_states_kept_bytes,
        peak_offload_removed_bytes; see peak_breakdown())."""
        figures = self._engine_figures()
        breakdown = self.peak_breakdown()
        if breakdown is not None:
            figures.update((key, breakdown[name]) for name, key in PEAK_STAT_KEYS.items())
        figures.update(self.budget_stats())
        return figures

    def budget_stats(self) -> Dict[str, float]:
        """With memory_budget, the plan's figures (see LayerBudget.stats()); else empty."""
        return self._budget.stats() if self.config.memory_budget is not None else {}

    def layer_modes(self) -> Optional[List[str]]:
        """With memory_budget: the mode of each checkpointed layer (forward order) in the
        latest planned step ("resident": without checkpointing; "checkpoint"), or None before
        a plan (the first two steps, and each longer than those measured before, run with
        every layer checkpointed)."""
        plan = self._budget.latest_plan
        return list(plan.modes) if plan is not None else None

    @property
    def budget_kept_share(self) -> float:
        """With memory_budget: the share of what a plan could keep above the checkpointed
        step that plans keep (1; halved after each out-of-memory error under a plan, see
        ckpt_offload.hf.layer_budget.BACK_OFF_FLOOR). Settable, to carry it to a new
        installation."""
        return self._budget.kept_share

    @budget_kept_share.setter
    def budget_kept_share(self, share: float) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"budget_kept_share: must be in [0, 1], got {share!r}")
        self._budget.kept_share = float(share)

    def budget_advice(self) -> Optional[str]:
        """Without memory_budget, once a step was measured: what memory_budget='auto' would
        buy (None when nothing would fit, or before the measurement)."""
        return self._budget.advice()

    def _engine_figures(self) -> Dict[str, float]:
        if self._step_open:
            self.engine.synchronize()  # settles in-flight copies and their wait figures
        live = self.engine.stats()
        if self._step_open:
            figures = live
        else:
            figures = dict(self._latest)
            figures.update((key, live[key]) for key in STANDING_FIGURES if key in live)
        figures["micro_steps"] = self._micro_steps
        return figures

    def peak_breakdown(self) -> Optional[Dict[str, Any]]:
        """Where the profiled micro-step's device-memory peak is, or None before one has
        finished (also when a run has a single step). Bytes above the memory allocated when
        the step began:

            step_peak_bytes           the step's peak
            head_loss_bytes           final norm, LM head, loss forward and backward (the
                                      stretch from the last layer's forward to the first
                                      recompute), above the stretch's start
            layer_recompute_bytes     the largest layer recompute + backward, above its start
            hidden_states_kept_bytes  checkpointed layer inputs still on the device at the
                                      end of forward (keep_last, cap fallbacks)
            offload_removed_bytes     what offload moved off the device in the step

        and dominant ("head_loss", "layer_recompute" or "hidden_states_kept"), advice (one
        sentence), micro_step (which one was profiled) and meter ("cuda" or "cpu")."""
        self._peak.remove_meters()
        result = self._peak.result
        return dict(result) if result is not None else None

    def profile_next_step(self) -> None:
        """Profiles the next training micro-step again (after the sequence length or batch
        changed, say); peak_breakdown() keeps the previous result until it has finished."""
        self._peak.profile_next_step()

    def totals(self) -> Dict[str, float]:
        """Per-step counters summed over every micro-step since enable, peaks as their
        maximum, host-pool figures as they are now, and micro_steps."""
        totals = {key: 0 for key in STAT_KEYS if key not in STANDING_FIGURES}
        totals.update(self._totals)
        current = self._engine_figures()
        if self._step_open:
            _accumulate(totals, current)
        for key in STANDING_FIGURES:
            totals[key] = current.get(key, 0)
        return totals


def _input_embeddings(model: nn.Module) -> List[nn.Module]:
    """The input embedding modules of the PreTrainedModels inside `model`."""
    found: List[nn.Module] = []
    for module in model.modules():
        if not isinstance(module, PreTrainedModel):
            continue
        try:
            embeddings = module.get_input_embeddings()
        except (NotImplementedError, AttributeError):
            continue
        if isinstance(embeddings, nn.Module) and all(embeddings is not m for m in found):
            found.append(embeddings)
    return found


class _RequiresGrad(torch.autograd.Function):
    """Identity whose output requires grad because `anchor` does; its node saves nothing,
    so the input's storage is held by nobody but its users."""

    @staticmethod
    def forward(ctx, tensor, anchor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return None, None


_ANCHOR = torch.zeros((), requires_grad=True)


class _RequireGradWithoutLeaf:
    """Stands in for enable_input_require_grads' `output.requires_grad_(True)` hook: the same
    outcome (the output requires grad, gradients reach the checkpointed layers' parameters
    exactly as before) without a leaf that AccumulateGrad keeps alive until backward. A
    model cannot modify the output in place either way (a leaf that requires grad refuses
    it, and so does a view made inside a custom Function)."""

    def __init__(self, handle: OffloadHandle, original: Callable):
        self.handle = handle
        self.original = original

    def __call__(self, module, inputs, output):
        if (isinstance(output, torch.Tensor) and not output.requires_grad
                and torch.is_grad_enabled()):
            return _RequiresGrad.apply(output, _ANCHOR)
        if isinstance(output, torch.Tensor):
            output.requires_grad_(True)  # without grad, or already requiring it: as the original
        return None

    def __reduce_ex__(self, protocol):
        return _reduced_as(self.original)

    def __deepcopy__(self, memo):
        return _deepcopy_reduced(self, memo)


def _token_count(args: tuple, kwargs: dict) -> int:
    """Tokens in a forward call's batch: input_ids (or inputs_embeds) elements, 0 if unknown."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, torch.Tensor):
        return ids.numel()
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor) and embeds.dim() >= 2:
        return embeds.shape[:-1].numel()
    return 0


def _hidden_size(model: nn.Module) -> int:
    """The hidden size of the (text) decoder of `model`, from its transformers config."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(module, PreTrainedModel) and config is not None:
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            hidden = getattr(text, "hidden_size", None)
            if isinstance(hidden, int) and hidden > 0:
                return hidden
    raise ValueError(f"{type(model).__name__}: no transformers config with a hidden_size, so "
                     "the host pool cannot be sized from a token count")


def _compile_options(value: Any) -> Optional[Dict[str, Any]]:
    """enable_activation_offload's `compile`: None/False (off), True or torch.compile kwargs."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, dict):
        return dict(value)
    raise ValueError(f"compile: expected True, False, None or a dict of torch.compile "
                     f"options, got {type(value).__name__} {value!r}")


def _accumulate(totals: Dict[str, float], step: Dict[str, float]) -> None:
    for key, value in step.items():
        if key in STEP_PEAKS:
            totals[key] = max(totals.get(key, 0), value)
        elif key not in STANDING_FIGURES:
            totals[key] = totals.get(key, 0) + value


class _OffloadingCheckpoint:
    """Stands in for a module's `_gradient_checkpointing_func`: non-reentrant
    torch.utils.checkpoint whose positional tensor inputs are tagged as one offload group."""

    def __init__(self, handle: OffloadHandle, options: Dict[str, Any], original: Callable):
        self.handle = handle
        self.options = options
        self.original = original  # the function replaced: what a copy of the model gets

    def __reduce_ex__(self, protocol):
        return _reduced_as(self.original)

    def __deepcopy__(self, memo):
        return _deepcopy_reduced(self, memo)

    def __call__(self, function: Callable, *args, **kwargs):
        if not torch.is_grad_enabled():
            # Nothing is saved (no_grad, inference mode: a reference or old-policy forward,
            # generation in training mode): the user's function, as without ckpt_offload.
            return self.original(function, *args, **kwargs)
        if torch.compiler.is_compiling():
            # Traced into a compiled graph (a layer the user compiled, where transformers
            # checkpoints from inside the layer's call): the graph holds the checkpoint, and
            # this layer's input stays on the device, as it would without ckpt_offload.
            return self.original(function, *args, **kwargs)
        layer = _layer_of(function)
        budget = self.handle._budget
        function, args = _hidden_states_as_positional(function, args)
        tensors = [a for a in args
                   if isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter)]
        if budget.mode(layer) == RESIDENT:
            # The memory budget's plan: this layer's saved tensors stay on the device, but for
            # the storages its plan offloads within its copy window, and it is not
            # recomputed (its random ops run once, as checkpointing's replay does). It is a
            # group all the same: the tensors saved after the last group are the model's
            # head, and a resident layer's are not. The group is tagged with detached aliases
            # of the inputs (they give it its device), so that the input, where the layer
            # saves it, stays too: the plan counts it among the layer's saved bytes, and an
            # offloaded one would come back once per node that saved it, each restore on
            # demand (a float32 residual stream's norm saves its input itself).
            aliases = [t.detach() for t in tensors]
            with ckpt_offload.mark_checkpoint_inputs(*aliases), budget.saving_storages(layer):
                output = function(*args)
            if self.handle._defer_prefetch and budget.is_lowest_resident(layer):
                # Backward reaches the layers below once this one's is done, and a loss that
                # offloaded nothing (a fused one) restores nothing ahead of them: the first
                # is prefetched as this layer's backward begins, hidden by it.
                _prefetch_at_gradient(self.handle.engine, output)
            return output
        kwargs.pop("use_reentrant", None)
        options = {**self.options, **kwargs, "use_reentrant": False}
        if budget.measuring():
            # A user's own context_fn decides what the recompute keeps: no candidates.
            function = budget.measure(layer, function, "context_fn" not in options)
        kept, offloaded = budget.kept(layer), budget.offloaded(layer)
        if offloaded and tensors and "context_fn" not in options:
            # The plan's ops offload their outputs with the layer's input (and keep those it
            # keeps on the device) for the recompute, which skips them.
            options["context_fn"] = saving_outputs(self.handle.engine, kept, offloaded)
        elif kept and "context_fn" not in options:
            # SELECTIVE: the plan's ops keep their outputs for the recompute.
            options["context_fn"] = keeping(kept)
            if _ASKS_SAC_HOOKS:
                options["respect_saved_tensors_hooks"] = False
        if not tensors:
            self._warn_untaggable(layer, function)
        profile = self.handle._peak.current
        if profile is not None and not profile.in_forward:
            profile = None
        if profile is not None:
            # The profiled step: its recompute in backward is a phase boundary.
            function = profile.recompute_probe(function)
        if self.handle._defer_prefetch and tensors:
            # Outside the probe: a prefetch at the recompute's start belongs before the
            # boundary, as one issued when the layer's input is restored would be.
            function = _PrefetchAfterMlp(self.handle.engine, layer, function,
                                         at_recompute=budget.offloads_outputs())
        with ckpt_offload.mark_checkpoint_inputs(*tensors):
            output = torch.utils.checkpoint.checkpoint(function, *args, **options)
        if profile is not None:
            profile.layer_forward_ended(tensors)
        return output

    def _warn_untaggable(self, layer: Optional[nn.Module], function: Callable) -> None:
        name = type(layer).__name__ if layer is not None else getattr(function, "__name__", "?")
        if name in self.handle._warned_layers:
            return
        self.handle._warned_layers.add(name)
        warnings.warn(
            f"ckpt_offload.hf: {name} passed no tensor positionally to its checkpoint call and "
            "no `hidden_states=` keyword, so its inputs stay on the device (pass the hidden "
            "states positionally to have them offloaded)", UserWarning, stacklevel=3)


def _layer_of(function: Callable) -> Optional[nn.Module]:
    """The module a checkpointed function runs, or None. GradientCheckpointingLayer
    checkpoints `partial(super().__call__, **kwargs)` (a bound call: its __self__) up to
    transformers 5.2x, and `partial(forward, self, **kwargs)` (the module first among the
    partial's arguments) in later releases."""
    layer = getattr(getattr(function, "func", function), "__self__", None)
    if layer is None and isinstance(function, functools.partial) and function.args:
        layer = function.args[0]
    return layer if isinstance(layer, nn.Module) else None


class _PrefetchAfterMlp:
    """A checkpointed layer's function, wrapped so that the layers below are prefetched once
    this layer's MLP has run its backward (the layer's memory peak); the rest of the layer's
    backward (attention) hides the copy. In the forward, a forward hook on `layer.mlp`, for
    that call only, puts a gradient hook on the MLP's input: backward runs through the
    forward's graph (the recompute only refills its saved tensors), and that gradient is
    ready when the MLP's backward is done. A layer without an `mlp` module, or whose MLP
    input needs no gradient, prefetches when its recompute begins instead; so does every layer
    when `at_recompute` (a memory budget's step whose layers offload op outputs: each group
    is larger than an input, and the attention's backward alone would not hide its copy;
    the plan counts the prefetched layer beside the recomputed one)."""

    def __init__(self, engine, layer: Optional[nn.Module], function: Callable,
                 at_recompute: bool = False):
        self.engine = engine
        self.mlp = (getattr(layer, "mlp", None) if layer is not None and not at_recompute
                    else None)
        self.function = function
        self.hooked = False  # a gradient hook prefetches: nothing to do at the recompute

    def __call__(self, *args, **kwargs):
        if torch._C._current_graph_task_id() != -1:  # the recompute, inside backward
            if not self.hooked:
                self.engine.prefetch_ahead()
            return self.function(*args, **kwargs)
        if not isinstance(self.mlp, nn.Module):
            return self.function(*args, **kwargs)
        hook = self.mlp.register_forward_hook(self._on_mlp_input)
        try:
            return self.function(*args, **kwargs)
        finally:
            hook.remove()

    def _on_mlp_input(self, module, inputs, output) -> None:
        first = inputs[0] if inputs else None
        if isinstance(first, torch.Tensor) and first.requires_grad and not self.hooked:
            first.register_hook(self._prefetch)
            self.hooked = True

    def _prefetch(self, grad) -> None:
        self.engine.prefetch_ahead()


def _prefetch_at_gradient(engine, output) -> None:
    """Prefetches the groups below the acquired one (all of them, before any acquire) once
    the gradient of `output`'s first tensor that needs one is ready: its layer's backward
    begins."""
    tensors = output if isinstance(output, (tuple, list)) else (output,)
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    if first is None or not first.requires_grad:
        return

    def prefetch(grad) -> None:
        engine.prefetch_ahead()

    first.register_hook(prefetch)


def _hidden_states_as_positional(function: Callable, args: tuple):
    """GradientCheckpointingLayer checkpoints `partial(super().__call__, **kwargs)`, so a
    `hidden_states=` keyword would reach checkpoint inside the closure, where saved-tensor
    hooks never see it. Pass it as the first positional argument instead and put it back
    in place as a keyword inside the checkpointed call."""
    if not isinstance(function, functools.partial):
        return function, args
    hidden_states = function.keywords.get("hidden_states")
    if not isinstance(hidden_states, torch.Tensor):
        return function, args
    inner, inner_args = function.func, function.args
    keywords = {k: v for k, v in function.keywords.items() if k != "hidden_states"}

    def call_with_hidden_states(hidden_states, *rest):
        return inner(*inner_args, *rest, hidden_states=hidden_states, **keywords)

    return call_with_hidden_states, (hidden_states, *args)


def _checkpoint_options(original: Any):
    """The torch.utils.checkpoint options that `original` (a module's checkpoint function)
    applies, and notes on what the non-reentrant replacement changes about it."""
    notes = []
    if isinstance(original, functools.partial):
        inner, options = original.func, dict(original.keywords)
    else:
        inner, options = original, {}
    reentrant = options.pop("use_reentrant", None)
    if inner is torch.utils.checkpoint.checkpoint or _is_hf_offload(inner):
        if reentrant is None or reentrant:
            notes.append(
                "gradient checkpointing was reentrant (use_reentrant=True, torch's default "
                "when unset); changed to use_reentrant=False, because reentrant "
                "checkpointing saves no inputs that could be offloaded")
    if _is_hf_offload(inner):
        notes.append("transformers' gradient_checkpointing_kwargs offload=True (torch "
                     "save_on_cpu) is replaced by ckpt_offload")
    elif inner is not torch.utils.checkpoint.checkpoint:
        name = getattr(inner, "__qualname__", type(inner).__name__)
        notes.append(f"checkpoint function {name} is replaced by non-reentrant "
                     "torch.utils.checkpoint.checkpoint")
    dropped = sorted(k for k in options if k not in _TORCH_CHECKPOINT_OPTIONS)
    if dropped:
        notes.append(f"checkpoint options {dropped} are not torch.utils.checkpoint's; dropped")
    return {k: v for k, v in options.items() if k in _TORCH_CHECKPOINT_OPTIONS}, notes


def _is_hf_offload(function: Any) -> bool:
    """transformers' own offloading checkpoint (gradient checkpointing with offload=True):
    a local `checkpoint_func` of transformers.modeling_utils that enters save_on_cpu. Its
    enclosing function has been renamed between releases; what it does has not."""
    code = getattr(function, "__code__", None)
    return (getattr(function, "__module__", None) == _HF_OFFLOAD_MODULE
            and getattr(function, "__name__", None) == "checkpoint_func"
            and code is not None and "save_on_cpu" in code.co_names)


class _OffloadingForward:
    """`forward` of the model (and of the transformers models inside it that hold the
    layers) while installed: each training forward (grad enabled, training mode: one
    micro-step) runs inside the handle's engine context."""

    def __init__(self, handle: OffloadHandle, module: nn.Module, original: Callable):
        self.handle = handle
        self.module = module
        self.original = original
        # Name, docstring and __wrapped__, so inspect.signature(model.forward) is the
        # original's (the Trainer reads it to drop dataset columns).
        functools.update_wrapper(self, original)

    # Never traced: a compiled region cannot contain the offload boundary (see
    # ckpt_offload.hf.compile). Under torch.compile(model) this frame is skipped without a
    # graph break, and the model's regions are compiled instead.
    @torch._dynamo.disable
    def __call__(self, *args, **kwargs):
        handle = self.handle
        # Only training forwards are engine steps: without grad (no_grad, inference mode)
        # nothing is saved, and in eval mode GradientCheckpointingLayer does not
        # checkpoint. Those (generation's decode steps, evaluation, a reference model's
        # forward) run the original forward and nothing else; before the first training
        # forward, the outermost level also looks for torch.compile(model) around it, so
        # that an evaluation or generation under it runs the compiled regions. (Later, a
        # training forward finds it.)
        if not (torch.is_grad_enabled() and self.module.training):
            if handle._micro_steps or handle.regions is not None or handle._looking:
                return self.original(*args, **kwargs)
            handle._looking = True
            try:
                handle._compile_like_enclosing(_NEAR_FRAMES)
                return self.original(*args, **kwargs)
            finally:
                handle._looking = False
        engine = ckpt_offload.current_engine()
        if engine is handle.engine:
            return self.original(*args, **kwargs)  # inside an outer level's step
        if handle.regions is None:
            handle._compile_like_enclosing()
        if engine is not None:
            return self.original(*args, **kwargs)  # a context the user entered: theirs
        handle._begin_step(_token_count(args, kwargs))
        handle._own_checkpoint_funcs()
        handle._swap_require_grads_hooks()
        profile = handle._peak.begin_step(handle._micro_steps)
        if profile is None:
            with handle.engine:
                outputs = self.original(*args, **kwargs)
            handle._budget.forward_returned(outputs)
            return outputs
        try:
            with handle.engine:
                outputs = self.original(*args, **kwargs)
        except BaseException:
            handle._peak.forward_failed()
            raise
        profile.forward_ended(handle.engine, outputs)
        handle._budget.forward_returned(outputs)
        return outputs

    def __reduce_ex__(self, protocol):
        return self.handle._forward_reduction(self.module)

    def __deepcopy__(self, memo):
        return _deepcopy_reduced(self, memo)


_PATCHES = (_OffloadingForward, _OffloadingCheckpoint, _RequireGradWithoutLeaf)


def _reduced_as(original: Any):
    """A __reduce_ex__ value that unpickles as `original` itself, through a standard-library
    callable only: itemgetter(0)((original,)) is original."""
    return operator.itemgetter(0), ((original,),)


def _deepcopy_reduced(patch: Any, memo: dict):
    """copy.deepcopy of a patch: its reduction rebuilt from deep copies, so that the copy of
    a replaced object is made (or found in `memo`) as part of the same copy."""
    rebuild, args = patch.__reduce_ex__(4)
    return rebuild(*copy.deepcopy(args, memo))
