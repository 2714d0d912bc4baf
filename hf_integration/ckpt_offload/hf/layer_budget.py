"""A memory budget on one installation: measures a step, plans every later step's layers
(ckpt_offload.budget decides), and says what it chose.

Steps, counted from 1 after installation:
- the first step runs with every layer checkpointed, as without a budget (its warm-up would
  distort times);
- a measured step (the second, later each step longer than every one measured so far, and
  with MEASURED_LENGTH_RATIO set, each with no measured step from its own length to that
  ratio times it) also runs with every layer checkpointed, and each layer's recompute in
  backward is measured: the bytes of the tensors it saves (each storage once; the layer's
  parameters and storages that several layers save, such as rotary tables and masks, not
  counted), its time (on CUDA its forward's, timed with events: the same ops as the
  recompute without the meter's host work, which leaves the device idle between ops; on CPU,
  where plans serve correctness, its recompute's wall clock), and each op that could keep
  its output for a selective layer (see "Kept outputs") with its output's bytes and its own
  time. The step's peak is the memory allocated as it began plus the peak profiler's figure
  for the same step (on CPU: that figure alone; the step's own tensors are all the budget
  counts there). Its time runs from its forward's start to its backward's end (on CUDA
  between events: the device's), less what its layers' metered recomputes took beyond their
  forwards (the meter's);
- every other step is planned for its own token count (rounded up to PLAN_TOKEN_BITS
  significant bits; a plan per count, kept) from the shortest measured step at least as
  long: bytes per token grow with length (attention that materializes its scores), never
  shrink, so the longer step's figures bound the shorter one's (its peak, not scaled down,
  bounds it loosely: see MEASURED_LENGTH_RATIO). The
  layers the plan makes resident run without checkpointing (their GradientCheckpointingLayer
  calls the function directly); the others are checkpointed with their inputs offloaded,
  selective ones keeping their chosen outputs through torch's selective checkpointing
  (context_fn). A step whose length differs from the previous step's is planned with room
  kept free for its largest block (ckpt_offload.budget, "Lengths that change"): the LM
  head's float32 logits (vocabulary x 4 bytes per token), bounded by the measured head
  stretch's peak (small with a fused loss, which makes no logits). Each planned step is
  timed as the measured one was, and stats() reports the median of the plan's latest
  steps beside its predicted time; on CUDA, a plan whose steps run slower than its
  checkpointed step is said once (SLOW_PLAN_SHARE).

A layer that its model's own settings do not checkpoint (every_n_layers, a per-layer flag)
never reaches the checkpoint function: it is resident already, inside the measured peak,
and the plan covers the others; this is said once.

Kept outputs. An op of a layer's forward is a candidate when skipping it in the recompute
changes nothing but time: its outputs are new tensors (no view or alias of an input, which
keeping would not free), no later op of the layer writes to them in place (LoRA's adds
write their own buffers; torch would refuse a kept output that changed), nor does code the
dispatcher does not see (a Triton kernel: Liger's rotary embedding writes the q and k
projections' outputs; the measured recompute compares a sum of each output's bytes as its
op made it with the same sum where a later op reads it and at the recompute's end, and an
output freed before the end that no later op read is none either), the layer does
not return them (code after the layer could change them), it makes more than an empty
buffer (a kernel outside the dispatcher may fill one unseen), it is no higher-order op
(flex attention, a compiled region: nothing says what their outputs alias), and it draws
no random numbers (the recompute replays the forward's random draws in order, and a
skipped draw would shift every later one; attention counts when its dropout is 0). An op
is named by its name and its ordinal among that op's calls in the layer's forward, the
same in the forward and its recompute. Layers run by compiled regions, and layers whose
checkpoint has the user's own context_fn, have no candidates, and so have layers whose
parameters are still sharded when their checkpoint begins (FSDP2's DTensors, ZeRO-3's
partitions): hooks inside the checkpoint gather the weights, and need not run the same way
in the recompute. (Under transformers 5.23 FSDP2's hooks on a layer run before its
checkpoint; those layers have candidates.) They are planned as checkpointed or resident
only.

Without a budget nothing changes, but the second step is still measured, so that the advice
can say what a budget would buy.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import statistics
import time
import weakref
from typing import Any, Callable, Deque, Dict, FrozenSet, List, Optional, Tuple

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import (SAC_IGNORED_OPS, CheckpointPolicy,
                                    create_selective_checkpoint_contexts)

from ckpt_offload import budget as policy
from ckpt_offload.budget import (CHECKPOINT, RESIDENT, SELECTIVE, KeptOutput, LayerCost, LayerPlan,
                                 OpKey, OutputOffload, StepMeasurement, checkpointed_peak,
                                 plan_layers, plan_summary)
from ckpt_offload.config import parse_memory_budget
from ckpt_offload.copy_rate import host_copy_bytes_per_second

logger = logging.getLogger("ckpt_offload.hf")

GIB = float(1 << 30)

# The micro-step whose recomputes are measured.
MEASURED_STEP = 2

# With a ratio R, a step is planned from a measured step at most R times as long; a shorter
# one is measured itself. A longer step's bytes and times per token bound a shorter one's, but
# its peak is not scaled down (what does not grow with tokens, such as a full fine-tune's
# gradients, is in it), so a far longer measurement leaves a short step most of the memory it
# could use: on the H100 (8B, random lengths in [4k, 32k], all planned from a 27.9k step) a
# 6.4k step planned 4 resident layers for a predicted 70.6 GiB and allocated 36. Off (None:
# any longer measurement) until measured on the GPU: short steps would then allocate close
# to the budget while lengths change, where out-of-memory errors came from before the
# logits reserve (`budget_rows.sh var_ratio` runs the random lengths with R = 2).
MEASURED_LENGTH_RATIO: Optional[float] = None

# stats() keys of a budget (zeros until a plan exists).
STAT_KEYS = ("budget_bytes", "budget_resident_layers", "budget_selective_layers",
             "budget_checkpointed_layers", "budget_kept_output_bytes", "budget_tokens",
             "budget_predicted_peak_bytes", "budget_predicted_allocated_bytes",
             "budget_predicted_saved_ms",
             "budget_reserve_bytes", "budget_offloading_layers", "budget_offloaded_output_bytes",
             "budget_host_limited_bytes", "budget_resident_offloaded_bytes",
             "budget_measured_peak_bytes", "budget_measuring", "budget_copy_bytes_per_second",
             "budget_stranded_bytes", "budget_checkpointed_step_ms", "budget_predicted_step_ms",
             "budget_measured_step_ms", "budget_measured_steps", "budget_kept_share")

# After the CUDA allocator ran out of memory while a plan that keeps anything ran, later
# plans keep half as much above the checkpointed step (budget_kept_share), and half again
# at each such error; below BACK_OFF_FLOOR they keep nothing (every layer checkpointed, as
# without a budget). A trainer that retries (auto_find_batch_size) or a loop that skips
# the batch then goes on with smaller plans instead of running out again.
BACK_OFF_FLOOR = 1 / 8

# Micro-step times kept per plan (the latest ones); their median is the plan's measured time
# (robust to the odd step that also evaluates, saves or logs).
STEP_TIMES_KEPT = 16
# Once at least SLOW_PLAN_STEPS of a plan's steps were timed and their median is more than
# SLOW_PLAN_SHARE above its checkpointed step's time, that is said once. Only where both
# times are the device's (CUDA events, the measured step's meter taken out): on CPU the
# measured step runs its meters on the same clock.
SLOW_PLAN_STEPS = 4
SLOW_PLAN_SHARE = 0.05
PACE_CHECKED_ON_CPU = False  # tests turn it on with a clock of their own
# The label of the measured step's time.
_MEASURED = "measured"

# A step is planned for its token count rounded up to this many significant bits (at most
# 1/128 more tokens, planned conservatively: bytes grow with tokens), so that a run whose
# lengths all differ (dynamic padding, padding-free batches) makes at most 128 plans per
# doubling of length instead of one per length: a plan takes milliseconds of the training
# thread and tens of KiB, kept for the run (8B with kept and offloaded outputs: 5.0 ms and
# 36 KiB, benchmarks/results/cpu/budget_host_cost.txt). Multiples of 256 below 32k tokens,
# and powers of two, plan exactly.
PLAN_TOKEN_BITS = 8


def planned_tokens(tokens: int) -> int:
    """The token count a step of `tokens` is planned for (see PLAN_TOKEN_BITS)."""
    step = 1 << max(0, tokens.bit_length() - PLAN_TOKEN_BITS)
    return -(-tokens // step) * step

# The wall clock of measurements on CPU (tests replace it with a deterministic one).
_clock = time.perf_counter

# Budgets that an out-of-memory error may be laid at (those installed with a budget), and
# whether this process's CUDA allocator reports its errors to _on_out_of_memory.
_LIVE_BUDGETS: "weakref.WeakSet[LayerBudget]" = weakref.WeakSet()
_OBSERVING_OUT_OF_MEMORY = False


def _observe_out_of_memory() -> None:
    """Has the CUDA allocator call _on_out_of_memory before it raises an out-of-memory
    error (once per process; torch offers no way to detach an observer)."""
    global _OBSERVING_OUT_OF_MEMORY
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if _OBSERVING_OUT_OF_MEMORY or attach is None:
        return
    attach(_on_out_of_memory)
    _OBSERVING_OUT_OF_MEMORY = True


def _on_out_of_memory(device: int, requested: int, limit: int, free: int) -> None:
    """The allocator is about to raise: each budget whose plan is running backs off."""
    try:
        for budget in list(_LIVE_BUDGETS):
            budget.ran_out(requested)
    except Exception:  # an error here would replace the allocator's own
        logger.exception("ckpt_offload.hf: the memory budget could not back off")


def device_memory_bytes() -> Optional[int]:
    """The device memory this process may use: the current CUDA device's total times the
    process's memory fraction (torch.cuda.set_per_process_memory_fraction), or less when
    other processes hold part of the device (what is free plus what this process's
    allocator holds); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    fraction = 1.0
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is not None:
        fraction = getter(device)
    return int(min(total * fraction, free + torch.cuda.memory_reserved(device)))


class _Timer:
    """Intervals timed with CUDA events (read once they completed) or the wall clock."""

    def __init__(self, cuda: bool):
        self._cuda = cuda

    def start(self):
        if self._cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return start
        return _clock()

    def stop(self, start):
        """The interval since `start`: pass it to seconds() once the work completed."""
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            return (start, end)
        return _clock() - start

    @staticmethod
    def seconds(interval) -> float:
        if isinstance(interval, tuple):
            start, end = interval
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return interval


class _StepTimes:
    """How long training micro-steps take, each from its forward's start to its backward's
    end (what a plan changes; not the optimizer, data loading or generation between steps),
    by label (a plan's): on CUDA between events on the current stream (the device's time,
    read once both completed: never waited for, but by latest()), else the wall clock."""

    def __init__(self):
        self._running: Optional[list] = None  # [timer, its start, label] of the running step
        self._unread: Deque[tuple] = collections.deque()  # (_Timer interval of events, label)
        self._times: Dict[Any, Deque[float]] = {}

    def begin(self, cuda: bool, label: Any) -> None:
        """A micro-step's forward begins; its time is kept under `label` (None: not timed).
        A step whose backward never ended (abandoned) is not timed."""
        if label is None:
            self._running = None
        else:
            timer = _Timer(cuda)
            self._running = [timer, timer.start(), label]
        self._read(wait=False)

    def watch(self, outputs: Any) -> None:
        """The running step's forward returned `outputs`: the end of the backward that
        reaches any of them ends it."""
        running = self._running
        if running is None:
            return
        queued = []

        def backward_reached(grad):
            if not queued:
                queued.append(True)
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: self._end(running))

        for tensor in tree_leaves(outputs):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(backward_reached)

    def running(self) -> Any:
        """The label of the step whose forward began and whose backward has not ended (None:
        none, or unlabelled)."""
        return None if self._running is None else self._running[2]

    def forget(self, label: Any) -> None:
        """Drops `label`'s times (a new measurement under it begins)."""
        self._times.pop(label, None)

    def _end(self, running: list) -> None:
        if running is not self._running:
            return  # a later step began before this backward ended
        self._running = None
        timer, start, label = running
        try:
            interval = timer.stop(start)
        except RuntimeError as error:  # a figure is not worth failing the user's backward
            logger.debug("ckpt_offload.hf: a step was not timed (%s)", error)
            return
        if isinstance(interval, tuple):
            self._unread.append((interval, label))
        else:
            self._add(label, interval)

    def latest(self, label: Any) -> float:
        """The time of the latest ended step of `label`, waiting for its events (0: none)."""
        self._read(wait=True)
        times = self._times.get(label)
        return times[-1] if times else 0.0

    def median(self, label: Any) -> Tuple[float, int]:
        """The median time of `label`'s latest ended steps read so far, and their count."""
        self._read(wait=False)
        times = self._times.get(label)
        return (statistics.median(times), len(times)) if times else (0.0, 0)

    def _read(self, wait: bool) -> None:
        while self._unread:
            interval, label = self._unread[0]
            if not wait and not interval[1].query():  # its end event
                return
            self._unread.popleft()
            self._add(label, _Timer.seconds(interval))

    def _add(self, label: Any, seconds: float) -> None:
        self._times.setdefault(label, collections.deque(maxlen=STEP_TIMES_KEPT)).append(seconds)


class _LayerProbe:
    """What one layer's recompute saved, how long it and the layer's forward ran, and its
    candidate kept outputs (see "Kept outputs"), in the measured step."""

    def __init__(self, cuda: bool):
        self.storages: Dict[int, int] = {}  # StorageImpl address -> bytes
        # Every storage its latest recompute saved, (address, bytes) in first-save order,
        # those other layers save too included (they are dropped from `storages`).
        self.order: Dict[int, int] = {}
        self.input_bytes = 0  # of the tensors its checkpoint offloads (its forward's)
        self.seconds = 0.0  # its recompute's, the meter's work included
        self.forward_seconds = 0.0  # its forward's (timed on CUDA only; 0: not timed)
        self.timer = _Timer(cuda)
        self._intervals: List[Any] = []
        self._forward_intervals: List[Any] = []
        self.meter: Optional[_OutputMeter] = None  # None: no candidates for this layer

    def start(self):
        return self.timer.start()

    def stop(self, start, forward: bool = False) -> None:
        (self._forward_intervals if forward else self._intervals).append(self.timer.stop(start))

    def settle(self) -> None:
        self.seconds += sum(_Timer.seconds(interval) for interval in self._intervals)
        self.forward_seconds += sum(
            _Timer.seconds(interval) for interval in self._forward_intervals)
        self._intervals.clear()
        self._forward_intervals.clear()

    def recompute_seconds(self) -> float:
        """What running the layer without checkpointing saves: its forward's time where it
        was timed (the same ops as the recompute, without the meter, whose host work
        between ops leaves the device idle: on the H200 a 1B layer's metered recompute took
        8.2 ms where leaving the layer un-checkpointed saved 5.4), else its recompute's. 0
        when it was never recomputed."""
        if self.seconds <= 0 or self.forward_seconds <= 0:
            return self.seconds
        return self.forward_seconds

    def outputs(self, tokens: int):
        """The candidates, per token (empty without a meter)."""
        return () if self.meter is None else self.meter.candidates(tokens)


# Ops whose output holds nothing yet: a kernel outside the dispatcher (Triton's, a fused
# loss's) may fill it unseen, so nothing says when its content is final.
_UNDEFINED_CONTENT_OPS = frozenset({
    torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided,
    torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided,
})


@functools.cache
def _op_name(func) -> str:
    # Cached: the dispatch modes name every op a planned layer runs (str() of an overload
    # builds the string each time; ops are few and live as long as the process).
    return str(func)


def _draws_random_numbers(func, args, kwargs) -> bool:
    """Whether `func` consumes the random generator: a seeded op, except attention whose
    dropout is 0 (it draws nothing then)."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    schema = getattr(func, "_schema", None)
    if schema is None:
        return True
    for position, argument in enumerate(schema.arguments):
        if argument.name == "dropout_p":
            value = kwargs.get("dropout_p", args[position] if position < len(args)
                               else argument.default_value)
            return value != 0
    return True


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _has_storage(tensor: torch.Tensor) -> bool:
    try:
        tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _has_data(storage) -> bool:
    """Whether `storage` has an address (a wrapper subclass's, a DTensor's, has none)."""
    try:
        storage.data_ptr()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _parameter_addresses(layer: nn.Module) -> set:
    """The addresses of `layer`'s parameters' storages (those that have one)."""
    storages = (p.untyped_storage() for p in layer.parameters() if _has_storage(p))
    return {s.data_ptr() for s in storages if _has_data(s)}


class _LayerStorages:
    """Which saved storages count as a layer's: those with an address (a wrapper subclass's,
    a DTensor's, has none) that hold none of its parameters. The measured step and a
    resident layer's forward both number storages by this rule, so their ordinals agree.
    The parameters are read at the first save, inside the layer's forward: by then a
    sharding wrapper's hooks have put the gathered weights in place."""

    def __init__(self, layer: nn.Module):
        self.layer = layer
        self._params: Optional[set] = None

    def of(self, tensor: torch.Tensor):
        """`tensor`'s storage if it counts as the layer's, else None."""
        if self._params is None:
            self._params = _parameter_addresses(self.layer)
        storage = tensor.untyped_storage()
        if _has_data(storage) and storage.data_ptr() not in self._params:
            return storage
        return None


def _runs_compiled_code(layer: nn.Module) -> bool:
    """Whether `layer`, or a part of it, is a compiled region."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in layer.modules())


def _has_sharded_parameters(layer: nn.Module) -> bool:
    """Whether `layer`'s parameters are sharded now: FSDP2's not yet gathered (DTensor, a
    wrapper subclass) or DeepSpeed ZeRO-3's (a partition in `ds_tensor`, always there)."""
    return any(is_traceable_wrapper_subclass(p) or hasattr(p, "ds_tensor")
               for p in layer.parameters())


_UNMETERED_SAID: set = set()  # ops the meter could not follow, said once per process


class _OutputMeter(TorchDispatchMode):
    """Around one layer's recompute in the measured step: each op's output bytes and time,
    and which ops may keep their outputs (see "Kept outputs")."""

    # Higher-order ops (flex attention, a compiled region, a Triton op) come through
    # __torch_dispatch__ too: without this torch refuses them while the meter is on.
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # compiling under the meter traces the layer, not the meter

    def __init__(self, timer: _Timer):
        super().__init__()
        self.timer = timer
        self.counts: Dict[str, int] = collections.Counter()
        # key -> [output storage keys, bytes, interval]; ops that may keep their outputs.
        self.ops: Dict[OpKey, list] = {}
        self.excluded: set = set()
        self.failed = False
        self._by_storage: Dict[int, OpKey] = {}
        # Content checks (see finish()): per candidate storage, a weak reference and its
        # content's sum as its op made it; the candidates a later op read; (key, sum as
        # made, sum when read or at the end) for each read and each storage alive at the end.
        self._made: Dict[int, tuple] = {}
        self._read: set = set()
        self._checks: List[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.failed or _candidate_name(func) is None:
            # A higher-order op has no schema to say what its outputs alias: it runs (the
            # meter is off while it does), and its outputs are no candidates.
            return func(*args, **kwargs)
        try:
            key, inputs = self._before(func, args, kwargs)
        except Exception as error:  # the meter's own bookkeeping: it must not stop a step
            self._fail(func, error)
            return func(*args, **kwargs)
        start = self.timer.start()
        out = func(*args, **kwargs)
        interval = self.timer.stop(start)
        try:
            self._after(func, args, kwargs, key, inputs, out, interval)
        except Exception as error:
            self._fail(func, error)
        return out

    def _before(self, func, args, kwargs):
        """Names the op; marks the candidates it writes to in place and checks those it
        reads (see finish()). Returns (key, its input tensors by storage)."""
        key = _counted_key(self.counts, func)
        inputs = {_storage_key(t): t for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and _has_storage(t)}
        if not _returns_alias(func):  # an op that reads its inputs' content
            for storage, tensor in inputs.items():
                owner = self._by_storage.get(storage)
                if owner is not None and owner not in self.excluded:
                    self._read.add(owner)
                    self._checks.append((owner, self._made[storage][1],
                                         _content_sum(tensor.untyped_storage())))
        for written in _written_tensors(func, args, kwargs):
            if not _has_storage(written):
                continue
            owner = self._by_storage.get(_storage_key(written))
            if owner is not None:
                self.excluded.add(owner)  # changed in place after it was made
        return key, inputs

    def _after(self, func, args, kwargs, key, inputs, out, interval) -> None:
        """Records the op's outputs as a candidate when they may be kept."""
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        returns = getattr(getattr(func, "_schema", None), "returns", None)
        if (not outputs or returns is None or _returns_alias(func)
                or func.overloadpacket in _UNDEFINED_CONTENT_OPS
                or _draws_random_numbers(func, args, kwargs)):
            return
        try:
            by_storage = {_storage_key(t): t for t in outputs}
        except (RuntimeError, NotImplementedError):  # a tensor without storage
            return
        storages = set(by_storage)
        if storages & inputs.keys():
            return
        size = sum(t.untyped_storage().nbytes() for t in by_storage.values())
        self.ops[key] = [storages, size, interval]
        for storage, tensor in by_storage.items():
            self._by_storage[storage] = key
            self._made[storage] = (StorageWeakRef(tensor.untyped_storage()),
                                   _content_sum(tensor.untyped_storage()))

    def _fail(self, func, error: Exception) -> None:
        """The meter could not follow `func`: the layer offers no candidates this time."""
        self.failed = True
        if str(func) in _UNMETERED_SAID:
            return
        _UNMETERED_SAID.add(str(func))
        logger.warning("ckpt_offload: memory_budget: could not meter %s (%s: %s); this layer "
                       "keeps no op outputs", func, type(error).__name__, error)

    def finish(self, result) -> None:
        """The layer's recompute returned `result`, or checkpoint stopped it early (None).
        What it returns is no candidate: code after the layer (the next layer's in-place
        residual add, say) may change it before the recompute. Nor is an output whose content
        differs from what its op made where a later op read it or at the end (code the
        dispatcher does not see wrote it in place: a Triton kernel, such as Liger's rotary
        embedding writing the projections' outputs), nor one freed before the end that no
        later op read (only such code used it)."""
        for tensor in tree_leaves(result):
            if isinstance(tensor, torch.Tensor) and _has_storage(tensor):
                owner = self._by_storage.get(_storage_key(tensor))
                if owner is not None:
                    self.excluded.add(owner)
        checks, self._checks = self._checks, []
        made, self._made = self._made, {}
        if self.failed:
            return
        try:
            for storage, (ref, made_sum) in made.items():
                owner = self._by_storage[storage]
                if owner in self.excluded:
                    continue
                if not ref.expired():
                    checks.append((owner, made_sum, _content_sum(
                        torch.UntypedStorage._new_with_weak_ptr(ref.cdata))))
                elif owner not in self._read:
                    self.excluded.add(owner)
            if checks:  # one synchronization for the layer
                sums = torch.stack([torch.stack((a, b)) for _, a, b in checks]).tolist()
                self.excluded.update(key for (key, _, _), (a, b) in zip(checks, sums) if a != b)
        except Exception as error:  # the meter's own bookkeeping: it must not stop a step
            self._fail("the content check", error)

    def candidates(self, tokens: int):
        if self.failed:
            return ()
        return tuple(KeptOutput(key, size / tokens, _Timer.seconds(interval) / tokens)
                     for key, (_, size, interval) in self.ops.items()
                     if key not in self.excluded)


def _returns_alias(func) -> bool:
    """Whether `func`'s outputs alias its inputs (a view, an in-place op): it makes no new
    tensor, and a view reads nothing."""
    returns = getattr(getattr(func, "_schema", None), "returns", None) or ()
    return any(r.alias_info is not None for r in returns)


def _content_sum(storage) -> torch.Tensor:
    """The sum of `storage`'s bytes read as integers (eight at a time where they divide,
    else four, two, one), wrapping, a device scalar: it changes when anything writes the
    storage. Summed in the words' own type: a wider sum first copies the storage into the
    wider type, and the measured step's peak (of which this is no part) rose by twice the
    largest output read."""
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    for dtype in (torch.int64, torch.int32, torch.int16):
        if storage.nbytes() % dtype.itemsize == 0:
            return flat.view(dtype).sum(dtype=dtype)
    return flat.sum(dtype=torch.uint8)


def _written_tensors(func, args, kwargs) -> List[torch.Tensor]:
    """The tensors `func` writes in place (its schema's mutable arguments)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    written = []
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = kwargs.get(argument.name, args[position] if position < len(args) else None)
        written.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return written


def keeping(kept: FrozenSet[OpKey]) -> Callable:
    """A checkpoint context_fn (torch's selective checkpointing) that keeps the outputs of
    the ops `kept` names and recomputes the rest."""
    def context_fn():
        counts: Dict[tuple, int] = collections.Counter()

        def policy(ctx, func, *args, **kwargs):
            name = _op_name(func)
            ordinal = counts[(ctx.is_recompute, name)]
            counts[(ctx.is_recompute, name)] += 1
            if (name, ordinal) in kept:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)
    return context_fn


class _OutputSaver(TorchDispatchMode):
    """A layer's forward under a plan that offloads op outputs: the outputs of the ops
    `offloaded` names go to the engine with the layer's input (its open group), those of the
    ops `kept` names stay on the device; both into `saved`, by op. Ops are named as the meter
    names them (see "Kept outputs")."""

    supports_higher_order_operators = True  # they run as they are (the meter's rule)

    def __init__(self, engine, kept: FrozenSet[OpKey], offloaded: FrozenSet[OpKey],
                 saved: Dict[OpKey, Any]):
        super().__init__()
        self.engine = engine
        self.kept = kept
        self.offloaded = offloaded
        self.saved = saved
        self.counts: Dict[str, int] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        key = _counted_key(self.counts, func)
        if key in self.offloaded:
            self.saved[key] = _map_tensors(self.engine.save_into_group, out)
        elif key in self.kept:
            self.saved[key] = _map_tensors(self.engine.keep_here, out)
        return out


class _OutputReplay(TorchDispatchMode):
    """The layer's recompute under the same plan: an op whose outputs `saved` holds returns
    them (restored from the host, or as kept) instead of running; every other op runs."""

    supports_higher_order_operators = True

    def __init__(self, engine, saved: Dict[OpKey, Any]):
        super().__init__()
        self.engine = engine
        self.saved = saved
        self.counts: Dict[str, int] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = _counted_key(self.counts, func)
        handles = self.saved.get(key) if key is not None else None
        if handles is None:
            return func(*args, **kwargs)
        return _map_tensors(self.engine.restore, handles, handles=True)


def _counted_key(counts: Dict[str, int], func) -> Optional[OpKey]:
    """The op's key (its name and ordinal among that op's calls, counted in `counts`), or
    None for the ops that are never candidates and not counted: SAC's ignored ops and
    higher-order ops."""
    name = _candidate_name(func)
    if name is None:
        return None
    key = (name, counts[name])
    counts[name] += 1
    return key


@functools.cache
def _candidate_name(func) -> Optional[str]:
    """_op_name(func), or None for SAC's ignored ops and higher-order ops."""
    if func in SAC_IGNORED_OPS or isinstance(func, torch._ops.HigherOrderOperator):
        return None
    return _op_name(func)


def _map_tensors(function: Callable, value, handles: bool = False):
    """`value` (an op's output, or what was saved of it) with `function` applied to each
    tensor (each saved handle): other leaves (sizes, None) as they are."""
    if handles:
        return tree_map(lambda x: x.value if isinstance(x, _Plain) else function(x), value)
    return tree_map(lambda x: function(x) if isinstance(x, torch.Tensor) else _Plain(x), value)


class _StorageSaver:
    """A RESIDENT layer's forward under a plan that offloads some of its saved storages:
    autograd's saves go through these hooks, which number the layer's storages in the order
    it first saves them (by _LayerStorages, as the measured step numbered them), send
    those the plan names (`sizes`: ordinal -> the bytes planned) to the engine with the
    layer's open group, and hand every other save to the hooks below (the engine's own). A
    storage whose size is not the planned one is not the measured step's: it stays.

    In backward, the layer's first restore prefetches the groups below it: with prefetch
    deferred (the default), nothing else would, as a resident layer has no recompute to
    start them from. The plan takes its last saved storages, which backward uses first, so
    that restore comes early in its backward."""

    def __init__(self, engine, layer: nn.Module, sizes: Dict[int, int], say: Callable):
        self.engine = engine
        self.own = _LayerStorages(layer)
        self.sizes = sizes
        self.say = say
        self.ordinals: Dict[int, int] = {}  # StorageImpl address -> ordinal
        self.offloaded: set = set()  # addresses
        self.refs: List[Any] = []  # weak references: no address is reused meanwhile
        self.below = None
        self.prefetched = False

    def __enter__(self):
        self.below = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if self.below is not None:
            torch._C._autograd._push_saved_tensors_default_hooks(self.pack, self.unpack)
        return self

    def __exit__(self, *exc) -> bool:
        if self.below is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        return False

    def pack(self, tensor):
        storage = self.own.of(tensor)
        if storage is not None:
            key = storage._cdata
            if key not in self.ordinals:
                ordinal = self.ordinals[key] = len(self.ordinals)
                self.refs.append(StorageWeakRef(storage))
                planned = self.sizes.get(ordinal)
                if planned is not None and planned == storage.nbytes():
                    self.offloaded.add(key)
                elif planned is not None:
                    self.say("storage_mismatch", "ckpt_offload.hf: a layer without "
                             "checkpointing saved a storage of %d bytes where the measured "
                             "step's had %d; it stays on the device", storage.nbytes(),
                             planned)
            if key in self.offloaded:
                # Restored once per storage: several nodes may save it, each unpacking it.
                return _Offloaded(self.engine.save_into_group(tensor, keep_restore=True))
        return self.below[0](tensor)

    def unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return self.below[1](packed)
        tensor = self.engine.restore(packed.handle)
        if not self.prefetched:
            self.prefetched = True
            self.engine.prefetch_ahead()
        return tensor


class _Offloaded:
    """What _StorageSaver's pack returns for a storage it sent to the engine."""

    __slots__ = ("handle",)

    def __init__(self, handle):
        self.handle = handle


class _Plain:
    """A saved output leaf that is no tensor (a size, None): returned as it was."""

    def __init__(self, value):
        self.value = value


def saving_outputs(engine, kept: FrozenSet[OpKey], offloaded: FrozenSet[OpKey]) -> Callable:
    """A checkpoint context_fn for a layer that offloads the outputs of the ops `offloaded`
    names (and keeps those of `kept` on the device) for its recompute, which skips them."""
    def context_fn():
        saved: Dict[OpKey, Any] = {}
        return (_OutputSaver(engine, kept, offloaded, saved), _OutputReplay(engine, saved))
    return context_fn


class LayerBudget:
    """The budget of one OffloadHandle (see the module's docstring)."""

    def __init__(self, handle, value):
        self.handle = handle
        self.value = value
        self.layer_index = {layer: i for i, layer in enumerate(handle._layers)}
        self.measurements: Dict[int, StepMeasurement] = {}  # by tokens
        self.plan: Optional[LayerPlan] = None  # the running step's
        self.latest_plan: Optional[LayerPlan] = None
        self.measured_peak_bytes = 0  # reserved by the end of the latest planned step
        self._plans: Dict[tuple, LayerPlan] = {}  # by (tokens, length changed)
        # The latest training step's tokens (its plan's may be a few more); the next step
        # compares its own with them.
        self._step_tokens = 0
        self._vocab = _output_vocab(handle.model)
        # The copy rate offloaded outputs are planned with (0: none are offloaded; None: the
        # device's, measured when the first plan is made) and the share of each layer's
        # forward their copies may take.
        self.copy_bytes_per_second: Optional[float] = None
        self.copy_window_share = policy.COPY_WINDOW_SHARE
        # Whether resident layers offload saved storages (None: the policy's default).
        self.resident_storage_offload: Optional[bool] = None
        # The longest measurement a step is planned from, in its own lengths (None: any).
        self.measured_length_ratio: Optional[float] = MEASURED_LENGTH_RATIO
        self.planned_copy_bytes_per_second = 0.0  # the rate the latest plan used
        self._probes: Optional[Dict[nn.Module, _LayerProbe]] = None
        self._seen: Dict[int, Any] = {}  # address -> (weak ref, first layer) in the measured step
        self._measured_tokens = 0
        self._step_times = _StepTimes()  # with a budget: the measured step's and each plan's
        self._latest_key: Optional[tuple] = None  # the latest plan's in self._plans
        self._allocated_at_start = 0
        self._cuda = False
        self._said: set = set()
        self.kept_share = 1.0  # see BACK_OFF_FLOOR
        self._blamed: Optional[LayerPlan] = None  # the plan the latest back-off came from
        if value is not None:
            _LIVE_BUDGETS.add(self)

    def close(self) -> None:
        """The installation is gone: no error is laid at its plans any more."""
        _LIVE_BUDGETS.discard(self)
        self.plan = None

    def ran_out(self, requested: int) -> None:
        """The device ran out of memory (`requested` bytes were asked for): if a step of this
        budget's plan was running (its forward began, its backward had not ended; not an
        evaluation or the optimizer after it, when what the plan kept is freed) and the plan
        keeps anything, later plans keep half as much above the checkpointed step (once per
        step; see BACK_OFF_FLOOR)."""
        plan = self.plan
        if (plan is None or self._step_times.running() is None or plan is self._blamed
                or plan.keeps_nothing):
            return
        self._blamed = plan
        share = self.kept_share / 2
        self.kept_share = share if share >= BACK_OFF_FLOOR else 0.0
        self._plans.clear()
        logger.warning(
            "ckpt_offload.hf: out of memory (%.2f GiB asked for) with a memory-budget plan "
            "running: %d tokens per micro-step, %s. Later steps keep %s. If this repeats, set "
            "memory_budget below %.1f GiB.", requested / GIB, plan.tokens, plan.describe(),
            "half as much above the checkpointed step" if self.kept_share else
            "nothing (every layer checkpointed)", plan.predicted_peak_bytes / GIB)

    @property
    def measurement(self) -> Optional[StepMeasurement]:
        """The first step measured (None before)."""
        return self.measurements[min(self.measurements)] if self.measurements else None

    # Steps.

    def begin_step(self, micro_step: int, tokens: int) -> None:
        """A training forward of `tokens` tokens begins (micro-step `micro_step`)."""
        if self.value is None:
            self._begin(micro_step, tokens)
            return
        if self._latest_key in self._plans:
            self._check_pace(self._latest_key)
        # Timed once its plan is made (making one may time the device's copies).
        label = self._begin(micro_step, tokens)
        self._step_times.begin(self._on_cuda(), label)

    def _begin(self, micro_step: int, tokens: int) -> Any:
        """begin_step's work; returns the step's label for its time: _MEASURED, its plan's
        key, or None (not timed)."""
        if self._probes is not None:
            self._finish_measurement()
        elif self.plan is not None and self._cuda:
            # Reserved memory only grows unless someone empties the cache: what is reserved
            # now covers the step's peak. (The allocator's peak counters are the user's.)
            self.measured_peak_bytes = torch.cuda.memory_reserved()
        self.plan = None
        changed = tokens != self._step_tokens
        self._step_tokens = tokens
        if micro_step < MEASURED_STEP or tokens <= 0:
            return None
        if self.value is None:
            if not self.measurements:
                self._start_measurement(micro_step, tokens)
            return None
        covering = self._covering(tokens)
        if covering is None:
            self._start_measurement(micro_step, tokens)
            return _MEASURED
        # Never past the measurement it is planned from (which then stays its covering one).
        key = self._latest_key = (min(planned_tokens(tokens), covering.tokens), changed)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan_for(covering, key[0], changed)
        self.plan = self.latest_plan = plan
        return key

    def forward_returned(self, outputs: Any) -> None:
        """The running training forward returned `outputs` (its backward's end ends the
        step's time)."""
        if self.value is not None:
            self._step_times.watch(outputs)

    def _on_cuda(self) -> bool:
        return self.handle.engine.backend == "cuda" and torch.cuda.is_available()

    def _check_pace(self, key: tuple) -> None:
        """Says once if the steps of the plan for `key` run slower than its checkpointed
        step (see SLOW_PLAN_SHARE): time the plan does not model, such as host work per op
        the device waits for, or copies that outlast their window."""
        plan = self._plans[key]
        if (("slow", key) in self._said or not (self._cuda or PACE_CHECKED_ON_CPU)
                or plan.checkpointed_step_seconds <= 0):
            return
        if plan.keeps_nothing:
            return  # the checkpointed step itself
        seconds, count = self._step_times.median(key)
        if count < SLOW_PLAN_STEPS or seconds <= plan.checkpointed_step_seconds * (
                1 + SLOW_PLAN_SHARE):
            return
        self._say(("slow", key), "ckpt_offload.hf: memory budget, %d tokens per micro-step: "
                  "the plan's steps take %.1f ms (median of %d), %.0f %% more than the %.1f ms "
                  "measured with every layer checkpointed (%.1f ms predicted); the plan costs "
                  "time it does not model (host work per op that the device waits for, or "
                  "copies that outlast their window). memory_budget=None checkpoints every "
                  "layer again.", plan.tokens, seconds * 1e3, count,
                  (seconds / plan.checkpointed_step_seconds - 1) * 100,
                  plan.checkpointed_step_seconds * 1e3, plan.predicted_step_seconds * 1e3,
                  level=logging.WARNING)

    def _planned_index(self, layer: Optional[nn.Module]) -> Optional[int]:
        """`layer`'s index in the running step's plan; None without a plan, or for a layer
        the budget does not know (None included)."""
        return None if self.plan is None else self.layer_index.get(layer)

    def mode(self, layer: Optional[nn.Module]) -> str:
        """The running step's mode for `layer` (CHECKPOINT without a plan)."""
        index = self._planned_index(layer)
        return CHECKPOINT if index is None else self.plan.modes[index]

    def is_lowest_resident(self, layer: Optional[nn.Module]) -> bool:
        """Whether `layer` is RESIDENT in the running step and the layer below it is not
        (the plan's resident layers are the last ones): backward reaches the layers below
        right after this one's."""
        index = self._planned_index(layer)
        if index is None or index == 0:
            return False
        modes = self.plan.modes
        return modes[index] == RESIDENT and modes[index - 1] != RESIDENT

    def kept(self, layer: Optional[nn.Module]) -> FrozenSet[OpKey]:
        """The ops whose outputs `layer` keeps in the running step (a SELECTIVE layer's)."""
        index = self._planned_index(layer)
        return frozenset() if index is None else self.plan.kept(index)

    def offloaded(self, layer: Optional[nn.Module]) -> FrozenSet[OpKey]:
        """The ops whose outputs `layer` offloads in the running step."""
        index = self._planned_index(layer)
        return frozenset() if index is None else self.plan.offloaded(index)

    def saving_storages(self, layer: Optional[nn.Module]):
        """A context for a RESIDENT `layer`'s forward in the running step: the saved
        storages its plan offloads go to the engine with its group (nothing to do for the
        others)."""
        index = self._planned_index(layer)
        if index is None or not self.plan.offloaded_storages(index):
            return contextlib.nullcontext()
        cost = self._covering(self.plan.tokens).layers[index]  # the plan's measurement
        sizes = {ordinal: int(round(cost.storages[ordinal] * self._step_tokens))
                 for ordinal in self.plan.offloaded_storages(index)}
        return _StorageSaver(self.handle.engine, layer, sizes, self._say)

    def _covering(self, tokens: int) -> Optional[StepMeasurement]:
        """The shortest measured step of at least `tokens` (what a step of `tokens` is
        planned from), or None, also when that is more than measured_length_ratio times as
        long. (A plan's measurement stays its covering one: a step is measured only when no
        measurement lies between its length and that ratio times it.)"""
        covering = [t for t in self.measurements if t >= tokens]
        ratio = self.measured_length_ratio
        if not covering or (ratio is not None and min(covering) > ratio * tokens):
            return None
        return self.measurements[min(covering)]

    def offloads_outputs(self) -> bool:
        """Whether the running step's plan offloads op outputs in any layer."""
        return self.plan is not None and self.plan.offloading_layers > 0

    def measuring(self) -> bool:
        return self._probes is not None

    def measure(self, layer: Optional[nn.Module], function: Callable,
                with_outputs: bool) -> Callable:
        """`function` (a checkpointed layer's), measured when it is recomputed in backward;
        `with_outputs`: its candidate kept outputs too (see "Kept outputs")."""
        if self._probes is None or layer not in self.layer_index:
            return function
        probe = self._probes.setdefault(layer, _LayerProbe(self._cuda))
        metered = (with_outputs and not _runs_compiled_code(layer)
                   and not _has_sharded_parameters(layer))

        def measured(*args, **kwargs):
            top = torch._C._autograd._top_saved_tensors_default_hooks(True)
            if torch._C._current_graph_task_id() == -1:
                # The forward: nothing is saved; what the checkpoint offloads is its input.
                probe.input_bytes = max(probe.input_bytes, sum(
                    a.untyped_storage().nbytes() for a in args
                    if isinstance(a, torch.Tensor) and _has_storage(a)
                    and not isinstance(a, nn.Parameter)))
                if not self._cuda or torch.compiler.is_compiling():
                    return function(*args, **kwargs)
                start = probe.start()
                try:
                    return function(*args, **kwargs)
                finally:
                    probe.stop(start, forward=True)
            if top is None:
                return function(*args, **kwargs)
            pack, unpack = top
            own = _LayerStorages(layer)
            probe.order = {}  # the latest recompute's

            def counting_pack(tensor):
                storage = own.of(tensor)
                if storage is not None:
                    self._note_storage(layer, probe, storage)
                return pack(tensor)

            torch._C._autograd._push_saved_tensors_default_hooks(counting_pack, unpack)
            start = probe.start()
            try:
                if not metered or torch.compiler.is_compiling():
                    return function(*args, **kwargs)
                probe.meter = _OutputMeter(probe.timer)  # the latest recompute's
                result = None
                try:
                    with probe.meter:
                        result = function(*args, **kwargs)
                    return result
                finally:
                    # Also when checkpoint stops the recompute early (by raising once the
                    # last saved tensor is made): what it ran is what it will skip.
                    probe.meter.finish(result)
            finally:
                probe.stop(start)
                torch._C._autograd._pop_saved_tensors_default_hooks()

        return measured

    def _note_storage(self, layer: nn.Module, probe: _LayerProbe, storage) -> None:
        key = storage._cdata
        probe.order.setdefault(key, storage.nbytes())
        seen = self._seen.get(key)
        if seen is None:
            # The weak reference keeps the address from being reused until the measurement ends.
            self._seen[key] = (StorageWeakRef(storage), layer)
            probe.storages[key] = storage.nbytes()
        elif seen[1] is not layer:
            self._probes[seen[1]].storages.pop(key, None)  # shared by layers: not a layer's own

    def _start_measurement(self, micro_step: int, tokens: int) -> None:
        self.handle._peak.profile_this_step(micro_step)  # the breakdown gives its peak
        self._cuda = self._on_cuda()
        self._probes = {}
        self._seen = {}
        self._measured_tokens = tokens
        self._step_times.forget(_MEASURED)
        if self._cuda and self.value is not None:
            _observe_out_of_memory()
        self._allocated_at_start = torch.cuda.memory_allocated() if self._cuda else 0

    def _finish_measurement(self) -> None:
        probes, self._probes = self._probes, None
        layers = []
        for layer in self.handle._layers:
            probe = probes.get(layer)
            if probe is None:
                layers.append(LayerCost(0.0, 0.0))
                continue
            probe.settle()
            tokens = self._measured_tokens
            layers.append(LayerCost(
                sum(probe.storages.values()) / tokens, probe.recompute_seconds() / tokens,
                probe.outputs(tokens), probe.input_bytes / tokens,
                # Storages other layers save too count 0: a resident layer keeps them.
                tuple(size / tokens if key in probe.storages else 0.0
                      for key, size in probe.order.items())))
        self._seen = {}
        if not any(cost.recompute_seconds_per_token > 0 for cost in layers):
            return  # no recompute ran (the step saw no backward): a later step measures
        # Its time without the meter's: where a layer's forward was timed, what its metered
        # recompute took beyond that is the meter's (the device idle between ops).
        metering = sum(max(0.0, probe.seconds - probe.forward_seconds)
                       for probe in probes.values() if probe.forward_seconds > 0)
        step_seconds = max(0.0, self._step_times.latest(_MEASURED) - metering)
        activation_peak = self._activation_peak(layers)
        # What the step allocated at its peak: memory cached for others (another model's
        # forward, an evaluation) is not the step's, and the allocator reuses it.
        peak = self._allocated_at_start + activation_peak
        measured = StepMeasurement(
            tokens=self._measured_tokens, layers=tuple(layers), peak_bytes=int(peak),
            activation_peak_bytes=int(activation_peak), step_seconds=step_seconds,
            largest_block_bytes_per_token=self._largest_block_per_token(activation_peak),
            layer_phase_peak_bytes=self._phase_peak("layer_phase_peak_bytes"),
            head_phase_peak_bytes=self._phase_peak("head_phase_peak_bytes"),
            head_rise_bytes=self._head_rise(),
            forward_peak_bytes=self._phase_peak("forward_peak_bytes"),
            head_peak_bytes=self._phase_peak("head_peak_bytes"),
            # The step's figures, harvested as the next one began.
            host_peak_bytes=int(self.handle._latest.get("host_peak_bytes", 0)),
            stranded_bytes=self._head_stranded())
        self.measurements[measured.tokens] = measured
        self._report_measurement(measured, probes)

    def _measured_breakdown(self) -> Optional[Dict[str, Any]]:
        """The peak breakdown of the step just measured (None: that step was not profiled)."""
        breakdown = self.handle._peak.result
        if breakdown is None or breakdown.get("micro_step") != self.handle._micro_steps:
            return None
        return breakdown

    def _activation_peak(self, layers: List[LayerCost]) -> float:
        """The measured step's activation peak: the peak breakdown's; without one (it was not
        profiled), on CUDA the allocator's peak since it was last reset, else every layer's
        saved bytes: upper bounds."""
        breakdown = self._measured_breakdown()
        if breakdown is not None:
            return breakdown["step_peak_bytes"]
        if self._cuda:
            return max(0, torch.cuda.max_memory_allocated() - self._allocated_at_start)
        return sum(cost.saved_bytes_per_token for cost in layers) * self._measured_tokens

    def _phase_peak(self, key: str) -> int:
        """The measured step's peak in one phase of the peak breakdown (`key`: the layers'
        backward, the forward and the head, or either alone), weights and all (0: not
        profiled)."""
        breakdown = self._measured_breakdown()
        if breakdown is None:
            return 0
        rise = breakdown.get(key, 0)
        return int(self._allocated_at_start + rise) if rise else 0

    def _head_rise(self) -> int:
        """What the measured step's head allocated above its start (0: not profiled)."""
        breakdown = self._measured_breakdown()
        return int(breakdown["head_loss_bytes"]) if breakdown is not None else 0

    def _head_stranded(self) -> int:
        """The allocator's stranded free pieces as the measured step's head began (0: not
        profiled, or no allocator)."""
        breakdown = self._measured_breakdown()
        return int(breakdown.get("head_stranded_bytes", 0)) if breakdown is not None else 0

    def _output_offload(self) -> Optional[OutputOffload]:
        """What offloading op outputs may use under this installation's engine settings
        (see ckpt_offload.budget, "Offloaded outputs"); None without an offload backend."""
        engine = self.handle.engine
        rate = self.planned_copy_bytes_per_second = self._copy_rate()
        if engine.backend is None or rate <= 0:
            return None
        config = engine.config
        return OutputOffload.for_engine(
            rate, config.keep_last, config.prefetch_depth, config.max_inflight_d2h_groups,
            config.min_offload_bytes, config.host_memory_limit_bytes(), self.copy_window_share,
            self.resident_storage_offload)

    def _copy_rate(self) -> float:
        """The copy rate offloaded outputs are planned with: the one set, else on CUDA the
        device's measured rate (ckpt_offload.copy_rate), else the policy's figure."""
        if self.copy_bytes_per_second is not None:
            return self.copy_bytes_per_second
        measured = host_copy_bytes_per_second() if self._cuda else 0.0
        if measured > 0:
            self.copy_bytes_per_second = measured
            self._say("copy_rate", "ckpt_offload.hf: copies to pinned host memory run at "
                      "%.1f GB/s on this device (measured); offloaded outputs are planned "
                      "with it", measured / 1e9)
            return measured
        return policy.HOST_COPY_BYTES_PER_SECOND

    def _largest_block_per_token(self, activation_peak: float) -> float:
        """The LM head's float32 logits per token, bounded by the measured step's head
        stretch (the peak breakdown's head_loss_bytes, else its activation peak)."""
        breakdown = self._measured_breakdown()
        head = activation_peak if breakdown is None else breakdown["head_loss_bytes"]
        logits = 4 * self._vocab if self._vocab else head / self._measured_tokens
        return min(logits, head / self._measured_tokens)

    def _plan_for(self, measured: StepMeasurement, tokens: int, changed: bool) -> LayerPlan:
        budget = parse_memory_budget(self.value, device_memory_bytes())
        if budget is None:  # "auto" or a fraction without CUDA: the measured step's own peak
            budget = checkpointed_peak(measured, tokens)
            self._say("no_device", "ckpt_offload.hf: memory_budget=%r needs a CUDA device to "
                      "size it; without one the plan keeps the measured step's peak", self.value)
        reserve = int(measured.largest_block_bytes_per_token * tokens) if changed else 0
        if self.kept_share < 1:  # backed off after running out of memory
            if self.kept_share <= 0:  # every layer checkpointed, nothing offloaded
                return dataclasses.replace(plan_layers(measured, tokens, 1, 0, None),
                                           budget_bytes=budget)
            floor = checkpointed_peak(measured, tokens) + reserve
            budget = min(budget, int(floor + max(0, budget - floor) * self.kept_share))
        plan = plan_layers(measured, tokens, budget, reserve, self._output_offload())
        step = ("" if plan.checkpointed_step_seconds <= 0 else
                " (a step of %.1f ms predicted, %.1f ms with every layer checkpointed)"
                % (plan.predicted_step_seconds * 1e3, plan.checkpointed_step_seconds * 1e3))
        self._say(("plan", tokens, changed), "ckpt_offload.hf: memory budget, %d tokens per "
                  "micro-step%s: %s; predicted to save %.1f ms of recompute%s", tokens,
                  " (length changed: %.2f GiB kept free)" % (reserve / GIB) if reserve else "",
                  plan.describe(), plan.predicted_seconds_saved * 1e3, step)
        if not plan.fits:
            self._say("over", "ckpt_offload.hf: memory_budget=%r is below what the step needs "
                      "with every layer checkpointed; every layer stays checkpointed", self.value)
        return plan

    def _report_measurement(self, measured: StepMeasurement,
                            probes: Dict[nn.Module, _LayerProbe]) -> None:
        missing = len(self.handle._layers) - len(probes)
        if missing and self.value is not None:
            self._say("own_flags", "ckpt_offload.hf: %d of %d layers are not checkpointed by "
                      "the model's own settings (every_n_layers or a layer's flag); they stay "
                      "so, and the memory budget plans the other %d", missing,
                      len(self.handle._layers), len(probes))
        layer_bytes = max(c.saved_bytes_per_token for c in measured.layers) * measured.tokens
        layer_ms = max(c.recompute_seconds_per_token for c in measured.layers) * measured.tokens
        metered_ms = max((p.seconds for p in probes.values()), default=0.0)
        phases = ""
        if measured.forward_peak_bytes and measured.head_peak_bytes:
            phases = (f" (its forward at {measured.forward_peak_bytes / GIB:.2f}, its head at "
                      f"{measured.head_peak_bytes / GIB:.2f}, rising "
                      f"{measured.head_rise_bytes / GIB:.2f}; its layers' backward at "
                      f"{measured.layer_phase_peak_bytes / GIB:.2f})")
        elif measured.head_phase_peak_bytes:
            phases = (f" (its forward and head at {measured.head_phase_peak_bytes / GIB:.2f}, "
                      f"the head rising {measured.head_rise_bytes / GIB:.2f}; its layers' "
                      f"backward at {measured.layer_phase_peak_bytes / GIB:.2f})")
        logger.info("ckpt_offload.hf: measured at %d tokens: a layer saves up to %.2f GiB and "
                    "its recompute takes up to %.2f ms (%.2f ms while metered); the step peaked at "
                    "%.2f GiB%s, with %.2f GiB of free pieces stranded as the head began",
                    measured.tokens, layer_bytes / GIB, layer_ms * 1e3, metered_ms * 1e3,
                    measured.peak_bytes / GIB, phases, measured.stranded_bytes / GIB)

    def advice(self) -> Optional[str]:
        """Without a budget: what memory_budget='auto' would buy at the measured length, or
        None (no measurement, no CUDA device, or nothing would fit)."""
        measured = self.measurement
        device = device_memory_bytes()
        if self.value is not None or measured is None or device is None:
            return None
        budget = parse_memory_budget("auto", device)
        plan = plan_layers(measured, measured.tokens, budget, 0, self._output_offload())
        if plan.count(CHECKPOINT) == len(plan.modes):
            return None
        return (f"The step uses {measured.peak_bytes / GIB:.1f} GiB of {device / GIB:.1f} GiB: "
                f"memory_budget='auto' would run {plan.count(RESIDENT)} of "
                f"{len(plan.modes)} layers without checkpointing and keep op outputs for "
                f"{plan.count(SELECTIVE)} more, saving about "
                f"{plan.predicted_seconds_saved * 1e3:.0f} ms of recompute per micro-step.")

    def stats(self) -> Dict[str, float]:
        """The plan of the running step (of the latest planned one while a step is measured),
        with its predicted step time and the checkpointed step's it came from, the median
        time of its latest steps (budget_measured_step_ms, over budget_measured_steps of
        them: from a training forward's start to its backward's end, on CUDA the device's),
        budget_measuring (1: this step is measured, every layer checkpointed), the
        memory reserved by the end of the latest planned step (CUDA) and the allocator's
        free pieces stranded as the head began in the step the plan was measured from."""
        figures = {key: 0 for key in STAT_KEYS}
        if self.latest_plan is not None:
            figures.update(plan_summary(self.latest_plan))
            # Measurements are never dropped: the one a plan came from still covers it.
            figures["budget_stranded_bytes"] = self._covering(
                self.latest_plan.tokens).stranded_bytes
            seconds, count = self._step_times.median(self._latest_key)
            figures["budget_measured_step_ms"] = seconds * 1e3
            figures["budget_measured_steps"] = count
        figures["budget_measured_peak_bytes"] = self.measured_peak_bytes
        figures["budget_measuring"] = int(self._probes is not None)
        figures["budget_copy_bytes_per_second"] = self.planned_copy_bytes_per_second
        figures["budget_kept_share"] = self.kept_share
        return figures

    def _say(self, key, message: str, *args, level: int = logging.INFO) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.log(level, message, *args)


def _output_vocab(model: nn.Module) -> int:
    """The output size of the model's LM head (its output embeddings), or 0 when it has none."""
    for module in model.modules():
        getter = getattr(module, "get_output_embeddings", None)
        if getter is None:
            continue
        try:
            head = getter()
        except (NotImplementedError, AttributeError):
            continue
        if isinstance(head, nn.Linear):
            return head.out_features
    return 0
