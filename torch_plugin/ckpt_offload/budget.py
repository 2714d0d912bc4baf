"""The memory-budget policy: which checkpointed layers a step can afford to run without
checkpointing, from what one step measured and how much device memory a step may use.

Each checkpointed layer runs in one of two modes:

  CHECKPOINT  checkpointed, its input offloaded (ckpt_offload's default): nothing of it
              stays on the device between its forward and its backward; its backward
              recomputes its forward first.
  RESIDENT    not checkpointed: its saved tensors stay on the device from its forward to
              its backward, and its backward recomputes nothing.

Costs come from a measured step (every layer checkpointed): each layer's saved bytes and
recompute time (counted while its recompute runs), the step's tokens, and its peak. A step of
`t` tokens is planned from a measured step of at least `t` tokens, its per-token figures
applied to `t` (bytes per token grow with length where attention materializes its scores,
and never shrink, so a longer step's figures bound a shorter one's); plan_layers also
accepts a shorter measurement and then grows the measured peak linearly with tokens.

Memory. A resident layer's saved tensors are live from its forward to its backward, so at the
end of the forward (where the head's loss runs) every resident layer's are live at once. The
plan counts all of them on top of the whole measured step's peak: an upper bound.

Order. The resident layers are the last ones: backward frees them first, so every
checkpointed layer's recompute runs without them, and they leave the allocator's segments
least fragmented (measured on the H200: with the first layers resident instead, the
reserved peak rose 4 GiB above the allocated one at a 33 GiB cap, and a 40 GiB cap ran out
of memory). Each still forms an (empty) offload group, so that what is saved after the last
layer, and only that, is taken for the model's head.

Lengths that change. A step whose length differs from the previous step's allocates into
segments the allocator cut for the other length, and the largest block it asks for (a
language model's float32 logits) may find no free piece big enough while reserved memory is
at the cap: on the H200, 5 of 60 steps of random lengths ran out of memory that way with
plans whose allocated peak was within the budget. Such a step is planned with room for that
block kept free (`reserve_bytes`): resident layers must fit beside the peak plus the
reserve.

Time. Each resident layer saves its recompute. Decoder layers of one model cost the same, so
the plan is the longest run of last layers that fits; a layer whose measured recompute
saved nothing (a time of 0: never recomputed) is not worth its bytes and stops the run.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

CHECKPOINT = "checkpoint"
RESIDENT = "resident"
MODES = (CHECKPOINT, RESIDENT)

# Share of a plan's resident bytes added for the caching allocator's rounding (block sizes,
# segments): the plan is held against reserved memory, the measurement is of allocations.
ROUNDING_MARGIN = 0.02


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One checkpointed layer as measured: the bytes its forward saves and the seconds its
    recompute takes, per token of the measured step."""

    saved_bytes_per_token: float
    recompute_seconds_per_token: float

    def __post_init__(self):
        if not self.saved_bytes_per_token >= 0 or not self.recompute_seconds_per_token >= 0:
            raise ValueError(f"LayerCost: figures must be >= 0, got {self}")


@dataclasses.dataclass(frozen=True)
class StepMeasurement:
    """A step run with every layer checkpointed.

    tokens: its tokens (batch x sequence length); layers: its checkpointed layers in forward
    order; peak_bytes: the device memory allocated at its peak (weights, gradients and
    optimizer state included); activation_peak_bytes: that peak above what was allocated
    when it began (what grows with tokens); step_seconds: its time;
    largest_block_bytes_per_token: see below."""

    tokens: int
    layers: Tuple[LayerCost, ...]
    peak_bytes: int
    activation_peak_bytes: int
    step_seconds: float = 0.0
    # The largest single block per token the step allocates, as far as known (a language
    # model's float32 logits; 0: unknown), for reserves (see "Lengths that change").
    largest_block_bytes_per_token: float = 0.0

    def __post_init__(self):
        if self.tokens <= 0:
            raise ValueError(f"StepMeasurement.tokens: must be > 0, got {self.tokens}")
        if self.peak_bytes < 0 or self.activation_peak_bytes < 0:
            raise ValueError("StepMeasurement: peak figures must be >= 0")


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

    def count(self, mode: str) -> int:
        return sum(m == mode for m in self.modes)

    @property
    def fits(self) -> bool:
        """Whether the step fits the budget at all (with every layer checkpointed)."""
        return self.checkpointed_peak_bytes <= self.budget_bytes

    def describe(self) -> str:
        gib = float(1 << 30)
        text = (f"{self.count(RESIDENT)} of {len(self.modes)} layers without checkpointing, "
                f"{self.count(CHECKPOINT)} checkpointed; predicted peak "
                f"{self.predicted_peak_bytes / gib:.2f} GiB of a {self.budget_bytes / gib:.2f} "
                f"GiB budget")
        if not self.fits:
            text += (f" (with every layer checkpointed the step needs "
                     f"{self.checkpointed_peak_bytes / gib:.2f} GiB: over the budget)")
        return text


def checkpointed_peak(measured: StepMeasurement, tokens: int) -> int:
    """The predicted reserved peak of a step of `tokens` with every layer checkpointed."""
    growth = max(0.0, tokens / measured.tokens - 1.0) * measured.activation_peak_bytes
    return int(measured.peak_bytes + growth)


def plan_layers(measured: StepMeasurement, tokens: int, budget_bytes: int,
                reserve_bytes: int = 0) -> LayerPlan:
    """The plan for a step of `tokens` tokens under `budget_bytes` of device memory: the
    longest run of last layers whose saved tensors fit beside the checkpointed step's peak
    and `reserve_bytes` kept free. Its predicted peak plus the reserve never exceeds the
    budget unless the checkpointed step's alone does (then no layer is resident)."""
    if tokens <= 0:
        raise ValueError(f"tokens: must be > 0, got {tokens}")
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes: must be > 0, got {budget_bytes}")
    if reserve_bytes < 0:
        raise ValueError(f"reserve_bytes: must be >= 0, got {reserve_bytes}")
    base = checkpointed_peak(measured, tokens)
    modes: List[str] = [CHECKPOINT] * len(measured.layers)
    peak, saved = base, 0.0
    for index in reversed(range(len(measured.layers))):
        layer = measured.layers[index]
        if layer.recompute_seconds_per_token <= 0:
            break
        extra = layer.saved_bytes_per_token * tokens * (1.0 + ROUNDING_MARGIN)
        if peak + extra + reserve_bytes > budget_bytes:
            break
        peak += extra
        saved += layer.recompute_seconds_per_token * tokens
        modes[index] = RESIDENT
    return LayerPlan(tokens=tokens, budget_bytes=int(budget_bytes), modes=tuple(modes),
                     predicted_peak_bytes=int(peak), predicted_seconds_saved=saved,
                     checkpointed_peak_bytes=base, reserve_bytes=int(reserve_bytes))


def plan_summary(plan: LayerPlan) -> Dict[str, float]:
    """The plan's figures as stats() reports them."""
    return {
        "budget_bytes": plan.budget_bytes,
        "budget_resident_layers": plan.count(RESIDENT),
        "budget_checkpointed_layers": plan.count(CHECKPOINT),
        "budget_tokens": plan.tokens,
        "budget_predicted_peak_bytes": plan.predicted_peak_bytes,
        "budget_predicted_saved_ms": plan.predicted_seconds_saved * 1e3,
        "budget_reserve_bytes": plan.reserve_bytes,
    }


def uniform_measurement(num_layers: int, tokens: int, saved_bytes_per_token: float,
                        recompute_seconds_per_token: float, peak_bytes: int,
                        activation_peak_bytes: int) -> StepMeasurement:
    """A measurement of `num_layers` identical layers (the planner's model of a decoder)."""
    layer = LayerCost(saved_bytes_per_token, recompute_seconds_per_token)
    return StepMeasurement(tokens=tokens, layers=(layer,) * num_layers, peak_bytes=peak_bytes,
                           activation_peak_bytes=activation_peak_bytes)

