"""The memory-budget policy (ckpt_offload.budget) on its own: plans within the budget, the
last layers resident, monotone in the budget and the length; and memory_budget's parsing."""

import itertools

import pytest

from ckpt_offload import OffloadConfig
from ckpt_offload.budget import (CHECKPOINT, RESIDENT, ROUNDING_MARGIN, LayerCost,
                                 StepMeasurement, checkpointed_peak, plan_layers,
                                 uniform_measurement)
from ckpt_offload.config import AUTO_BUDGET_MARGIN, parse_memory_budget

GIB = 1 << 30
TOKENS = 8192


def llama_8b(tokens=TOKENS):
    """The figures memory_budget measured for Llama-3.1-8B at s8k on the H200."""
    return uniform_measurement(32, tokens, 2.25 * GIB / tokens, 12.1e-3 / tokens,
                               peak_bytes=int(27.5 * GIB), activation_peak_bytes=int(11.7 * GIB))


def test_the_measured_h200_plans():
    measured = llama_8b()
    assert plan_layers(measured, TOKENS, int(0.95 * 139.8 * GIB)).count(RESIDENT) == 32
    at_80 = plan_layers(measured, TOKENS, int(0.95 * 80 * GIB))
    assert at_80.count(RESIDENT) == 21
    assert at_80.modes == (CHECKPOINT,) * 11 + (RESIDENT,) * 21
    assert at_80.predicted_seconds_saved == pytest.approx(21 * 12.1e-3)
    assert plan_layers(measured, TOKENS, int(0.95 * 40 * GIB)).count(RESIDENT) == 4


@pytest.mark.parametrize("budget_gib, tokens, reserve_gib", itertools.product(
    [1, 20, 27.5, 30, 45.3, 76, 200], [1024, 8192, 16384, 32768], [0, 4]))
def test_plans_stay_within_the_budget_and_resident_layers_are_the_last(
        budget_gib, tokens, reserve_gib):
    measured = llama_8b()
    budget, reserve = int(budget_gib * GIB), int(reserve_gib * GIB)
    plan = plan_layers(measured, tokens, budget, reserve)
    resident = plan.count(RESIDENT)
    assert plan.modes == (CHECKPOINT,) * (32 - resident) + (RESIDENT,) * resident
    base = checkpointed_peak(measured, tokens)
    layer = 2.25 * GIB / TOKENS * tokens * (1 + ROUNDING_MARGIN)
    assert plan.predicted_peak_bytes == pytest.approx(base + resident * layer, abs=64)
    if resident:
        assert plan.predicted_peak_bytes + reserve <= budget
    if resident < 32:  # one more would not have fitted
        assert base + (resident + 1) * layer + reserve > budget
    assert plan.fits == (base <= budget)


def test_more_budget_never_fewer_resident_layers_and_more_tokens_never_more():
    measured = llama_8b()
    counts = [plan_layers(measured, TOKENS, gib * GIB).count(RESIDENT)
              for gib in range(20, 160, 3)]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 32
    by_length = [plan_layers(measured, tokens, 76 * GIB).count(RESIDENT)
                 for tokens in (2048, 4096, 8192, 16384, 32768)]
    assert by_length == sorted(by_length, reverse=True)


def test_a_longer_step_grows_the_measured_peak_a_shorter_one_does_not_shrink_it():
    measured = llama_8b()
    assert checkpointed_peak(measured, TOKENS // 2) == measured.peak_bytes
    assert checkpointed_peak(measured, 2 * TOKENS) == measured.peak_bytes + int(11.7 * GIB)


def test_a_layer_never_recomputed_stops_the_run():
    costs = [LayerCost(1000.0, 1e-6)] * 3 + [LayerCost(1000.0, 0.0)] + [LayerCost(1000.0, 1e-6)] * 2
    measured = StepMeasurement(tokens=10, layers=tuple(costs), peak_bytes=0,
                               activation_peak_bytes=0)
    plan = plan_layers(measured, 10, GIB)
    assert plan.modes == (CHECKPOINT,) * 4 + (RESIDENT,) * 2


def test_bad_figures_are_refused():
    with pytest.raises(ValueError, match="LayerCost"):
        LayerCost(-1.0, 0.0)
    with pytest.raises(ValueError, match="tokens"):
        StepMeasurement(tokens=0, layers=(), peak_bytes=0, activation_peak_bytes=0)
    with pytest.raises(ValueError, match="budget_bytes"):
        plan_layers(llama_8b(), TOKENS, 0)
    with pytest.raises(ValueError, match="reserve_bytes"):
        plan_layers(llama_8b(), TOKENS, GIB, -1)


# memory_budget's values.


@pytest.mark.parametrize("value, expected", [
    (None, None),
    ("auto", int(80 * GIB * (1 - AUTO_BUDGET_MARGIN))),
    (" AUTO ", int(80 * GIB * (1 - AUTO_BUDGET_MARGIN))),
    (0.5, 40 * GIB),
    ("0.5", 40 * GIB),
    (1.0, 80 * GIB),
    ("60GiB", 60 * GIB),
    ("60 GB", 60 * 10**9),
    (12345, 12345),
])
def test_budget_values(value, expected):
    assert parse_memory_budget(value, 80 * GIB) == expected
    assert OffloadConfig(memory_budget=value).memory_budget == value


def test_auto_and_fractions_need_the_device():
    assert parse_memory_budget("auto") is None
    assert parse_memory_budget(0.5) is None
    assert parse_memory_budget("40GiB") == 40 * GIB


@pytest.mark.parametrize("value", ["lots", "auto-ish", -1, 0, 1.5, 0.0, True, [1], "-3GiB"])
def test_bad_budgets_name_the_field(value):
    with pytest.raises(ValueError, match="memory_budget"):
        OffloadConfig(memory_budget=value)


def test_the_budget_is_no_engine_setting():
    assert "memory_budget" not in OffloadConfig.engine_fields()
    assert "keep_last" in OffloadConfig.engine_fields()
