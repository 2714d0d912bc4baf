"""The offload engine as a context manager over autograd's saved-tensor hooks.

The hooks themselves are C++ (ckpt_offload._C.Offloader.pack/unpack); this module only
decides which engine is active and which tensors form a checkpoint group.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, Optional, Tuple

import torch
import torch.utils.checkpoint

from ckpt_offload import _C
from ckpt_offload.config import OffloadConfig, make_config

STAT_KEYS = (
    "offloaded_tensors", "offloaded_bytes", "restored_tensors", "restored_bytes",
    "kept_resident_tensors", "prefetched_tensors", "exposed_wait_ms", "cap_fallbacks",
    "reclaimed_tensors",
    "groups", "device_held_bytes", "peak_device_held_bytes", "host_reserved_bytes",
    "host_live_bytes", "host_peak_bytes", "host_live_blocks", "pinned_allocations",
    "pinned_allocation_seconds", "host_cap_rejections", "host_backend_failures",
    "packed_tensors", "skipped_tensors", "shared_storage_hits",
    "head_offloaded_tensors", "head_offloaded_bytes", "head_restored_tensors",
    "head_restored_bytes", "head_kept_tensors", "head_cap_fallbacks",
)

# Offloaders are shared by every engine of the same settings, so the host pool (and its
# pinned memory, slow to allocate) survives from one step's context to the next.
_OFFLOADERS: Dict[Tuple, "_C.Offloader"] = {}
_OFFLOADERS_LOCK = threading.Lock()
_ACTIVE: Optional["OffloadEngine"] = None


def _offloader_for(config: OffloadConfig, backend: str) -> "_C.Offloader":
    limit = config.host_memory_limit_bytes()
    key = (backend, config.keep_last, config.prefetch_depth, config.min_offload_bytes,
           config.scope, config.max_inflight_d2h_groups, config.offload_head)
    with _OFFLOADERS_LOCK:
        offloader = _OFFLOADERS.get(key)
        if offloader is None:
            if backend == "cuda" and not _C.cuda_support_compiled():
                raise ValueError("backend: 'cuda' requested but ckpt_offload was built without "
                                 "CUDA support; reinstall with a CUDA build of torch")
            offloader = _C.Offloader(
                keep_last=config.keep_last, prefetch_depth=config.prefetch_depth,
                min_offload_bytes=config.min_offload_bytes, host_memory_limit=limit,
                backend=backend, scope=config.scope,
                max_inflight_d2h_groups=config.max_inflight_d2h_groups,
                offload_head=config.offload_head)
            _OFFLOADERS[key] = offloader
        else:
            offloader.set_host_memory_limit(limit)
        return offloader


class OffloadEngine:
    """Offloads saved activations while entered (`with engine:`).

    Backward may run inside or after the block. Figures from stats() count what happened
    since the block was entered; host_* figures describe the shared host pool.
    """

    def __init__(self, config: OffloadConfig):
        self.config = config
        backend = config.resolved_backend()
        self.backend = backend
        self._offloader = _offloader_for(config, backend) if backend else None
        self._hooks = None

    def __enter__(self) -> "OffloadEngine":
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError(
                "ckpt_offload: offload_activations() is already active; contexts cannot be "
                "nested (enter one per training step)")
        if self._offloader is not None:
            self._offloader.reset_stats()
            self._offloader.begin_step()
            self._hooks = torch.autograd.graph.saved_tensors_hooks(
                self._offloader.pack, self._offloader.unpack)
            self._hooks.__enter__()
        _ACTIVE = self
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        global _ACTIVE
        _ACTIVE = None
        if self._hooks is not None:
            self._hooks.__exit__(exc_type, exc, tb)
            self._hooks = None
        if exc_type is not None and self._offloader is not None:
            # The step is abandoned: drain copies, return every host block and source.
            self._offloader.reset()
        return False

    @property
    def active(self) -> bool:
        return _ACTIVE is self

    @contextlib.contextmanager
    def group(self, tensors):
        """Tags `tensors` as the saved inputs of one checkpointed layer."""
        if self._offloader is None:
            yield
            return
        self._offloader.begin_group(list(tensors))
        try:
            yield
        finally:
            self._offloader.end_group()

    def synchronize(self) -> None:
        """Waits for in-flight copies (figures such as exposed_wait_ms settle then)."""
        if self._offloader is not None:
            self._offloader.synchronize()

    def reset(self) -> None:
        """Drops every offloaded tensor of this engine's pool (after a failed step)."""
        if self._offloader is not None:
            self._offloader.reset()

    def stats(self) -> Dict[str, float]:
        if self._offloader is None:
            return {key: 0 for key in STAT_KEYS}
        return self._offloader.stats()

    def ineligible_reason(self, tensor: torch.Tensor) -> str:
        """Why `tensor` would stay put ("" when it would be offloaded, ignoring tagging)."""
        if self._offloader is None:
            return "no offload backend (backend='auto' found no CUDA device)"
        return self._offloader.ineligible_reason(tensor)


def offload_activations(config: Optional[OffloadConfig] = None, **overrides) -> OffloadEngine:
    """`with offload_activations(keep_last=1) as engine:` offloads checkpointed layers' inputs."""
    return OffloadEngine(make_config(config, **overrides))


def current_engine() -> Optional[OffloadEngine]:
    """The engine whose context is active, or None."""
    return _ACTIVE


@contextlib.contextmanager
def mark_checkpoint_inputs(*tensors: torch.Tensor):
    """Tags `tensors` as one checkpoint group for the block's torch checkpoint call.

        with ckpt_offload.mark_checkpoint_inputs(hidden_states):
            out = torch.utils.checkpoint.checkpoint(layer, hidden_states, use_reentrant=False)

    Outside an offload context it does nothing.
    """
    engine = _ACTIVE
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
    engine = _ACTIVE
    if engine is None:
        return torch.utils.checkpoint.checkpoint(
            function, *args, use_reentrant=False, **options, **kwargs)
    with engine.group(tensors):
        return torch.utils.checkpoint.checkpoint(
            function, *args, use_reentrant=False, **options, **kwargs)
