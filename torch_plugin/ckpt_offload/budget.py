"""The memory-budget policy: how a step spends device memory that checkpointing leaves
free, layer by layer, from what one step measured and how much device memory a step may use.

Each checkpointed layer runs in one of three modes:

  CHECKPOINT  checkpointed, its input offloaded (ckpt_offload's default): nothing of it
              stays on the device between its forward and its backward; its backward
              recomputes its forward first.
  SELECTIVE   checkpointed, its input offloaded, and the outputs of chosen ops of its
              forward (its *kept outputs*) stay on the device for the recompute, which
              skips those ops and recomputes the rest.
  RESIDENT    not checkpointed: its saved tensors stay on the device from its forward to
              its backward (but those it offloads, see "Resident layers"), and its
              backward recomputes nothing.

A CHECKPOINT or SELECTIVE layer may also offload the outputs of chosen ops (its *offloaded
outputs*, see "Offloaded outputs") with its input, instead of recomputing them.

Costs come from a measured step (every layer checkpointed): each layer's saved bytes and
recompute time (the time of its forward, which runs the same ops, where it was timed),
each op of its recompute that could be kept (its output's bytes and its own time), the
step's tokens, and its peak. A step of `t` tokens is planned from a measured step of at
least `t` tokens, its per-token figures applied to `t` (bytes per token grow with length
where attention materializes its scores, and never shrink, so a longer step's figures bound
a shorter one's); plan_layers also accepts a shorter measurement and then grows the
measured peak linearly with tokens.

Memory. A resident layer's saved tensors, and a selective layer's kept outputs, are live
from its forward to its backward (its recompute), so at the end of the forward (where the
head's loss runs) all of them are live at once. The plan counts them by phase of the
measured step (each phase's peak grown with tokens): all of them on top of the head's peak;
on top of the forward's, what the checkpointed layers keep and the offloaded outputs in
transit (the copies in flight); beside the layers' backward while resident layers run, all
but the resident layer that keeps least (backward frees the resident layers first, and a
layer's own saved tensors are in that phase's measured peak already: it recomputed them),
which bounds their forward too (a resident layer's forward runs its recompute's ops, saving
the same tensors, on top of what the layers below it keep; H100, 8B, Liger, s8k: 70.57 GiB
at the last layer's forward against 70.81 counted); beside it while checkpointed layers
run, what they keep plus the offloaded outputs in transit (their prefetch begins with the
lowest resident layer's backward: none is on the device beside the resident layers above
it, unless those offload storages of their own, see "Resident layers"); the whole step's
peak bounds all. Where the forward and the head were not measured apart, their common peak
stands for the head's and the forward has no term of its own. With the model's own loss
the head's float32 logits are the step's peak, and this is the whole step's peak plus all
that is kept; with a fused loss, which makes no logits, the step peaks in the layers'
backward (H100, 8B, Liger: the head rose 0.5 GiB at s8k, a layer's recompute and backward
2.8 GiB), where counting every resident layer put the prediction 3.6 GiB above the plan's
allocations (19 resident layers, s8k), and the forward's peak (a checkpointed layer's
transients, 1.5 GiB above its start) is above the head's: counting all that is kept on top
of it put the prediction 1.0 GiB above. The predicted reserved peak, which the plan holds to
the budget, still counts all that is kept on top of the forward's peak (with the margins
below): with eager attention (1B shape, s4k, H100) the plans' allocations were as predicted
(0.43 GiB above at most), but the float32 attention probabilities' cached blocks kept 2.4-3.1
GiB reserved above them, 1.3 GiB over a prediction without that term.

Reserved memory is more: what a layer keeps lies in segments cut for its forward's
transients, and the free pieces beside it cannot hold the head's large blocks (a language
model's float32 logits), which need new segments. On the H200 (8B, s8k), a plan keeping
47.7 GiB at an 80 GiB cap ran out of memory with 7.1 GiB in such pieces, its allocations 5
GiB below the prediction; one keeping 10.7 GiB reserved 1.3 GiB above its allocated peak.
On the H100 with the budget as the cap (38 GiB, 8B, s8k), a plan keeping 9.5 GiB stranded
1.63 GiB (17 %) and ran out of memory 0.17 GiB short for the logits, its allocations where
predicted; rerun with each kept byte counted 20 % more, it kept 9.1 GiB and stranded 2.01
GiB. Part of that is the checkpointed step's own: ckpt_offload without a budget, at a 28
GiB cap, stranded 0.97 GiB when the logits were asked for, and beyond that the plans
stranded at most 11.4 % of what they kept. So each kept byte is counted with
FRAGMENTATION_MARGIN more, the measured step's own free pieces as its head began
(`stranded_bytes`) are added to its peak, and the plan's predicted peak is of reserved
memory. What strands is the head's blocks: cached from one step, carved by the next one's
kept tensors, too short for that step's own. A fused loss asks for small blocks (a chunk of
logits), and its plans reserved little above their allocations (H100, 8B, Liger: 0.6 GiB
at s8k keeping 45.6 GiB, 2.0 GiB at s16k keeping 42.6 GiB, of which 0.98 GiB were the
measured step's own pieces and the rest about its head's 1.0 GiB rise). So the margin is at
most HEAD_BLOCKS_STRANDED times the measured head's rise, unless a layer's recompute asks for
larger blocks: eager attention's float32 probabilities (2 GiB a layer, 1B shape, s4k) left
1.92 GiB of free pieces beside a Liger plan's kept tensors, and that plan, held to its
predicted reserved peak, ran out of memory asking for one (H200). The margin may reach
LAYER_BLOCKS_STRANDED times the largest such block.

Order. The resident layers are the last ones: backward frees them first, so every
checkpointed layer's recompute runs without them, and they leave the allocator's segments
least fragmented (measured on the H200: with the first layers resident instead, the
reserved peak rose 4 GiB above the allocated one at a 33 GiB cap, and a 40 GiB cap ran out
of memory). Each still forms an (empty) offload group, so that what is saved after the last
layer, and only that, is taken for the model's head.

Offloaded outputs. An op output can also go to the host with its layer's input (one
offload group) and come back with it for the recompute, which skips that op: it holds device
memory only while it is copied, and costs copy time, which the layer's forward hides up to
its copy window: what the copy rate moves in the time of the layer's forward (its
recompute time), less the layer's input. Each layer offloads its candidates by rank (seconds
per byte), each that still fits its window, before the budget is spent: it costs no device
memory beyond the layers in transit. Those are at most `layers_on_device` layers' outputs
beside a checkpointed layer's backward (the prefetched layers' and the one being
recomputed; in forward, the copies in flight), counted above the measured peak of the
layers' backward (not the head's), the largest layer's outputs each. The last layers
offload none: their groups stay on the device (keep_last), or are still in flight, while
the head runs. When the layers in transit do not fit the budget, every window shrinks by
half until they fit or none is left.
Host memory bounds them too: every layer's input and offloaded outputs are in the host pool
at the end of the forward, beside what the head offloads, and a block the pool refuses
(host_memory_limit) stays on the device, where the plan did not count it. So what the
windows chose is held to the limit, less the pool's growth margin and the pool's measured
peak, and the outputs worth most seconds per byte, across layers, are the ones offloaded.
The budget is then spent from there: a layer's other candidates, then the whole layer
resident.

Resident layers (with OutputOffload.resident_storages; off by default, measured no faster: see
RESIDENT_STORAGE_OFFLOAD). A resident layer recomputes nothing, so offloading its outputs
saves no time; its copy window can buy memory instead: it offloads its own saved storages within the
bytes its offloaded outputs would have taken, so the layers in transit and the host pool
hold them as planned, and counts only the rest on the device. It takes the last saved
first (each that fits): backward uses them first, so the layer's first restore, which
prefetches the layer below, comes early in its backward. Taken first-saved first, that
restore came late, and a checkpointed layer below an offloading resident one waited for
its input (H100, 8B: 4.3 ms exposed at s8k, 16.4 ms at s16k, where s16k ran 0.7 % slower
than with resident layers offloading nothing). The measured step names them: the storages
each layer's recompute saves, in order (the same order a resident forward saves them in),
those other layers save too (rotary tables, masks: offloading them would free nothing) and
the layer's parameters left out.

Lengths that change. A step whose length differs from the previous step's allocates into
segments the allocator cut for the other length, and the largest block it asks for (a
language model's float32 logits) may find no free piece big enough while reserved memory is
at the cap: on the H200, 5 of 60 steps of random lengths ran out of memory that way with
plans whose allocated peak was within the budget. Such a step is planned with room for that
block kept free (`reserve_bytes`): resident layers must fit beside the peak plus the
reserve. Outputs in transit are on the device only around the layers' backward (the last
layers offload none, so none is in flight while the head asks for that block): they must
fit beside the layers' backward's peak plus the reserve. So a step whose checkpointed peak
leaves no room for the reserve still offloads, adding nothing where the block is asked for
(on the H100, 8B, 100 random lengths in [4k, 32k]: every step above 28.6k, whose logits
reserve is 13.8-15.7 GiB beside a 71.7 GiB checkpointed peak under a 74.3 GiB budget, ran
fully checkpointed before).

Time. A resident layer saves its whole recompute; a selective one the time of the ops it
keeps. Per byte, some ops are worth far more than the whole layer (attention and the
projections beside it: much time, small outputs), so each layer's choices form a curve of
recompute saved against bytes kept: its ops ranked by time per byte, then the whole layer.
The policy walks the upper concave hull of each layer's curve (a point below it is never the
best use of its bytes) and spends the budget greedily on the steepest next step of any
layer, the last layers first among equals. It never takes a step that does not fit; a
layer whose step did not fit takes no further one. A resident layer is one whose walk went
to the end, and only the last layers may: a layer goes resident only after every layer
after it did. A layer whose measured recompute saved nothing (a time of 0: never
recomputed) is not worth its bytes: it stays checkpointed, and no layer before it goes
resident. Without kept-output candidates (none measured) the plan is the longest run of
last layers that fits. A plan's predicted step time is the measured step's, per token
applied to its tokens, less the recompute it saves. It counts device time only: a selective
or offloading layer adds host work to each op of its forward and recompute (13-19 us per
op on a LoRA layer on the meta device: benchmarks/budget_host_cost.py), hidden where the
device's ops take longer, as they do at 8B s8k.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Dict, FrozenSet, List, Optional, Tuple

CHECKPOINT = "checkpoint"
SELECTIVE = "selective"
RESIDENT = "resident"
MODES = (CHECKPOINT, SELECTIVE, RESIDENT)

# An op of a layer's forward: its name and its ordinal among that op's calls in the forward
# (("aten.mm.default", 3): the layer's fourth matrix multiply).
OpKey = Tuple[str, int]

# Share of what a plan keeps (resident layers' saved tensors, selective layers' kept outputs)
# added for the caching allocator: the plan is held against reserved memory, the measurement
# is of allocations. What a layer keeps pins the segments its freed transients were cut from,
# and the head's large blocks cannot use those free pieces (see "Memory").
FRAGMENTATION_MARGIN = 0.15
# The margin never exceeds this many times what the measured head allocated above its start
# (its blocks are what strands, see "Memory"; twice: the one measured fused-loss plan that
# stranded more than the measured step's own pieces stranded about the head's rise once).
HEAD_BLOCKS_STRANDED = 2.0
# Nor below this many times the largest block a layer's recompute asks for (an op output or
# a saved storage; see "Memory"). H200, 1B shape, eager attention, Liger, s4k: its plan,
# held to its predicted reserved peak with the margin at twice the fused loss's small head
# rise, ran out of memory asking for a layer's 2 GiB float32 attention probabilities, 1.92
# GiB of free pieces beside what it kept.
LAYER_BLOCKS_STRANDED = 1.0

# Device-to-host copy rate of pinned host memory where none was measured (the H200's and
# the H100's, 55 GB/s either way; on CUDA the budget measures its device's,
# ckpt_offload.copy_rate), and the share of a layer's forward its copies may take (they
# queue behind the layer's input and the previous layer's copies). With the measured rate
# (52-53 GB/s on the H100, 8B s8k), shares of 0.8, 0.9, 0.95 and 1.0 ran 0.910, 0.905,
# 0.904 and 0.903 of checkpointing's step at 29 GiB, exposed wait 0 up to 0.95 and 0.3 ms
# at 1.0; at 40 GiB 0.95 waited 0.4 ms.
HOST_COPY_BYTES_PER_SECOND = 55e9
COPY_WINDOW_SHARE = 0.9
# Whether resident layers offload their own saved storages (see "Resident layers"). Off: on
# the H200 (8B, last-saved first, no exposed wait) the whole card at s8k ran 0.714 of
# checkpointing against 0.704 without (every layer resident either way) and s16k at 80 GiB
# 0.831 against 0.823 (2 resident layers against 4); first-saved first on the H100, s8k
# 0.782 against 0.791 but s16k 0.853 against 0.846, with exposed waits.
RESIDENT_STORAGE_OFFLOAD = False
# How often the windows may halve before no output is offloaded (1/256 of a window is
# nothing worth copying).
WINDOW_HALVINGS = 8
# The host pool reserves up to this share above its live bytes (offload_core/host_arena.h's
# growth bound), and its limit is on what it reserves: a step's offloads are planned within
# host_memory_limit / (1 + HOST_POOL_MARGIN).
HOST_POOL_MARGIN = 0.15


@dataclasses.dataclass(frozen=True)
class KeptOutput:
    """An op of a layer's forward whose output could be kept for the recompute: the bytes of
    its output and the seconds the op takes, per token of the measured step."""

    key: OpKey
    bytes_per_token: float
    seconds_per_token: float

    def __post_init__(self):
        if not self.bytes_per_token >= 0 or not self.seconds_per_token >= 0:
            raise ValueError(f"KeptOutput: figures must be >= 0, got {self}")


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One checkpointed layer as measured: the bytes its forward saves and the seconds its
    recompute takes, per token of the measured step, and the ops whose outputs it could keep
    (none: the layer is planned as CHECKPOINT or RESIDENT only)."""

    saved_bytes_per_token: float
    recompute_seconds_per_token: float
    outputs: Tuple[KeptOutput, ...] = ()
    # The bytes of its input that the engine offloads (each layer's group begins with it).
    input_bytes_per_token: float = 0.0
    # The storages its forward saves, per token, in the order it first saves them (its
    # parameters left out), 0 for a storage other layers save too (not the layer's own):
    # what a RESIDENT layer may offload (see "Resident layers"). Empty: not measured.
    storages: Tuple[float, ...] = ()

    def __post_init__(self):
        if (not self.saved_bytes_per_token >= 0 or not self.recompute_seconds_per_token >= 0
                or not self.input_bytes_per_token >= 0
                or not all(size >= 0 for size in self.storages)):
            raise ValueError(f"LayerCost: figures must be >= 0, got {self}")
        keys = [output.key for output in self.outputs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"LayerCost.outputs: an op appears twice in {keys}")


@dataclasses.dataclass(frozen=True)
class StepMeasurement:
    """A step run with every layer checkpointed.

    tokens: its tokens (batch x sequence length); layers: its checkpointed layers in forward
    order; peak_bytes: the device memory allocated at its peak (weights, gradients and
    optimizer state included); activation_peak_bytes: that peak above what was allocated
    when it began (what grows with tokens); step_seconds: its time, from its forward's start
    to its backward's end (where known, without what measuring it cost; 0: unknown);
    largest_block_bytes_per_token: see below."""

    tokens: int
    layers: Tuple[LayerCost, ...]
    peak_bytes: int
    activation_peak_bytes: int
    step_seconds: float = 0.0
    # The largest single block per token the step allocates, as far as known (a language
    # model's float32 logits; 0: unknown), for reserves (see "Lengths that change").
    largest_block_bytes_per_token: float = 0.0
    # The device memory allocated at the peak of the layers' backward (recomputes included;
    # the head's not), weights and all; 0: unknown (the step's peak stands for it).
    layer_phase_peak_bytes: int = 0
    # The host pool's peak of live bytes (the layers' inputs and what the head offloads);
    # 0: unknown (the layers' inputs stand for it).
    host_peak_bytes: int = 0
    # Free pieces of the allocator's segments that also hold live tensors, as the head began
    # (reserved memory a fresh large block, the float32 logits, cannot use); 0: unknown.
    stranded_bytes: int = 0
    # The device memory allocated at the peak of the forward and the head (until the first
    # layer recompute), weights and all; 0: unknown (the step's peak stands for it).
    head_phase_peak_bytes: int = 0
    # What the head's stretch (the last layer's forward's end to the first recompute)
    # allocated above what was allocated as it began: the blocks the head asks for, which
    # bound what the allocator strands beside kept tensors (see "Memory"); 0: unknown.
    head_rise_bytes: int = 0
    # The head_phase_peak_bytes of the forward alone (until the last layer's forward ended)
    # and of the head's stretch alone; 0: unknown (head_phase_peak_bytes stands for both).
    forward_peak_bytes: int = 0
    head_peak_bytes: int = 0

    def __post_init__(self):
        if self.tokens <= 0:
            raise ValueError(f"StepMeasurement.tokens: must be > 0, got {self.tokens}")
        if min(self.peak_bytes, self.activation_peak_bytes, self.layer_phase_peak_bytes,
               self.host_peak_bytes, self.stranded_bytes, self.head_phase_peak_bytes,
               self.head_rise_bytes, self.forward_peak_bytes, self.head_peak_bytes) < 0:
            raise ValueError("StepMeasurement: peak figures must be >= 0")
        if not self.step_seconds >= 0:  # NaN included
            raise ValueError(f"StepMeasurement.step_seconds: must be >= 0, got "
                             f"{self.step_seconds}")

    @functools.cached_property
    def largest_layer_block_per_token(self) -> float:
        """The largest op output or saved storage of any layer's recompute, per token (0:
        none measured); every margin a plan weighs reads it."""
        return max((size for cost in self.layers
                    for size in (*(o.bytes_per_token for o in cost.outputs), *cost.storages)),
                   default=0.0)


@dataclasses.dataclass(frozen=True)
class OutputOffload:
    """What offloading op outputs may use (see "Offloaded outputs"): the copy rate to the
    host; how many layers' offloaded outputs may be on the device at once beside a layer's
    backward; how many last layers offload none; the bytes below which an output is not
    offloaded (the engine keeps it on the device: min_offload_bytes); the host bytes a
    step's inputs and offloaded outputs may hold together (inf: no limit)."""

    bytes_per_second: float
    layers_on_device: int
    last_layers_without: int
    min_bytes: int = 0
    host_bytes: float = math.inf
    # The share of a layer's forward its copies may take, at most (the windows may shrink).
    window_share: float = COPY_WINDOW_SHARE
    # Whether resident layers offload saved storages within their windows.
    resident_storages: bool = False

    def __post_init__(self):
        if not self.bytes_per_second >= 0 or self.layers_on_device < 0:
            raise ValueError(f"OutputOffload: figures must be >= 0, got {self}")
        if self.last_layers_without < 0 or self.min_bytes < 0 or not self.host_bytes >= 0:
            raise ValueError(f"OutputOffload: figures must be >= 0, got {self}")
        if not 0 < self.window_share <= 1:
            raise ValueError(f"OutputOffload.window_share: must be in (0, 1], got "
                             f"{self.window_share}")

    @classmethod
    def for_engine(cls, bytes_per_second: float, keep_last: int, prefetch_depth: int,
                   max_inflight_d2h_groups: int, min_offload_bytes: int,
                   host_memory_limit: Optional[int] = None,
                   window_share: float = COPY_WINDOW_SHARE,
                   resident_storages: Optional[bool] = None) -> "OutputOffload":
        """What the engine's settings allow: beside a layer's backward, the layers
        prefetched and the one recomputed (in forward, the groups whose copies are in
        flight); while the head runs, the kept groups and those in flight are on the
        device, so those layers offload none; the host pool's limit (None: none) less its
        growth margin; resident layers' storage offloads as RESIDENT_STORAGE_OFFLOAD says
        unless `resident_storages` does."""
        host = (math.inf if host_memory_limit is None
                else host_memory_limit / (1.0 + HOST_POOL_MARGIN))
        return cls(bytes_per_second=bytes_per_second,
                   layers_on_device=max(prefetch_depth + 1, max_inflight_d2h_groups),
                   last_layers_without=keep_last + max_inflight_d2h_groups,
                   min_bytes=min_offload_bytes, host_bytes=host, window_share=window_share,
                   resident_storages=(RESIDENT_STORAGE_OFFLOAD if resident_storages is None
                                      else resident_storages))


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """Modes of the checkpointed layers (forward order) for a step of `tokens` tokens, with
    what the policy predicts for it."""

    tokens: int
    budget_bytes: int
    modes: Tuple[str, ...]
    predicted_peak_bytes: int
    predicted_seconds_saved: float
    # The same step with every layer checkpointed, as predicted from the measurement.
    checkpointed_peak_bytes: int
    # Kept free beside the predicted peak (see "Lengths that change").
    reserve_bytes: int = 0
    # Per layer, the ops whose outputs a SELECTIVE layer keeps (empty for the others).
    kept_outputs: Tuple[FrozenSet[OpKey], ...] = ()
    # The bytes those outputs take, all layers together.
    kept_output_bytes: int = 0
    # Per layer, the ops whose outputs it offloads (see "Offloaded outputs"), and their
    # bytes, all layers together.
    offloaded_outputs: Tuple[FrozenSet[OpKey], ...] = ()
    offloaded_output_bytes: int = 0
    # The bytes of outputs the copy windows could take but the host limit could not hold
    # (they are recomputed).
    host_limited_bytes: int = 0
    # Per layer, the storages a RESIDENT layer offloads (ordinals in LayerCost.storages;
    # empty for the others), and their bytes, all layers together.
    resident_offloaded: Tuple[FrozenSet[int], ...] = ()
    resident_offloaded_bytes: int = 0
    # The predicted peak of allocations (the measured ones grown with tokens, and what the
    # plan adds, without the allocator's margins): what the step's tensors will take.
    predicted_allocated_bytes: int = 0
    # The same step with every layer checkpointed: its time, the measured step's per token
    # applied to `tokens` (0: not measured).
    checkpointed_step_seconds: float = 0.0

    @property
    def predicted_step_seconds(self) -> float:
        """The step's predicted time: the checkpointed step's less the recompute the plan
        saves (0: the checkpointed step's time is unknown)."""
        if self.checkpointed_step_seconds <= 0:
            return 0.0
        return max(0.0, self.checkpointed_step_seconds - self.predicted_seconds_saved)

    def count(self, mode: str) -> int:
        return sum(m == mode for m in self.modes)

    def kept(self, index: int) -> FrozenSet[OpKey]:
        """The ops whose outputs layer `index` keeps (empty unless it is SELECTIVE)."""
        return self.kept_outputs[index] if self.kept_outputs else frozenset()

    def offloaded(self, index: int) -> FrozenSet[OpKey]:
        """The ops whose outputs layer `index` offloads (empty for a RESIDENT layer)."""
        return self.offloaded_outputs[index] if self.offloaded_outputs else frozenset()

    def offloaded_storages(self, index: int) -> FrozenSet[int]:
        """The saved storages layer `index` offloads (empty unless it is RESIDENT)."""
        return self.resident_offloaded[index] if self.resident_offloaded else frozenset()

    @property
    def offloading_layers(self) -> int:
        return sum(bool(keys) for keys in self.offloaded_outputs)

    @property
    def keeps_nothing(self) -> bool:
        """Whether the step runs as with no budget: every layer checkpointed, nothing
        offloaded but the inputs."""
        return self.count(CHECKPOINT) == len(self.modes) and not self.offloading_layers

    @property
    def fits(self) -> bool:
        """Whether the step fits the budget at all (with every layer checkpointed)."""
        return self.checkpointed_peak_bytes <= self.budget_bytes

    def describe(self) -> str:
        gib = float(1 << 30)
        selective = self.count(SELECTIVE)
        kept = (f", {selective} checkpointed keeping {self.kept_output_bytes / gib:.2f} GiB of "
                f"op outputs" if selective else "")
        offloading = self.offloading_layers
        if offloading:
            kept += (f", {offloading} offloading {self.offloaded_output_bytes / gib:.2f} GiB of "
                     f"op outputs")
        if self.host_limited_bytes:
            kept += (f" ({self.host_limited_bytes / gib:.2f} GiB more would fit the copy windows "
                     f"but not host_memory_limit)")
        if self.resident_offloaded_bytes:
            kept += (f", the layers without checkpointing offloading "
                     f"{self.resident_offloaded_bytes / gib:.2f} GiB of their saved tensors")
        text = (f"{self.count(RESIDENT)} of {len(self.modes)} layers without checkpointing"
                f"{kept}, {self.count(CHECKPOINT)} checkpointed; predicted peak "
                f"{self.predicted_peak_bytes / gib:.2f} GiB of a {self.budget_bytes / gib:.2f} "
                f"GiB budget")
        if not self.fits:
            text += (f" (with every layer checkpointed the step needs "
                     f"{self.checkpointed_peak_bytes / gib:.2f} GiB: over the budget)")
        return text


def checkpointed_peak(measured: StepMeasurement, tokens: int) -> int:
    """The predicted reserved peak of a step of `tokens` with every layer checkpointed: the
    measured allocations, grown with tokens, and the free pieces stranded beside them (cut
    from the layers' transients, which grow with tokens too)."""
    scale = max(1.0, tokens / measured.tokens)
    return int(_grown_allocations(measured, tokens) + scale * measured.stranded_bytes)


def checkpointed_allocated_peak(measured: StepMeasurement, tokens: int) -> int:
    """The predicted allocated peak of a step of `tokens` with every layer checkpointed
    (checkpointed_peak without the stranded pieces)."""
    return int(_grown_allocations(measured, tokens))


def _grown_allocations(measured: StepMeasurement, tokens: int) -> float:
    """The measured allocated peak, its activations grown to `tokens` (never shrunk: a
    shorter step is bounded by the measured one)."""
    scale = max(1.0, tokens / measured.tokens)
    return measured.peak_bytes + (scale - 1.0) * measured.activation_peak_bytes


def layer_phase_peak(measured: StepMeasurement, tokens: int) -> int:
    """The predicted allocated peak of the layers' backward in a step of `tokens` with every
    layer checkpointed (the step's allocated peak where it was not measured)."""
    if not measured.layer_phase_peak_bytes:
        return checkpointed_allocated_peak(measured, tokens)
    return _grown_phase(measured, measured.layer_phase_peak_bytes, tokens)


def head_phase_peak(measured: StepMeasurement, tokens: int) -> int:
    """The predicted allocated peak of the forward and the head in a step of `tokens` with
    every layer checkpointed (the step's allocated peak where it was not measured)."""
    if not measured.head_phase_peak_bytes:
        return checkpointed_allocated_peak(measured, tokens)
    return _grown_phase(measured, measured.head_phase_peak_bytes, tokens)


def _grown_phase(measured: StepMeasurement, phase_peak: int, tokens: int) -> int:
    """A measured phase's allocated peak, its rise above the step's start grown to `tokens`
    (never shrunk, as the step's)."""
    start = measured.peak_bytes - measured.activation_peak_bytes  # allocated as it began
    rise = max(0, phase_peak - start)
    return int(phase_peak + max(0.0, tokens / measured.tokens - 1.0) * rise)


def fragmentation_bytes(measured: StepMeasurement, tokens: int, kept_bytes: float) -> float:
    """What the allocator may reserve beside `kept_bytes` kept on the device through a step
    of `tokens` (see "Memory"): FRAGMENTATION_MARGIN of them, at most HEAD_BLOCKS_STRANDED
    times what the measured head asked for or LAYER_BLOCKS_STRANDED times the largest block
    of a layer's recompute, whichever is more (never scaled down for a shorter step)."""
    margin = FRAGMENTATION_MARGIN * max(0.0, kept_bytes)
    if measured.head_rise_bytes:
        blocks = max(HEAD_BLOCKS_STRANDED * measured.head_rise_bytes,
                     LAYER_BLOCKS_STRANDED * measured.largest_layer_block_per_token
                     * measured.tokens)
        margin = min(margin, blocks * max(1.0, tokens / measured.tokens))
    return margin


@dataclasses.dataclass(frozen=True)
class _Phases:
    """A step's predicted allocated peaks with every layer checkpointed (see "Memory"): the
    whole step's; its head's (the forward and head's, where they were not measured apart);
    its forward's (0: not measured apart); its layers' backward's; the free pieces stranded
    as its head began, and beside its layers' backward (the same where that phase was not
    measured: its peak is the step's then, 0 where it was)."""

    step: float
    head_phase: float
    head: float
    forward: float
    layers: float
    stranded: float
    layers_stranded: float

    @classmethod
    def of(cls, measured: StepMeasurement, tokens: int) -> "_Phases":
        step = checkpointed_allocated_peak(measured, tokens)
        stranded = checkpointed_peak(measured, tokens) - step
        apart = measured.forward_peak_bytes > 0 and measured.head_peak_bytes > 0
        head_phase = head_phase_peak(measured, tokens)
        return cls(step=step, head_phase=head_phase,
                   head=(_grown_phase(measured, measured.head_peak_bytes, tokens) if apart
                         else head_phase),
                   forward=(_grown_phase(measured, measured.forward_peak_bytes, tokens)
                            if apart else 0.0),
                   layers=layer_phase_peak(measured, tokens), stranded=stranded,
                   layers_stranded=0.0 if measured.layer_phase_peak_bytes else stranded)

    def allocated(self, kept: float, resident: float, lowest_resident: float, transit: float,
                  transit_beside_resident: bool = False) -> float:
        """The allocated peak with `kept` bytes kept through the step (resident layers'
        saved tensors, selective layers' kept outputs), `resident` of them by the resident
        layers, the one keeping least `lowest_resident` (0: none resident), and `transit`
        bytes of offloaded outputs beside the checkpointed layers' forward and backward
        (beside the resident layers' too where `transit_beside_resident`: they offload
        storages)."""
        return max(allocated + live for allocated, _, live in self._terms(
            kept, resident, lowest_resident, transit, transit_beside_resident))

    def reserved(self, measured: StepMeasurement, tokens: int, kept: float, resident: float,
                 lowest_resident: float, transit: float,
                 transit_beside_resident: bool = False) -> float:
        """allocated() with the allocator's margins: the stranded pieces, and
        fragmentation_bytes() of what is live beside each phase; all that is kept counted on
        top of the forward's peak too (see "Memory")."""
        return max(_reserved_peak(measured, tokens, term) for term in self._terms(
            kept, resident, lowest_resident, transit, transit_beside_resident))

    def _terms(self, kept: float, resident: float, lowest_resident: float, transit: float,
               transit_beside_resident: bool) -> List[Tuple[float, float, float]]:
        """The step's candidate peaks, each (its allocated base, its reserved base, the bytes
        live beside it), for allocated() and reserved() (see "Memory"): the checkpointed
        step's own; the head's with all that is kept (reserved: on top of the forward and
        head's common peak); the forward's beside what the checkpointed layers keep; the
        layers' backward's beside each of _beside_layers()."""
        beside = self._beside_layers(kept, resident, lowest_resident, transit,
                                     transit_beside_resident)
        terms = [(self.step, self.step + self.stranded, 0.0),
                 (self.head, self.head_phase + self.stranded, kept)]
        if self.forward:
            terms.append((self.forward, self.forward, beside[0]))
        terms.extend(self._layers_term(live) for live in beside)
        return terms

    def _layers_term(self, live: float) -> Tuple[float, float, float]:
        return (self.layers, self.layers + self.layers_stranded, live)

    @staticmethod
    def _beside_layers(kept: float, resident: float, lowest_resident: float, transit: float,
                       transit_beside_resident: bool) -> Tuple[float, ...]:
        """What is live beside the layers' backward's measured peak (see "Memory"): first,
        beside the checkpointed layers' (below every resident one; their forward's too),
        what they keep and the transit; then, where layers are resident, beside theirs (and
        their forward), all that is kept but the resident layer keeping least."""
        below = (kept - resident + transit,)
        if resident <= 0:
            return below
        return below + (kept - lowest_resident + (transit if transit_beside_resident else 0.0),)

    def layers_reserved(self, measured: StepMeasurement, tokens: int, kept: float) -> float:
        """The layers' backward's reserved peak with `kept` bytes beside it."""
        return _reserved_peak(measured, tokens, self._layers_term(kept))


def _reserved_peak(measured: StepMeasurement, tokens: int,
                   term: Tuple[float, float, float]) -> float:
    """A _Phases term's reserved peak: its reserved base, the bytes live beside it and their
    fragmentation_bytes()."""
    _, reserved, live = term
    return reserved + live + fragmentation_bytes(measured, tokens, live)


@dataclasses.dataclass(frozen=True)
class _Step:
    """One step along a layer's curve: the bytes and seconds it adds (per token), and what
    the layer keeps once it is taken."""

    bytes_per_token: float
    seconds_per_token: float
    kept: FrozenSet[OpKey]
    resident: bool

    @property
    def slope(self) -> float:
        """Seconds saved per byte (infinite for a step that costs no bytes)."""
        if self.bytes_per_token <= 0:
            return math.inf
        return self.seconds_per_token / self.bytes_per_token


def layer_steps(layer: LayerCost) -> List[_Step]:
    """The steps along the upper concave hull of `layer`'s curve (see "Time"): kept outputs
    ranked by seconds per byte, then the whole layer resident. Empty for a layer whose
    recompute saved nothing."""
    whole = (layer.saved_bytes_per_token, layer.recompute_seconds_per_token)
    if whole[1] <= 0:
        return []
    ranked = _ranked(layer.outputs)
    # (bytes, seconds, kept, resident); a prefix that costs the layer's bytes or saves its
    # time (timing noise) is no better than the whole layer.
    points = [(0.0, 0.0, frozenset(), False)]
    total_bytes = total_seconds = 0.0
    keys: List[OpKey] = []
    for output in ranked:
        total_bytes += output.bytes_per_token
        total_seconds += output.seconds_per_token
        keys.append(output.key)
        if total_bytes >= whole[0] or total_seconds >= whole[1]:
            break
        points.append((total_bytes, total_seconds, frozenset(keys), False))
    points.append((whole[0], whole[1], frozenset(), True))
    hull: List[tuple] = []
    for point in points:  # ascending bytes: the upper hull keeps right turns only
        while len(hull) >= 2 and _not_below(hull[-2], hull[-1], point):
            hull.pop()
        hull.append(point)
    return [_Step(b1 - b0, s1 - s0, kept, resident)
            for (b0, s0, _, _), (b1, s1, kept, resident) in zip(hull, hull[1:])]


def _not_below(a, b, c) -> bool:
    """Whether `b` lies on or below the segment from `a` to `c` (so `b` leaves the hull)."""
    return (b[1] - a[1]) * (c[0] - a[0]) <= (c[1] - a[1]) * (b[0] - a[0])


def offloaded_candidates(layer: LayerCost, tokens: int, offload: OutputOffload,
                         window_share: float) -> Tuple[FrozenSet[OpKey], float, float]:
    """The ops whose outputs `layer` offloads at `tokens` within `window_share` of its copy
    window (see "Offloaded outputs"), and never more bytes than the layer saves, with their
    bytes and seconds per token."""
    # Never more than the layer saves: its outputs would be worth less than the layer.
    window = min(window_share * layer.recompute_seconds_per_token * offload.bytes_per_second
                 - layer.input_bytes_per_token, layer.saved_bytes_per_token)
    if window <= 0 or layer.recompute_seconds_per_token <= 0:
        return frozenset(), 0.0, 0.0
    keys: List[OpKey] = []
    total_bytes = total_seconds = 0.0
    for output in _ranked(layer.outputs):
        if output.bytes_per_token * tokens < max(offload.min_bytes, 1):
            continue  # the engine would keep it on the device
        if total_bytes + output.bytes_per_token > window:
            continue
        if total_seconds + output.seconds_per_token >= layer.recompute_seconds_per_token:
            break  # timing noise: never more than the whole recompute
        keys.append(output.key)
        total_bytes += output.bytes_per_token
        total_seconds += output.seconds_per_token
    return frozenset(keys), total_bytes, total_seconds


def resident_storages(layer: LayerCost, tokens: int, allowance_per_token: float,
                      min_bytes: int) -> Tuple[FrozenSet[int], float]:
    """The storages `layer` offloads as RESIDENT at `tokens` (ordinals in layer.storages)
    within `allowance_per_token` bytes per token, and their bytes per token: its own ones of
    at least `min_bytes` (the engine keeps smaller ones), the last saved first, each that
    still fits (see "Resident layers")."""
    chosen: List[int] = []
    total = 0.0
    for ordinal, size in reversed(list(enumerate(layer.storages))):
        if size * tokens < max(min_bytes, 1) or total + size > allowance_per_token:
            continue
        chosen.append(ordinal)
        total += size
    return frozenset(chosen), total


def _ranked(outputs) -> List[KeptOutput]:
    """Outputs that save time, most seconds per byte first."""
    return sorted((o for o in outputs if o.seconds_per_token > 0),
                  key=lambda o: (-_seconds_per_byte(o), o.key))


def _seconds_per_byte(output: KeptOutput) -> float:
    if output.bytes_per_token <= 0:
        return math.inf
    return output.seconds_per_token / output.bytes_per_token


def _within_host(measured: StepMeasurement, tokens: int, chosen: list,
                 offload: OutputOffload) -> Tuple[list, float]:
    """`chosen` (per layer: the offloaded keys and their bytes and seconds per token) held
    to the host bytes left beside what the checkpointed step holds there (the measured
    pool's peak, grown or shrunk with tokens: its inputs and the head's offloads are per
    token): the outputs worth most seconds per byte first, across layers (the last layers
    first among equals). Returns it and the bytes per token it left out."""
    total = sum(bytes_per_token for _, bytes_per_token, _ in chosen)
    held = (measured.host_peak_bytes / measured.tokens if measured.host_peak_bytes
            else sum(layer.input_bytes_per_token for layer in measured.layers))
    room = offload.host_bytes - held * tokens
    if total * tokens <= room:
        return chosen, 0.0
    ranked = sorted(((output, index) for index, (keys, _, _) in enumerate(chosen)
                     for output in measured.layers[index].outputs if output.key in keys),
                    key=lambda item: (-_seconds_per_byte(item[0]), -item[1], item[0].key))
    taken: List[List[KeptOutput]] = [[] for _ in chosen]
    used = 0.0
    for output, index in ranked:
        if used + output.bytes_per_token * tokens <= room:
            taken[index].append(output)
            used += output.bytes_per_token * tokens
    within = [(frozenset(o.key for o in outputs), sum(o.bytes_per_token for o in outputs),
               sum(o.seconds_per_token for o in outputs)) for outputs in taken]
    return within, total - used / tokens


def _without(layer: LayerCost, keys: FrozenSet[OpKey], seconds: float) -> LayerCost:
    """`layer` as the budget sees it once `keys` are offloaded: those are no candidates,
    and its recompute is `seconds` shorter."""
    if not keys:
        return layer
    return dataclasses.replace(
        layer, outputs=tuple(o for o in layer.outputs if o.key not in keys),
        recompute_seconds_per_token=max(0.0, layer.recompute_seconds_per_token - seconds))


def plan_layers(measured: StepMeasurement, tokens: int, budget_bytes: int,
                reserve_bytes: int = 0, offload: Optional[OutputOffload] = None) -> LayerPlan:
    """The plan for a step of `tokens` tokens under `budget_bytes` of device memory (see the
    module's "Offloaded outputs" and "Time"): each layer's offloaded outputs, then its mode
    and kept outputs, chosen so that the offloaded outputs in transit, resident layers'
    saved tensors and selective layers' kept outputs fit beside the checkpointed step's
    peak and `reserve_bytes` kept free. Its predicted peak plus the reserve never exceeds
    the budget unless the checkpointed step's peak plus the reserve does: then nothing is
    kept on the device, and outputs are offloaded where their transit fits beside the
    layers' backward and the reserve (see "Lengths that change"); with the checkpointed
    step alone over the budget, nothing at all. Without `offload`, nothing is offloaded;
    with it, the plan is the better of offloading and not (the memory of the layers in
    transit may buy more as resident layers)."""
    if tokens <= 0:
        raise ValueError(f"tokens: must be > 0, got {tokens}")
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes: must be > 0, got {budget_bytes}")
    if reserve_bytes < 0:
        raise ValueError(f"reserve_bytes: must be >= 0, got {reserve_bytes}")
    plan = _plan_with(measured, tokens, budget_bytes, reserve_bytes, None)
    if offload is not None:
        offloading = _plan_with(measured, tokens, budget_bytes, reserve_bytes, offload)
        if offloading.predicted_seconds_saved > plan.predicted_seconds_saved:
            plan = offloading
        elif offloading.host_limited_bytes:  # the limit is why nothing is offloaded
            plan = dataclasses.replace(plan, host_limited_bytes=offloading.host_limited_bytes)
    return plan


def _plan_with(measured: StepMeasurement, tokens: int, budget_bytes: int, reserve_bytes: int,
               offload: Optional[OutputOffload]) -> LayerPlan:
    base = checkpointed_peak(measured, tokens)
    phases = _Phases.of(measured, tokens)
    count = len(measured.layers)
    offloaded, offloaded_seconds, transit, host_limited = _offloaded_plan(
        measured, tokens, phases, budget_bytes, reserve_bytes, offload)
    layers = [_without(layer, offloaded[i], offloaded_seconds[i])
              for i, layer in enumerate(measured.layers)]
    # Each layer's offloaded outputs' bytes, and what it would offload as RESIDENT: its own
    # storages within those bytes (so the transit and the host pool hold them as they are).
    allowance = [sum(o.bytes_per_token for o in measured.layers[i].outputs
                     if o.key in offloaded[i]) for i in range(count)]
    storages = [resident_storages(measured.layers[i], tokens, allowance[i], offload.min_bytes)
                if offload is not None and offload.resident_storages else (frozenset(), 0.0)
                for i in range(count)]
    steps = [layer_steps(dataclasses.replace(
                 layer, saved_bytes_per_token=layer.saved_bytes_per_token - storages[i][1]))
             for i, layer in enumerate(layers)]
    taken = [0] * count
    stopped = [False] * count
    resident = [False] * count
    kept: List[FrozenSet[OpKey]] = [frozenset()] * count
    kept_bytes = 0.0  # what the plan keeps on the device through the step, all layers
    resident_bytes = 0.0  # the part of it the resident layers keep
    lowest_resident = 0.0  # the fewest bytes a resident layer keeps (0: none resident)
    # Resident layers' own offloaded storages are in transit beside their backward.
    beside_resident = offload is not None and offload.resident_storages
    saved = sum(offloaded_seconds) * tokens
    while True:
        best: Optional[int] = None
        for index in reversed(range(count)):  # the last layers first among equals
            if stopped[index] or taken[index] == len(steps[index]):
                continue
            step = steps[index][taken[index]]
            if step.resident and index + 1 < count and not resident[index + 1]:
                continue  # only after every later layer went resident
            if best is None or step.slope > steps[best][taken[best]].slope:
                best = index
        if best is None:
            break
        step = steps[best][taken[best]]
        more = kept_bytes + step.bytes_per_token * tokens
        lowest, more_resident = lowest_resident, resident_bytes
        if step.resident:
            layer_bytes = sum(s.bytes_per_token for s in steps[best][:taken[best] + 1]) * tokens
            lowest = min(lowest or math.inf, layer_bytes)
            more_resident += layer_bytes
        if (phases.reserved(measured, tokens, more, more_resident, lowest, transit,
                            beside_resident) + reserve_bytes > budget_bytes):
            stopped[best] = True
            continue
        kept_bytes, resident_bytes, lowest_resident = more, more_resident, lowest
        saved += step.seconds_per_token * tokens
        taken[best] += 1
        resident[best] = step.resident
        kept[best] = step.kept
    modes = tuple(RESIDENT if resident[i] else SELECTIVE if kept[i] else CHECKPOINT
                  for i in range(count))
    kept_outputs = tuple(kept[i] if modes[i] == SELECTIVE else frozenset()
                         for i in range(count))
    selective_bytes = sum(step.bytes_per_token for i in range(count) if modes[i] == SELECTIVE
                          for step in steps[i][:taken[i]]) * tokens
    offloaded_outputs = tuple(frozenset() if modes[i] == RESIDENT else offloaded[i]
                              for i in range(count))
    resident_offloaded = tuple(storages[i][0] if modes[i] == RESIDENT else frozenset()
                               for i in range(count))
    resident_offloaded_bytes = sum(storages[i][1] for i in range(count)
                                   if modes[i] == RESIDENT) * tokens
    offloaded_bytes = sum(allowance[i] for i in range(count) if modes[i] != RESIDENT) * tokens
    predicted = phases.reserved(measured, tokens, kept_bytes, resident_bytes, lowest_resident,
                                transit, beside_resident)
    allocated = phases.allocated(kept_bytes, resident_bytes, lowest_resident, transit,
                                 beside_resident)
    return LayerPlan(tokens=tokens, budget_bytes=int(budget_bytes), modes=modes,
                     predicted_peak_bytes=int(predicted), predicted_seconds_saved=saved,
                     checkpointed_peak_bytes=base, reserve_bytes=int(reserve_bytes),
                     kept_outputs=kept_outputs, kept_output_bytes=int(round(selective_bytes)),
                     offloaded_outputs=offloaded_outputs,
                     offloaded_output_bytes=int(round(offloaded_bytes)),
                     host_limited_bytes=host_limited, resident_offloaded=resident_offloaded,
                     resident_offloaded_bytes=int(round(resident_offloaded_bytes)),
                     predicted_allocated_bytes=int(allocated),
                     checkpointed_step_seconds=measured.step_seconds * tokens / measured.tokens)


def _offloaded_plan(measured: StepMeasurement, tokens: int, phases: _Phases, budget: int,
                    reserve: int, offload: Optional[OutputOffload]):
    """Each layer's offloaded outputs and their seconds per token, the bytes of them in
    transit beside the layers' backward (see "Offloaded outputs"), for the widest windows
    (a half, a quarter, ... of each) whose transit fits `budget` beside the layers' backward
    and `reserve` (see "Lengths that change"), and the bytes the host limit left out of
    those windows. None when the checkpointed step alone is over the budget."""
    count = len(measured.layers)
    none = [frozenset()] * count, [0.0] * count, 0.0, 0
    if (offload is None or offload.bytes_per_second <= 0
            or phases.reserved(measured, tokens, 0.0, 0.0, 0.0, 0.0) > budget):
        return none
    share = offload.window_share
    for _ in range(WINDOW_HALVINGS + 1):
        chosen = [offloaded_candidates(layer, tokens, offload, share)
                  if index < count - offload.last_layers_without
                  else (frozenset(), 0.0, 0.0)
                  for index, layer in enumerate(measured.layers)]
        chosen, host_limited = _within_host(measured, tokens, chosen, offload)
        largest = max(bytes_per_token for _, bytes_per_token, _ in chosen) * tokens
        if largest <= 0:
            return none[:3] + (int(round(host_limited * tokens)),)
        in_transit = offload.layers_on_device * largest
        if phases.layers_reserved(measured, tokens, in_transit) + reserve <= budget:
            return ([keys for keys, _, _ in chosen], [seconds for _, _, seconds in chosen],
                    in_transit, int(round(host_limited * tokens)))
        share /= 2
    return none


def plan_summary(plan: LayerPlan) -> Dict[str, float]:
    """The plan's figures as stats() reports them."""
    return {
        "budget_bytes": plan.budget_bytes,
        "budget_resident_layers": plan.count(RESIDENT),
        "budget_selective_layers": plan.count(SELECTIVE),
        "budget_checkpointed_layers": plan.count(CHECKPOINT),
        "budget_kept_output_bytes": plan.kept_output_bytes,
        "budget_tokens": plan.tokens,
        "budget_predicted_peak_bytes": plan.predicted_peak_bytes,
        "budget_predicted_allocated_bytes": plan.predicted_allocated_bytes,
        "budget_predicted_saved_ms": plan.predicted_seconds_saved * 1e3,
        "budget_checkpointed_step_ms": plan.checkpointed_step_seconds * 1e3,
        "budget_predicted_step_ms": plan.predicted_step_seconds * 1e3,
        "budget_reserve_bytes": plan.reserve_bytes,
        "budget_offloading_layers": plan.offloading_layers,
        "budget_offloaded_output_bytes": plan.offloaded_output_bytes,
        "budget_host_limited_bytes": plan.host_limited_bytes,
        "budget_resident_offloaded_bytes": plan.resident_offloaded_bytes,
    }


def uniform_measurement(num_layers: int, tokens: int, saved_bytes_per_token: float,
                        recompute_seconds_per_token: float, peak_bytes: int,
                        activation_peak_bytes: int,
                        outputs: Tuple[KeptOutput, ...] = (),
                        step_seconds: float = 0.0) -> StepMeasurement:
    """A measurement of `num_layers` identical layers (the planner's model of a decoder)."""
    layer = LayerCost(saved_bytes_per_token, recompute_seconds_per_token, tuple(outputs))
    return StepMeasurement(tokens=tokens, layers=(layer,) * num_layers, peak_bytes=peak_bytes,
                           activation_peak_bytes=activation_peak_bytes,
                           step_seconds=step_seconds)

