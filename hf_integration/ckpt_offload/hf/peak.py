"""Where a training micro-step's device-memory peak is: "is offload even working?", "why is
my peak still high?".

Once per installation, one training micro-step (the second: the first one's warm-up
allocations would distort it) is profiled and its peak broken down, measured above the
memory allocated when the step began:

- step_peak_bytes: the step's peak;
- hidden_states_kept_bytes: checkpointed layer inputs still on the device at the end of
  forward (the keep_last window, host-cap fallbacks, tensors too small to offload);
- offload_removed_bytes: what offload moved off the device in this step (layer inputs and
  the head's tensors: the engine's offloaded_bytes + head_offloaded_bytes);
- head_loss_bytes: the peak from the end of the last checkpointed layer's forward until the
  first layer recompute in backward (final norm, LM head, loss forward and backward),
  above the memory allocated when that stretch began;
- layer_recompute_bytes: the largest peak of one layer's recompute + backward (until the
  gradient of its input is ready), above the memory allocated when its recompute began;
- layer_phase_peak_bytes (not a part): the highest the memory rose during the layers'
  recomputes and backward, above what was allocated when the step began;
- head_phase_peak_bytes (not a part): the same from the step's beginning until the first
  layer recompute (the forward, then the head's stretch);
- forward_peak_bytes, head_peak_bytes (not parts): the same for the forward alone (until
  the last checkpointed layer's forward ended) and for the head's stretch alone;
- head_stranded_bytes (not a part): the allocator's free pieces in segments that also hold
  live tensors as the head began (0 on CPU), which a fresh logits block cannot use;
- dominant ("head_loss", "layer_recompute" or "hidden_states_kept") and advice.

Meters. CUDA: the caching allocator's counters (memory_allocated, max_memory_allocated;
host-side bookkeeping, read without synchronizing). The allocator's peak counter is reset at
each phase boundary of the profiled step, so after it torch.cuda.max_memory_allocated()
covers only the step's last phase. CPU (the host backend): a TorchDispatchMode, on during
the profiled step only, adds up the bytes of the tensor storages that ops create and notices
when they are freed (every op of forward and backward, recomputes and the engine's restores
included). It sees storages, not scratch memory inside one kernel, nor frees of tensors
made before the step. The mode leaves the stack at the next call from outside backward
(the next step, peak_breakdown(), stats(); the Trainer callback's on_pre_optimizer_step):
autograd would undo a pop inside backward. Not on CPU under torch.compile, whose compiled
code a dispatch mode would change.

Steps that are not profiled cost one method call in the forward wrapper and one attribute
test in each checkpoint call: no hook, no synchronization. The profiled step costs its
meter's reads, one wait for the forward's copies to the host at its end (the engine waits
for them when backward begins anyway), and on CPU a Python call per op.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_leaves

logger = logging.getLogger("ckpt_offload.hf")

GIB = float(1 << 30)

# The micro-step (counted from 1 after installation) that is profiled unless asked otherwise.
FIRST_PROFILED_STEP = 2

# Breakdown figures (bytes) and their keys in OffloadHandle.stats().
FIGURES = ("step_peak_bytes", "hidden_states_kept_bytes", "offload_removed_bytes",
           "head_loss_bytes", "layer_recompute_bytes")
STAT_KEYS = {"step_peak_bytes": "peak_step_bytes",
             **{name: "peak_" + name for name in FIGURES if name != "step_peak_bytes"}}

# The parts `dominant` chooses from, in the order ties are broken.
PARTS = ("head_loss", "layer_recompute", "hidden_states_kept")


class CudaMeter:
    """Device memory of one CUDA device, from the caching allocator's counters."""

    name = "cuda"

    def __init__(self, device: int):
        self.device = device
        torch.cuda.reset_peak_memory_stats(device)
        self.base = torch.cuda.memory_allocated(device)

    def now(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self.base

    def peak(self) -> int:
        """The peak since the last mark() (or the start)."""
        return torch.cuda.max_memory_allocated(self.device) - self.base

    def mark(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)  # the peak restarts from now

    def stranded(self) -> int:
        """Free pieces of segments that also hold live tensors: reserved memory that only a
        block fitting one of them can use, and that emptying the cache cannot return."""
        stats = torch.cuda.memory_stats_as_nested_dict(self.device)
        return int(stats["inactive_split_bytes"]["all"]["current"])

    def stop(self) -> None:
        pass

    def remove(self) -> bool:
        return True


class LiveTensorMeter(TorchDispatchMode):
    """CPU: the bytes of the tensor storages that ops create while the meter records and
    that are still alive. Every op that reaches the dispatcher passes through it (autograd's
    backward and the engine's C++ restores too); an op's new output storages are added
    (outputs that share an input's storage, views and in-place results, are not new), and
    before each op is counted the storages that died since are subtracted (a weak reference
    to each tells). Python frees tensors between ops, never during one, so the count after
    each op is exact for the storages it tracks, and the peak is the largest such count.
    """

    name = "cpu"

    def __init__(self):
        super().__init__()
        # StorageImpl address -> (weak reference, bytes). A weak reference keeps the
        # StorageImpl object (not its memory) alive, so its address is not reused meanwhile.
        self._live: Dict[int, Tuple[StorageWeakRef, int]] = {}
        self._bytes = 0
        self._peak = 0
        self.recording = False

    def start(self) -> "LiveTensorMeter":
        self.__enter__()
        self.recording = True
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.recording:
            self._count(out, args, kwargs)
        return out

    def _count(self, out: Any, args: tuple, kwargs: Optional[dict]) -> None:
        self._drop_freed()
        inputs = None
        for tensor in tree_leaves(out):
            storage = _storage_of(tensor)
            if storage is None:
                continue
            key, nbytes = storage._cdata, storage.nbytes()
            known = self._live.get(key)
            if known is not None:
                # A storage this meter tracks, resized in place (an out= op): count its size.
                self._bytes += nbytes - known[1]
                self._live[key] = (known[0], nbytes)
                continue
            if inputs is None:
                inputs = {s._cdata for s in map(_storage_of, tree_leaves((args, kwargs)))
                          if s is not None}
            if key not in inputs:
                self._live[key] = (StorageWeakRef(storage), nbytes)
                self._bytes += nbytes
        self._peak = max(self._peak, self._bytes)

    def _drop_freed(self) -> None:
        freed = [key for key, (ref, _) in self._live.items() if ref.expired()]
        for key in freed:
            self._bytes -= self._live.pop(key)[1]

    def now(self) -> int:
        self._drop_freed()
        return self._bytes

    def peak(self) -> int:
        return self._peak

    def mark(self) -> None:
        self._peak = self.now()

    def stranded(self) -> int:
        return 0  # no allocator: every freed byte is free

    def stop(self) -> None:
        """Stops counting; the mode stays on the stack until remove()."""
        self.recording = False
        self._live.clear()

    def remove(self) -> bool:
        """Takes the mode off this thread's stack, when it is on top there. Not inside
        backward: autograd restores the thread's modes after each node, so a pop there
        would be undone."""
        if torch._C._current_graph_task_id() != -1 or _get_current_dispatch_mode() is not self:
            return False
        self.__exit__(None, None, None)
        return True


def _storage_of(value: Any) -> Optional[torch.UntypedStorage]:
    if isinstance(value, torch.UntypedStorage):
        return value
    if isinstance(value, torch.TypedStorage):
        return value._untyped_storage
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return value.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None  # no storage: sparse, nested, or a tensor subclass without one


class StepProfile:
    """The phases of one profiled micro-step, told by the handle's hooks. Memory is read at
    each boundary; a stretch's figure is its peak above the memory when it began.

    forward: each checkpointed layer's forward ends -> the "head" stretch (re)starts, so the
        one after the last layer's forward is the head's: final norm, LM head, loss forward,
        then the loss's and the LM head's backward;
    backward: a checkpointed function runs inside backward (a recompute) -> a "layer"
        stretch starts, ending the head's or the previous layer's; the gradient of the
        layer's input is ready -> that layer's stretch ends (the embedding's backward after
        the first layer belongs to no part); autograd's final callback -> done.
    """

    def __init__(self, tracker: "PeakTracker", meter, micro_step: int):
        self.tracker = tracker
        self.meter = meter
        self.micro_step = micro_step
        self.phase = "forward"       # forward, backward, done or abandoned
        self.stretch: Optional[str] = "head"  # what the memory since the last boundary is
        self.stretch_start = 0
        self.step_peak = 0
        self.head_loss = 0
        self.layer_recompute = 0
        self.layer_phase_peak = 0
        self.forward_peak = 0
        self.head_peak = 0
        self.hidden_states_kept = 0
        self.head_stranded = 0  # the meter's stranded() as the last layer's forward ended
        self._inputs: Dict[int, Tuple[StorageWeakRef, int]] = {}  # tagged layer inputs
        self._end_queued = False

    @property
    def in_forward(self) -> bool:
        return self.phase == "forward"

    def _boundary(self, next_stretch: Optional[str]) -> None:
        """Ends the current stretch (its peak goes to its part, and to the step's) and
        starts `next_stretch`."""
        peak = self.meter.peak()
        self.step_peak = max(self.step_peak, peak)
        rise = peak - self.stretch_start
        if self.phase == "forward":
            self.forward_peak = max(self.forward_peak, peak)
        elif self.stretch == "head":
            self.head_peak = max(self.head_peak, peak)
        if self.phase != "forward":  # in forward, a "head" stretch ended by a layer was none
            if self.stretch == "head":
                self.head_loss = rise
            elif self.stretch == "layer":
                self.layer_recompute = max(self.layer_recompute, rise)
                self.layer_phase_peak = max(self.layer_phase_peak, peak)
        self.meter.mark()
        self.stretch_start = self.meter.now()
        self.stretch = next_stretch

    # Forward.

    def layer_forward_ended(self, inputs: List[torch.Tensor]) -> None:
        """A checkpointed layer's forward returned: its inputs are noted (and the first that
        requires grad tells when the layer's backward is done), and the head stretch
        starts."""
        hooked = False
        for tensor in inputs:
            storage = _storage_of(tensor)
            if storage is not None and storage._cdata not in self._inputs:
                self._inputs[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
            if not hooked and tensor.requires_grad:
                tensor.register_hook(self._layer_backward_ended)
                hooked = True
        self._boundary("head")
        self.head_stranded = self.meter.stranded()

    def recompute_probe(self, function: Callable) -> Callable:
        """`function` as checkpoint gets it: called inside backward, it is a recompute."""
        def probed(*args, **kwargs):
            if torch._C._current_graph_task_id() != -1:
                self._recompute_started()
            return function(*args, **kwargs)

        return probed

    def forward_ended(self, engine, outputs: Any) -> None:
        """The model's forward returned: which layer inputs are still on the device (once the
        forward's copies to the host are done), and a hook that learns when backward runs."""
        if self.phase != "forward":
            return
        self.phase = "backward"
        engine.synchronize()  # the sources of finished copies are released
        self.hidden_states_kept = sum(
            nbytes for ref, nbytes in self._inputs.values() if not ref.expired())
        self._inputs.clear()
        for tensor in tree_leaves(outputs):
            if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
                tensor.register_hook(self._backward_started)
                break

    # Backward (these run inside autograd).

    def _backward_started(self, grad) -> None:
        self._queue_end()

    def _queue_end(self) -> None:
        if not self._end_queued:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _recompute_started(self) -> None:
        if self.phase == "backward":
            self._queue_end()
            self._boundary("layer")

    def _layer_backward_ended(self, grad) -> None:
        if self.phase == "backward" and self.stretch == "layer":
            self._boundary(None)

    def _backward_ended(self) -> None:
        if self.phase != "backward":
            return
        self._boundary(None)
        self.phase = "done"
        self.meter.stop()
        self.tracker.finished(self)

    def abandon(self) -> None:
        self.phase = "abandoned"
        self.meter.stop()


class PeakTracker:
    """The profiled micro-steps of one OffloadHandle and the latest breakdown."""

    def __init__(self, handle):
        self.handle = handle
        self.profile_at: Optional[int] = FIRST_PROFILED_STEP
        self.withheld = False  # withhold(): no step is profiled unless asked for by name
        self.current: Optional[StepProfile] = None  # the profile in progress, read by hooks
        self.result: Optional[Dict[str, Any]] = None
        self._removing: List[Any] = []  # stopped meters still to take off the mode stack

    def profile_next_step(self) -> None:
        """The next micro-step is profiled (the second, if none has run yet)."""
        self.profile_at = max(self.handle._micro_steps + 1, FIRST_PROFILED_STEP)
        self.withheld = False

    def withhold(self) -> None:
        """No step is profiled, and profile_this_step() does nothing, until
        profile_next_step() (the Trainer's memory metrics read the allocator's peak counter,
        which a profiled step resets)."""
        self.cancel()
        self.withheld = True

    def profile_this_step(self, micro_step: int) -> None:
        """The micro-step that begins now is profiled too (the memory budget measures it),
        unless profiling is withheld."""
        if not self.withheld:
            self.profile_at = micro_step if self.profile_at is None else min(
                self.profile_at, micro_step)

    def cancel(self) -> None:
        """No profiled step from now on (until profile_next_step)."""
        self.profile_at = None
        if self.current is not None:
            self._abandon()

    def begin_step(self, micro_step: int) -> Optional[StepProfile]:
        """Called as each training forward begins; returns its profile if it is profiled."""
        if self.current is not None:
            # The profiled forward saw no backward (a dropped loss): profile this one.
            self._abandon()
            self.profile_at = micro_step
        if self._removing:
            self.remove_meters()
        if self.profile_at is None or micro_step < self.profile_at:
            return None
        self.profile_at = None
        meter = self._meter()
        if meter is not None:
            self.current = StepProfile(self, meter, micro_step)
        return self.current

    def _meter(self):
        engine = self.handle.engine
        if engine.backend == "cuda" and torch.cuda.is_available():
            return CudaMeter(torch.cuda.current_device())
        if engine.backend == "host":
            if self.handle.regions is not None or any(
                    getattr(m, "_compiled_call_impl", None) is not None
                    for m in self.handle.model.modules()):
                # A dispatch mode around compiled code would change what it runs.
                logger.info("ckpt_offload.hf: the peak breakdown is not measured on CPU "
                            "under torch.compile")
                return None
            return LiveTensorMeter().start()
        return None

    def forward_failed(self) -> None:
        """The profiled forward raised: the next micro-step is profiled instead."""
        if self.current is not None:
            self._abandon()
            self.profile_next_step()
        self.remove_meters()

    def _abandon(self) -> None:
        self.current.abandon()
        self._removing.append(self.current.meter)
        self.current = None

    def finished(self, profile: StepProfile) -> None:
        """Backward of the profiled step ended (inside autograd: the CPU meter is taken off
        the mode stack later, by the next call from outside backward)."""
        stats = self.handle.engine.stats()
        removed = stats.get("offloaded_bytes", 0) + stats.get("head_offloaded_bytes", 0)
        self.result = breakdown(
            step_peak_bytes=profile.step_peak, head_loss_bytes=profile.head_loss,
            layer_recompute_bytes=profile.layer_recompute,
            hidden_states_kept_bytes=profile.hidden_states_kept,
            offload_removed_bytes=removed, keep_last=self.handle.config.keep_last)
        self.result.update(micro_step=profile.micro_step, meter=profile.meter.name,
                           layer_phase_peak_bytes=max(0, int(profile.layer_phase_peak)),
                           head_phase_peak_bytes=max(0, int(max(profile.forward_peak,
                                                                profile.head_peak))),
                           forward_peak_bytes=max(0, int(profile.forward_peak)),
                           head_peak_bytes=max(0, int(profile.head_peak)),
                           head_stranded_bytes=int(profile.head_stranded))
        self._removing.append(profile.meter)
        if self.current is profile:
            self.current = None

    def remove_meters(self) -> None:
        self._removing = [meter for meter in self._removing if not meter.remove()]


def breakdown(*, step_peak_bytes: int, head_loss_bytes: int, layer_recompute_bytes: int,
              hidden_states_kept_bytes: int, offload_removed_bytes: int,
              keep_last: int) -> Dict[str, Any]:
    """The breakdown dict: the figures (bytes, at least 0), dominant and advice."""
    figures = {name: max(0, int(value)) for name, value in (
        ("step_peak_bytes", step_peak_bytes),
        ("hidden_states_kept_bytes", hidden_states_kept_bytes),
        ("offload_removed_bytes", offload_removed_bytes),
        ("head_loss_bytes", head_loss_bytes),
        ("layer_recompute_bytes", layer_recompute_bytes))}
    dominant = max(PARTS, key=lambda part: (figures[part + "_bytes"], -PARTS.index(part)))
    return {**figures, "dominant": dominant,
            "advice": _advice(dominant, figures, keep_last)}


def _size(num_bytes: int) -> str:
    """GiB, or MiB below a tenth of one (small models, CPU tests)."""
    if num_bytes >= GIB / 10:
        return f"{num_bytes / GIB:.2f} GiB"
    return f"{num_bytes / (1 << 20):.1f} MiB"


def _share(part: int, whole: int) -> str:
    return f"{min(part / whole, 1.0):.0%}" if whole > 0 else "n/a"


def _advice(dominant: str, figures: Dict[str, int], keep_last: int) -> str:
    peak = figures["step_peak_bytes"]
    size = figures[dominant + "_bytes"]
    amount = f"{_size(size)}, {_share(size, peak)} of the step's peak"
    if dominant == "head_loss":
        return (f"The LM head and the loss (logits, their float32 upcasts and gradients) "
                f"are the peak ({amount}); offload cannot move them. A fused loss that never "
                f"materializes the logits, such as Liger's fused linear cross-entropy or Cut "
                f"Cross-Entropy, removes most of it.")
    if dominant == "hidden_states_kept":
        return (f"Checkpointed layer inputs left on the device are the peak ({amount}): "
                f"lower keep_last (now {keep_last}; 0 offloads every layer's input), or raise "
                f"host_memory_limit if stats() shows cap_fallbacks.")
    return (f"One layer's recompute and backward is the peak ({amount}): offload cannot "
            f"reduce it further; shorter sequences or micro-batches, or more memory-frugal "
            f"kernels in the layer, would.")


def report_lines(result: Dict[str, Any]) -> List[str]:
    """The breakdown as a few readable lines (sizes, shares of the step's peak, advice)."""
    peak = result["step_peak_bytes"]

    def line(label: str, key: str, share: bool = True) -> str:
        text = f"  {label:<33} {_size(result[key]):>11}"
        return text + (f"  {_share(result[key], peak):>4} of the peak" if share else "")

    return [
        f"ckpt_offload.hf: where the device-memory peak is (micro-step {result['micro_step']}, "
        f"above the memory allocated when it began; {result['meter']} meter):",
        line("step peak", "step_peak_bytes", share=False),
        line("LM head + loss, fwd + bwd", "head_loss_bytes"),
        line("one layer's recompute + backward", "layer_recompute_bytes"),
        line("layer inputs kept on the device", "hidden_states_kept_bytes"),
        line("moved off the device by offload", "offload_removed_bytes", share=False),
        f"  dominant: {result['dominant']}. {result['advice']}",
    ]
