"""torch.compile for models whose checkpointed layers are offloaded: region by region.

Offload works at the boundary of each checkpointed layer: autograd saves the layer's
inputs there during forward and asks for them one layer at a time during backward. A model
compiled as one graph has no such boundary: the compiled function saves everything at the
end of its forward and needs all of it back at the start of its backward, and tracing into
the offload's hooks breaks the graph at every layer. So a model with ckpt_offload is
compiled as regions:

- each checkpointed layer, inside its checkpoint (the forward and its recompute run the
  same compiled code). Where transformers checkpoints a layer's `forward` from inside the
  layer's call (transformers 5.23 does), a compiled layer would trace the checkpoint and the
  offload with it: the layer's parts that hold weights (attention, MLP, norms) are the
  regions there, and the layer's own code between them runs eagerly;
- the normalization modules outside the layers (the final norm);
- the model's `loss_function` (upcast, shift and cross-entropy become one kernel, as in a
  whole-model compile; the logits are a model output and materialized either way);

while the checkpoint-and-offload boundary between them runs eagerly. Losses and gradients
are bit-identical to the same regional compile without offload (`compile_regions` alone).

Copies: layers are compiled in place (`nn.Module.compile`), which torch drops from deep
copies and pickles; the compiled loss function copies and pickles as the function it wraps.
"""

from __future__ import annotations

import logging
import operator
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

_MISSING = object()


class CompiledRegions:
    """The regions of one model compiled by `compile_regions`; `remove()` undoes it.

    Modules a user compiled already (`module.compile()`) are left as they are, and stay
    compiled after remove()."""

    def __init__(self, model: nn.Module, options: Dict[str, Any]):
        self.options, dropped = _without_cuda_graphs(options)
        if dropped:
            tell_once(
                "ckpt_offload.hf: the compiled regions are built without CUDA graphs (asked "
                "for by mode='reduce-overhead' or 'max-autotune'): a CUDA graph keeps its "
                "outputs in its own memory pool, so moving layer inputs to host memory would "
                "free no device memory. mode='max-autotune-no-cudagraphs' keeps max-autotune's "
                "kernel tuning.")
        self.modules: List[nn.Module] = []
        self.layer_count = 0  # checkpointed layers compiled, whole or by their parts
        # (PreTrainedModel, its `_loss_function` before, or _MISSING)
        self._losses: List[tuple] = []
        try:
            for module in region_modules(model):
                if module._compiled_call_impl is None:
                    module.compile(**self.options)
                    self.modules.append(module)
            compiled = set(map(id, self.modules))
            self.layer_count = sum(
                1 for layer in model.modules() if isinstance(layer, GradientCheckpointingLayer)
                and (id(layer) in compiled or any(id(c) in compiled for c in layer.children())))
            for owner in model.modules():
                if isinstance(owner, PreTrainedModel) and not isinstance(
                        owner.__dict__.get("_loss_function"), CompiledLoss):
                    before = owner.__dict__.get("_loss_function", _MISSING)
                    owner.loss_function = CompiledLoss(owner.loss_function, self.options)
                    self._losses.append((owner, before))
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Puts back what was compiled here (idempotent)."""
        for module in self.modules:
            module._compiled_call_impl = None
        self.modules.clear()
        self.layer_count = 0
        for owner, before in self._losses:
            if isinstance(owner.__dict__.get("_loss_function"), CompiledLoss):
                if before is _MISSING:
                    del owner.__dict__["_loss_function"]
                else:
                    owner.__dict__["_loss_function"] = before
        self._losses.clear()


_told: set = set()
_logger = logging.getLogger("ckpt_offload.hf")


def tell_once(message: str) -> None:
    """Logs `message` as a warning the first time it is said in this process."""
    if message not in _told:
        _told.add(message)
        _logger.warning(message)


def _without_cuda_graphs(options: Dict[str, Any]) -> Tuple[Dict[str, Any], bool]:
    """torch.compile `options` with CUDA graphs taken out, and whether any were asked for."""
    options = dict(options)
    backend = options.get("backend")
    config = getattr(backend, "config", None)
    if getattr(backend, "compiler_name", "") == "inductor" and isinstance(config, dict):
        # The inductor backend of a torch.compile call: its mode is already in `config`.
        if not config.get("triton.cudagraphs"):
            return options, False
        options.update(backend="inductor", dynamic=getattr(backend, "dynamic", None),
                       options={k: v for k, v in config.items() if k != "triton.cudagraphs"})
        return options, True
    mode = options.get("mode")
    if mode in _NO_CUDA_GRAPHS_MODE:
        options["mode"] = _NO_CUDA_GRAPHS_MODE[mode]
        return options, True
    inductor_options = options.get("options")
    if isinstance(inductor_options, dict) and inductor_options.get("triton.cudagraphs"):
        options["options"] = {k: v for k, v in inductor_options.items()
                              if k != "triton.cudagraphs"}
        return options, True
    return options, False


_NO_CUDA_GRAPHS_MODE = {"reduce-overhead": "default",
                        "max-autotune": "max-autotune-no-cudagraphs"}


def compile_regions(model: nn.Module, **options) -> CompiledRegions:
    """Compiles `model`'s regions in place with torch.compile `options` (backend, mode,
    dynamic, options, ...): its checkpointed layers, the norms outside them and its loss
    function. The same compile that ckpt_offload applies under offload, without offload:
    the reference for comparing losses and gradients bit for bit."""
    return CompiledRegions(model, options)


# GradientCheckpointingLayer checkpoints its `__call__` in older transformers (5.17 to 5.20
# at least); newer ones (5.23) wrap each layer class's `forward`, which the call runs.
LAYER_CALL_IS_CHECKPOINTED = "__call__" in GradientCheckpointingLayer.__dict__


def region_modules(model: nn.Module) -> List[nn.Module]:
    """Checkpointed layers (transformers GradientCheckpointingLayer), or where transformers
    checkpoints from inside a layer's call, the parts of each that hold weights (of layers
    not compiled already); then normalization modules that are not inside a layer."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    inside = {id(sub) for layer in layers for sub in layer.modules()}
    norms = [m for m in model.modules()
             if id(m) not in inside and not any(True for _ in m.children())
             and type(m).__name__.endswith("Norm")]  # RMSNorm, LayerNorm, ...
    if LAYER_CALL_IS_CHECKPOINTED:
        return layers + norms
    parts = [part for layer in layers if layer._compiled_call_impl is None
             for part in layer.children()
             if not isinstance(part, GradientCheckpointingLayer)
             and any(True for _ in part.parameters())]
    return parts + norms


class CompiledLoss:
    """A model's `loss_function`, compiled. Deep copies and pickles as the function itself."""

    def __init__(self, function: Callable, options: Dict[str, Any]):
        self.function = function
        self.compiled = torch.compile(function, **options)

    def __call__(self, *args, **kwargs):
        return self.compiled(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        # itemgetter(0)((f,)) is f: a standard-library callable stands in for this class.
        return operator.itemgetter(0), ((self.function,),)


def backend_of(optimized: Any) -> Optional[Any]:
    """The compiler torch.compile gave `optimized` (an OptimizedModule): its backend with
    the mode and options it was called with, usable as `torch.compile(backend=...)`."""
    backend = getattr(getattr(optimized, "dynamo_ctx", None), "callback", None)
    while hasattr(backend, "_torchdynamo_orig_backend"):
        backend = backend._torchdynamo_orig_backend
    return backend if callable(backend) else None


def enclosing_compiled_module(max_frames: int = 24) -> Optional[Any]:
    """The torch.compile'd module (OptimizedModule) whose call is running this one, from
    the call stack, or None. An OptimizedModule calls its module through one of dynamo's
    frames (torch/_dynamo/eval_frame.py), so only the nn.Module call frames above such a
    frame are looked into: reading a frame's locals is what costs, and a stack without
    torch.compile (a generation's decode step) is walked with one code test per frame."""
    optimized_type = getattr(torch._dynamo.eval_frame, "OptimizedModule", None)
    if optimized_type is None:
        return None
    frame = sys._getframe(2)
    compiled_call = False
    try:
        for _ in range(max_frames):
            if frame is None:
                return None
            code = frame.f_code
            if not compiled_call:
                compiled_call = (code.co_filename == _EVAL_FRAME_FILE
                                 and code not in _DISABLED_CALL_CODES)
            elif code in _MODULE_CALL_CODES:
                owner = frame.f_locals.get("self")
                if isinstance(owner, optimized_type):
                    return owner
            frame = frame.f_back
        return None
    finally:
        del frame


_EVAL_FRAME_FILE = torch._dynamo.eval_frame.__file__

# The frame torch._dynamo.disable puts around a function (ckpt_offload's forward wrapper
# has one): dynamo's, but no sign of a compiled call.
_DISABLED_CALL_CODES = tuple(
    code for code in (getattr(torch._dynamo.disable(lambda: None), "__code__", None),)
    if code is not None and code.co_filename == _EVAL_FRAME_FILE)

_MODULE_CALL_CODES = tuple(
    getattr(nn.Module, name).__code__ for name in ("_wrapped_call_impl", "_call_impl")
    if hasattr(getattr(nn.Module, name, None), "__code__"))
