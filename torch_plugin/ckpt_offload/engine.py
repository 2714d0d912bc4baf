"""The offload engine as a context manager over autograd's saved-tensor hooks.

The hooks themselves are C++ (ckpt_offload._C.Offloader.pack/unpack); this module only
decides which engine is active and which tensors form a checkpoint group.

Everything here is per thread, as autograd's saved-tensor hooks are: the active engine,
and the offloaders (host pools and step state) that engines of equal settings share. Two
threads training two models are two independent offloads.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import warnings
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.utils.checkpoint

from ckpt_offload._native import _C
from ckpt_offload.config import INT64_MAX, OffloadConfig, check_int, make_config

# The keys of stats(), in order: the extension's own list (its stats table).
STAT_KEYS = tuple(_C.STAT_KEYS)


class _ThreadState(threading.local):
    """This thread's active engine and its offloaders.

    Offloaders are shared by every engine of the same settings in a thread, so the host
    pool (and its pinned memory, slow to allocate) survives from one step's context to the
    next; they go when the thread ends.
    """

    def __init__(self):
        self.active: Optional["OffloadEngine"] = None
        self.entered_at = ""        # where the active engine's context was entered
        self.hooks: Optional[Tuple] = None  # the (pack, unpack) pair it pushed
        self.group_open = False     # a checkpoint group is being tagged
        self.offloaders: Dict[Tuple, "_C.Offloader"] = {}


_THREAD = _ThreadState()


def _native_settings(config: OffloadConfig, backend: str, limit: int) -> Dict[str, object]:
    """_C.Offloader's keyword arguments: OffloadConfig's engine fields, in field order, with the
    backend resolved and the host limit in bytes."""
    settings = {name: getattr(config, name) for name in config.engine_fields()}
    settings.update(backend=backend, host_memory_limit=limit)
    return settings


def _offloader_for(config: OffloadConfig, backend: str) -> "_C.Offloader":
    """This thread's offloader for `config`, made on first use."""
    limit = config.host_memory_limit_bytes()
    settings = _native_settings(config, backend, limit)
    # Every setting but the host limit, which a shared offloader takes at each use.
    key = tuple(value for name, value in settings.items() if name != "host_memory_limit")
    offloader = _THREAD.offloaders.get(key)
    if offloader is None:
        if backend == "cuda" and not _C.cuda_support_compiled():
            raise ValueError("backend: 'cuda' requested but ckpt_offload was built without "
                             "CUDA support; reinstall with a CUDA build of torch")
        offloader = _C.Offloader(**settings)
        _THREAD.offloaders[key] = offloader
    else:
        offloader.set_host_memory_limit(limit)
    return offloader


def _pop_hooks(ours: Tuple) -> None:
    """Takes our (pack, unpack) pair off autograd's hook stack. It is the top one, except
    after an exception inside a torch checkpoint: that checkpoint's hooks stay above ours
    until its generator is collected. They are lifted off, ours popped, theirs put back, so
    their own exit later pops them and nothing of ours stays active."""
    above = []
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    while top is not None and top[0] is not ours[0]:
        above.append(top)
        torch._C._autograd._pop_saved_tensors_default_hooks()
        top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if top is not None:
        torch._C._autograd._pop_saved_tensors_default_hooks()
    for pack, unpack in reversed(above):
        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


class OffloadEngine:
    """Offloads saved activations while entered (`with engine:`).

    Backward may run inside or after the block. Figures from stats() count what happened
    since the block was entered; host_* figures describe the thread's shared host pool.
    The context is per thread: entered in a thread, it offloads what that thread's
    autograd saves, through that thread's offloader.
    """

    def __init__(self, config: OffloadConfig):
        self.config = config
        backend = config.resolved_backend()
        self.backend = backend
        # The offloader of the thread that last entered (stats() reads it).
        self._offloader = _offloader_for(config, backend) if backend else None
        self._prefetch_on_acquire = True

    def __enter__(self) -> "OffloadEngine":
        state = _THREAD
        if state.active is not None:
            same = "this engine" if state.active is self else "another engine"
            raise RuntimeError(
                "ckpt_offload: offload_activations() is already active in this thread "
                f"({same}, entered at {state.entered_at}); contexts cannot be nested: "
                "exit that one first (enter one per training step). Other threads have "
                "contexts of their own.")
        if self.backend is not None:
            self._offloader = _offloader_for(self.config, self.backend)
            # The previous forward's end (if it saw no backward) is part of no step's figures.
            self._offloader.begin_step()
            self._offloader.reset_stats()
            self._offloader.set_prefetch_on_acquire(self._prefetch_on_acquire)
            hooks = (self._offloader.pack, self._offloader.unpack)
            torch._C._autograd._push_saved_tensors_default_hooks(*hooks)
            state.hooks = hooks
        _install_checkpoint_tagging()
        caller = sys._getframe(1)
        state.entered_at = f"{caller.f_code.co_filename}:{caller.f_lineno}"
        state.active = self
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        state = _THREAD
        if state.active is not self:
            return False  # __enter__ raised: nothing of ours to undo
        state.active = None
        state.group_open = False
        if state.hooks is not None:
            _pop_hooks(state.hooks)
            state.hooks = None
        if exc_type is not None and self._offloader is not None:
            # The step is abandoned: drain copies, return every host block and source.
            self._offloader.reset()
        return False

    @property
    def active(self) -> bool:
        return _THREAD.active is self

    @contextlib.contextmanager
    def group(self, tensors):
        """Tags `tensors` as the saved inputs of one checkpointed layer."""
        if self._offloader is None:
            yield
            return
        state = _THREAD
        self._offloader.begin_group(list(tensors))
        state.group_open = True
        try:
            yield
        finally:
            state.group_open = False
            self._offloader.end_group()

    def save_into_group(self, tensor: torch.Tensor, keep_restore: bool = False):
        """Saves `tensor`, an op output that the open checkpoint group's recompute will skip
        (or a tensor saved by a layer run without checkpointing), with that group: offloaded
        and brought back with the group's inputs. Returns a handle for restore(). Outside a
        group (or without an offloader) the handle keeps the tensor where it is. restore()
        raises autograd's in-place error when the tensor was modified after it was saved.
        `keep_restore`: the storage, once restored, stays until the last handle to it dies
        (for a storage restored once per use, as autograd's saved tensors are)."""
        if self._offloader is None:
            return self.keep_here(tensor)
        return self._offloader.pack_into_group(tensor, keep_restore)

    @staticmethod
    def keep_here(tensor: torch.Tensor):
        """A handle for restore() that keeps `tensor` on its device, version-checked."""
        return _KeptHere(tensor.detach(), tensor._version)

    def restore(self, handle) -> torch.Tensor:
        """The tensor `handle` (from save_into_group or keep_here) saved, on its device."""
        if isinstance(handle, _KeptHere):
            return handle.restore()
        return self._offloader.unpack(handle)

    def synchronize(self) -> None:
        """Waits for in-flight copies (figures such as exposed_wait_ms settle then)."""
        if self._offloader is not None:
            self._offloader.synchronize()

    def reset(self) -> None:
        """Drops every offloaded tensor of this engine's pool (after a failed step)."""
        if self._offloader is not None:
            self._offloader.reset()

    def reserve_host(self, num_bytes: int) -> None:
        """Grows the host pool up front for steps that offload up to `num_bytes` (the
        longest a run expects), so that none of them waits for new pinned memory. Before
        the first step the request is kept and made when the engine starts. Raises
        ValueError for a bad size, RuntimeError when the pool refuses (host_memory_limit)."""
        check_int("num_bytes", num_bytes, 0, INT64_MAX)
        if self._offloader is not None and num_bytes > 0:
            self._offloader.reserve_host(num_bytes)

    def set_prefetch_on_acquire(self, on: bool) -> None:
        """True (the default): restoring a layer's input as its backward begins also
        prefetches the layer below. False: prefetch_ahead() does, when the caller knows the
        layer's backward is past its memory peak, so the prefetched input does not add to
        that peak; a layer not prefetched so is restored when needed (and waited for).
        Takes effect at the next entry (offloaders are shared by engines of the same
        settings, so each entry sets its own)."""
        if not isinstance(on, bool):
            raise ValueError(f"on: must be True or False, got {on!r}")
        self._prefetch_on_acquire = on

    def prefetch_ahead(self) -> None:
        """Prefetches the prefetch_depth layers below the one whose input was restored
        last (see set_prefetch_on_acquire); nothing outside backward."""
        if self._offloader is not None:
            self._offloader.prefetch_ahead()

    def stats(self) -> Dict[str, float]:
        if self._offloader is None:
            return {key: 0 for key in STAT_KEYS}
        return self._offloader.stats()

    def ineligible_reason(self, tensor: torch.Tensor) -> str:
        """Why `tensor` would stay put ("" when it would be offloaded, ignoring tagging)."""
        if self._offloader is None:
            return "no offload backend (backend='auto' found no CUDA device)"
        return self._offloader.ineligible_reason(tensor)


class _KeptHere:
    """save_into_group's handle without an offloader: the tensor itself, version-checked."""

    def __init__(self, tensor: torch.Tensor, version: int):
        self.tensor = tensor
        self.version = version

    def restore(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: it is at version {self.tensor._version}; expected version "
                f"{self.version} instead")
        return self.tensor


def offload_activations(config: Optional[OffloadConfig] = None, **overrides) -> OffloadEngine:
    """`with offload_activations(keep_last=1) as engine:` offloads checkpointed layers' inputs."""
    return OffloadEngine(make_config(config, **overrides))


def current_engine() -> Optional[OffloadEngine]:
    """The engine whose context is active in this thread, or None."""
    return _THREAD.active


@contextlib.contextmanager
def mark_checkpoint_inputs(*tensors: torch.Tensor):
    """Tags `tensors` as one checkpoint group for the block's torch checkpoint call.

        with ckpt_offload.mark_checkpoint_inputs(hidden_states):
            out = torch.utils.checkpoint.checkpoint(layer, hidden_states, use_reentrant=False)

    Outside an offload context it does nothing.
    """
    engine = _THREAD.active
    if engine is None:
        yield
        return
    with engine.group(_taggable(tensors)):
        yield


def _taggable(values):
    return [v for v in values
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)]


_CHECKPOINT_OPTIONS = ("preserve_rng_state", "context_fn", "determinism_check", "debug")


def checkpoint(function, *args, **kwargs):
    """Non-reentrant activation checkpointing of `function(*args, **kwargs)` whose tensor
    positional arguments are offloaded as one group while an offload context is active.

    Outside a context it is plain torch.utils.checkpoint(use_reentrant=False). Keyword
    arguments reach `function` unchanged and are not offloaded.
    """
    if kwargs.pop("use_reentrant", False):
        raise ValueError("use_reentrant: ckpt_offload.checkpoint is always non-reentrant "
                         "(use_reentrant=False); reentrant checkpointing saves no inputs "
                         "that could be offloaded")
    options = {k: kwargs.pop(k) for k in _CHECKPOINT_OPTIONS if k in kwargs}
    tensors = _taggable(args)
    if not tensors and not any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        raise ValueError("ckpt_offload.checkpoint: got no tensor arguments, so there is "
                         "nothing to checkpoint or offload")
    engine = _THREAD.active
    if engine is None:
        return torch.utils.checkpoint.checkpoint(
            function, *args, use_reentrant=False, **options, **kwargs)
    with engine.group(tensors):
        return torch.utils.checkpoint.checkpoint(
            function, *args, use_reentrant=False, **options, **kwargs)


# torch's own non-reentrant checkpoint (torch.utils.checkpoint.checkpoint(use_reentrant=False),
# checkpoint_wrapper, a model's gradient checkpointing) saves a layer's inputs at one point,
# where autograd packs them before the call returns: _CheckpointFrame.save_inputs(*args)
# from torch 2.12, _NoopSaveInputs.apply(dummy, kwargs, *args) before. Inside an offload
# context those are checkpoint inputs like any other: they are tagged as one group, unless
# ckpt_offload already tagged this call. Each hook point: (owner, attribute, how the stored
# attribute is called, the layer's positional arguments among the call's).
_CHECKPOINT_FRAME = getattr(torch.utils.checkpoint, "_CheckpointFrame", None)
_NOOP_SAVE_INPUTS = getattr(torch.utils.checkpoint, "_NoopSaveInputs", None)
_TAGGING_UNAVAILABLE = (
    "ckpt_offload: this torch saves torch.utils.checkpoint's inputs neither through "
    "_CheckpointFrame.save_inputs nor _NoopSaveInputs.apply, so inputs of "
    "torch.utils.checkpoint calls made directly (not through ckpt_offload.checkpoint, "
    "mark_checkpoint_inputs or ckpt_offload.hf) are not offloaded")
_tagging_installed = False


def _tagging_engine() -> Optional[OffloadEngine]:
    """The engine that should tag a torch checkpoint call's inputs now, or None: ours must
    be the innermost saved-tensor hooks (a nested checkpoint's inputs are saved into its
    parent's hooks), no group open, and no backward running (a nested recompute)."""
    state = _THREAD
    engine = state.active
    if engine is None or state.hooks is None or state.group_open:
        return None
    if torch._C._current_graph_task_id() != -1:
        return None
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if top is None or top[0] is not state.hooks[0]:
        return None
    return engine


def _tagging(original: Callable, first_layer_arg: int) -> Callable:
    """`original(owner, *args)` with args[first_layer_arg:] (the layer's positional
    arguments) tagged as one checkpoint group when an engine should tag them."""

    def tagging(owner, *args, **kwargs):
        engine = _tagging_engine()
        if engine is None:
            return original(owner, *args, **kwargs)
        with engine.group(_taggable(args[first_layer_arg:])):
            return original(owner, *args, **kwargs)

    return tagging


def _install_checkpoint_tagging() -> None:
    global _tagging_installed
    if _tagging_installed:
        return
    _tagging_installed = True
    save_inputs = inspect.getattr_static(_CHECKPOINT_FRAME, "save_inputs", None)
    if inspect.isfunction(save_inputs):  # torch 2.12+: frame.save_inputs(*args)
        _CHECKPOINT_FRAME.save_inputs = _tagging(save_inputs, 0)
        return
    apply = inspect.getattr_static(_NOOP_SAVE_INPUTS, "apply", None)
    if isinstance(apply, classmethod):  # up to torch 2.11: apply(dummy, kwargs, *args)
        _NOOP_SAVE_INPUTS.apply = classmethod(_tagging(apply.__func__, 2))
        return
    warnings.warn(_TAGGING_UNAVAILABLE, UserWarning, stacklevel=3)
