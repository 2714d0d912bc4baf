"""The memory-budget policy (ckpt_offload.budget) on its own: plans within the budget, the
last layers resident, kept outputs where they save the most per byte, offloaded outputs
within each layer's copy window, monotone in the budget and the length; and memory_budget's
parsing."""

import dataclasses
import itertools

import pytest

from ckpt_offload import OffloadConfig
from ckpt_offload import budget as budget_module
from ckpt_offload.budget import (CHECKPOINT, COPY_WINDOW_SHARE, RESIDENT, FRAGMENTATION_MARGIN,
                                 SELECTIVE, KeptOutput, LayerCost, OutputOffload, StepMeasurement,
                                 checkpointed_allocated_peak, checkpointed_peak,
                                 fragmentation_bytes, layer_steps, offloaded_candidates,
                                 plan_layers, uniform_measurement)
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
    assert at_80.count(RESIDENT) == 18
    assert at_80.modes == (CHECKPOINT,) * 14 + (RESIDENT,) * 18
    assert at_80.predicted_seconds_saved == pytest.approx(18 * 12.1e-3)
    assert plan_layers(measured, TOKENS, int(0.95 * 40 * GIB)).count(RESIDENT) == 4


def test_a_plans_step_time_is_the_checkpointed_steps_per_token_less_what_it_saves():
    measured = dataclasses.replace(llama_8b(), step_seconds=1.3515)
    for tokens in (4096, TOKENS):
        plan = plan_layers(measured, tokens, int(0.95 * 80 * GIB))
        checkpointed = 1.3515 * tokens / TOKENS
        assert plan.checkpointed_step_seconds == pytest.approx(checkpointed)
        assert plan.predicted_seconds_saved > 0
        assert plan.predicted_step_seconds == pytest.approx(
            checkpointed - plan.predicted_seconds_saved)
    at_80 = plan_layers(measured, TOKENS, int(0.95 * 80 * GIB))
    assert at_80.predicted_step_seconds == pytest.approx(1.3515 - 18 * 12.1e-3)
    # Over the budget nothing is saved: the checkpointed step's time.
    over = plan_layers(measured, TOKENS, GIB)
    assert over.predicted_step_seconds == pytest.approx(1.3515)
    # Without the measured step's time, none is predicted.
    assert plan_layers(llama_8b(), TOKENS, int(0.95 * 80 * GIB)).predicted_step_seconds == 0


@pytest.mark.parametrize("budget_gib, tokens, reserve_gib", list(itertools.product(
    [1, 20, 27.5, 30, 45.3, 76, 200], [1024, 8192, 16384, 32768], [0, 4])))
def test_plans_stay_within_the_budget_and_resident_layers_are_the_last(
        budget_gib, tokens, reserve_gib):
    measured = dataclasses.replace(llama_8b(), stranded_bytes=int(1.5 * GIB))
    budget, reserve = int(budget_gib * GIB), int(reserve_gib * GIB)
    plan = plan_layers(measured, tokens, budget, reserve)
    resident = plan.count(RESIDENT)
    assert plan.modes == (CHECKPOINT,) * (32 - resident) + (RESIDENT,) * resident
    base = checkpointed_peak(measured, tokens)
    layer = 2.25 * GIB / TOKENS * tokens * (1 + FRAGMENTATION_MARGIN)
    assert plan.predicted_peak_bytes == pytest.approx(base + resident * layer, abs=64)
    # Allocations: the stranded pieces and the margin left out.
    assert plan.predicted_allocated_bytes == pytest.approx(
        checkpointed_allocated_peak(measured, tokens)
        + resident * 2.25 * GIB / TOKENS * tokens, abs=64)
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
    # The stranded free pieces come from the layers' transients: they grow with tokens too.
    stranded = dataclasses.replace(measured, stranded_bytes=GIB)
    assert checkpointed_peak(stranded, TOKENS // 2) == measured.peak_bytes + GIB
    assert checkpointed_peak(stranded, 2 * TOKENS) == measured.peak_bytes + int(13.7 * GIB)


def liger_8b():
    """The figures memory_budget measured for Llama-3.1-8B at s8k with Liger's fused loss on
    the H100: the step peaks in the layers' backward, the head rose 0.5 GiB."""
    return dataclasses.replace(
        uniform_measurement(32, TOKENS, 2.25 * GIB / TOKENS, 13.3e-3 / TOKENS,
                            peak_bytes=int(18.77 * GIB), activation_peak_bytes=int(3.53 * GIB)),
        layer_phase_peak_bytes=int(18.77 * GIB), head_phase_peak_bytes=int(16.3 * GIB),
        head_rise_bytes=int(0.5 * GIB), stranded_bytes=int(1.04 * GIB))


def without_phases(measured):
    return dataclasses.replace(measured, layer_phase_peak_bytes=0, head_phase_peak_bytes=0,
                               head_rise_bytes=0, forward_peak_bytes=0, head_peak_bytes=0)


@pytest.mark.parametrize("budget_gib", [30, 50, 74.5])
def test_a_fused_loss_counts_kept_bytes_where_the_step_peaks(budget_gib):
    """With the peak in the layers' backward, the resident layer keeping least is not counted
    beside it (its saved tensors are in that peak already), and the allocator's margin is
    at most twice the head's rise: more layers resident than counting everything on top of
    the step's peak with the full margin."""
    measured, budget = liger_8b(), int(budget_gib * GIB)
    layer = 2.25 * GIB
    plan = plan_layers(measured, TOKENS, budget)
    blind = plan_layers(without_phases(measured), TOKENS, budget)
    resident = plan.count(RESIDENT)
    assert resident > blind.count(RESIDENT) >= 1
    assert plan.predicted_allocated_bytes == pytest.approx(
        measured.layer_phase_peak_bytes + (resident - 1) * layer, abs=64)
    margin = plan.predicted_peak_bytes - plan.predicted_allocated_bytes
    assert 0 < margin <= measured.stranded_bytes + 2 * measured.head_rise_bytes + 64
    assert plan.predicted_peak_bytes <= budget
    if resident < 32:  # one more layer would not have fitted
        assert plan.predicted_peak_bytes + layer > budget


@pytest.mark.parametrize("block_gib", [0.22, 2.0, 8.0])
def test_a_layers_blocks_larger_than_the_heads_widen_the_margin(block_gib):
    """With a fused loss the head asks for small blocks, but a layer's recompute may ask for
    larger ones (eager attention's float32 probabilities): the margin then reaches one such
    block, never more than its share of what is kept, and grows with tokens as the head's
    rise does; sdpa's largest (0.22 GiB at 8B s8k) leaves it at twice the head's rise."""
    measured = liger_8b()
    layers = tuple(dataclasses.replace(cost, outputs=(
        KeptOutput(("aten._softmax.default", 0), block_gib * GIB / TOKENS, 1e-3 / TOKENS),))
        for cost in measured.layers)
    wide = dataclasses.replace(measured, layers=layers)
    head_blocks = 2 * measured.head_rise_bytes
    for kept_gib in (1, 10, 40):
        kept = kept_gib * GIB
        for scale in (0.5, 1, 2):
            expected = min(FRAGMENTATION_MARGIN * kept,
                           max(head_blocks, block_gib * GIB) * max(1, scale))
            assert fragmentation_bytes(wide, int(scale * TOKENS), kept) == pytest.approx(
                expected, abs=64)
    budget = int(50 * GIB)
    narrow_plan, plan = plan_layers(measured, TOKENS, budget), plan_layers(wide, TOKENS, budget)
    assert plan.predicted_peak_bytes <= budget
    if block_gib * GIB <= head_blocks:
        assert plan.predicted_peak_bytes == narrow_plan.predicted_peak_bytes
    else:  # the same layers kept would need one block more than twice the head's rise
        assert plan.count(RESIDENT) < narrow_plan.count(RESIDENT)


@pytest.mark.parametrize("budget_gib", [30, 50, 74.5])
def test_the_forward_and_the_head_measured_apart(budget_gib):
    """The H100's figures (8B, Liger, s8k): the forward peaks with a checkpointed layer's
    transients (17.15 GiB), above the head (16.15). The predicted allocations count all that
    is kept on top of the head's peak, the resident layers' forward as their backward, and
    on top of the forward's peak only what the checkpointed layers keep: the highest of
    those terms, below the count on top of the forward's peak. The reserved peak, which the
    plan holds to the budget, still counts all kept on top of the forward's: the same plan."""
    together = dataclasses.replace(liger_8b(), peak_bytes=int(18.62 * GIB),
                                   layer_phase_peak_bytes=int(18.62 * GIB),
                                   head_phase_peak_bytes=int(17.15 * GIB))
    apart = dataclasses.replace(together, forward_peak_bytes=int(17.15 * GIB),
                                head_peak_bytes=int(16.15 * GIB))
    budget, layer = int(budget_gib * GIB), 2.25 * GIB
    plan = plan_layers(apart, TOKENS, budget)
    kept = plan.count(RESIDENT) * layer + plan.kept_output_bytes
    assert plan.count(RESIDENT) >= 1 and plan.predicted_peak_bytes <= budget
    assert plan.predicted_allocated_bytes == pytest.approx(
        max(16.15 * GIB + kept, 18.62 * GIB + kept - layer,
            17.15 * GIB + plan.kept_output_bytes), abs=64)
    before = plan_layers(together, TOKENS, budget)
    assert plan.modes == before.modes and plan.kept_outputs == before.kept_outputs
    assert plan.predicted_peak_bytes == before.predicted_peak_bytes
    assert plan.predicted_allocated_bytes < before.predicted_allocated_bytes - GIB / 4
    assert before.predicted_allocated_bytes == pytest.approx(17.15 * GIB + kept, abs=64)


@pytest.mark.parametrize("forward_gib", [0, 17.2])
def test_with_the_models_loss_the_phases_change_nothing(forward_gib):
    """The head's logits are the step's peak and its blocks large: every kept byte counts
    on top of that peak, with the full margin, as without the phase figures (the forward's
    and the head's peaks measured apart or not)."""
    measured = dataclasses.replace(
        llama_8b(), layer_phase_peak_bytes=int(18.6 * GIB), head_phase_peak_bytes=int(27.5 * GIB),
        head_rise_bytes=int(11.43 * GIB), stranded_bytes=int(1.04 * GIB),
        forward_peak_bytes=int(forward_gib * GIB),
        head_peak_bytes=int(27.5 * GIB) if forward_gib else 0)
    for budget_gib in (30, 45.3, 76, 120):
        plan = plan_layers(measured, TOKENS, int(budget_gib * GIB))
        blind = plan_layers(without_phases(measured), TOKENS, int(budget_gib * GIB))
        assert plan.modes == blind.modes
        assert plan.predicted_peak_bytes == blind.predicted_peak_bytes
        assert plan.predicted_allocated_bytes == blind.predicted_allocated_bytes


def test_a_layer_never_recomputed_stops_the_run():
    costs = [LayerCost(1000.0, 1e-6)] * 3 + [LayerCost(1000.0, 0.0)] + [LayerCost(1000.0, 1e-6)] * 2
    measured = StepMeasurement(tokens=10, layers=tuple(costs), peak_bytes=0,
                               activation_peak_bytes=0)
    plan = plan_layers(measured, 10, GIB)
    assert plan.modes == (CHECKPOINT,) * 4 + (RESIDENT,) * 2


def test_plans_leave_room_for_the_free_pieces_their_kept_bytes_strand(monkeypatch):
    """The H200 step that ran out of memory (8B s8k, 80 GiB cap, memory_budget='auto'): what
    it kept, 47.7 GiB, left 7.13 GiB in free pieces of segments that no float32 logits block
    could use. At that rate, a plan's allocations and its stranded pieces fit the cap, while
    the plan still spends most of it."""
    cap = 80 * GIB
    stranded_per_kept_byte = 7.13 / 47.7

    def reserved_at_that_rate(measured, margin):
        monkeypatch.setattr(budget_module, "FRAGMENTATION_MARGIN", margin)
        plan = plan_layers(measured, TOKENS, parse_memory_budget("auto", cap))
        kept = (plan.predicted_peak_bytes - plan.checkpointed_peak_bytes) / (1 + margin)
        assert kept > 35 * GIB  # the plan still spends most of the cap
        return plan.checkpointed_peak_bytes + kept * (1 + stranded_per_kept_byte)

    for measured in (llama_8b(), llama_8b_with_outputs()):
        assert reserved_at_that_rate(measured, FRAGMENTATION_MARGIN) <= cap
        # The margin the failed step was planned with.
        assert reserved_at_that_rate(measured, 0.02) > cap


def test_plans_fit_a_cap_equal_to_their_budget_at_the_stranding_measured_there():
    """The H100 steps with the budget as the cap (8B s8k, memory_budget=38GiB under a 38 GiB
    cap) ran out of memory asking for the float32 logits with 1.63 GiB of free pieces
    stranded beside 9.5 GiB kept, and 2.01 GiB beside 9.1 GiB; ckpt_offload alone stranded
    0.97 GiB there. A plan that counts the measured step's own stranded bytes fits the budget
    itself at the worst rate seen beyond them, for every budget from today's peak to the
    whole card; one that does not count them, planned to the budget's edge, does not."""
    own = 0.97 * GIB
    beyond_per_kept_byte = max((1.63 * GIB - own) / (9.5 * GIB), (2.01 * GIB - own) / (9.1 * GIB))

    def needs(measured, budget):
        plan = plan_layers(measured, TOKENS, budget)
        allocated = measured.peak_bytes  # the checkpointed step's, at TOKENS
        kept = (plan.predicted_peak_bytes - plan.checkpointed_peak_bytes) / (
            1 + FRAGMENTATION_MARGIN)
        return allocated + own + kept * (1 + beyond_per_kept_byte)

    for measured in (llama_8b(), llama_8b_with_outputs()):
        counted = dataclasses.replace(measured, stranded_bytes=int(own))
        budgets = [gib * GIB for gib in range(29, 140, 2)]
        assert all(needs(counted, budget) <= budget for budget in budgets)
        assert any(needs(measured, budget) > budget for budget in budgets)


def test_bad_figures_are_refused():
    with pytest.raises(ValueError, match="LayerCost"):
        LayerCost(-1.0, 0.0)
    with pytest.raises(ValueError, match="tokens"):
        StepMeasurement(tokens=0, layers=(), peak_bytes=0, activation_peak_bytes=0)
    with pytest.raises(ValueError, match="peak figures"):
        StepMeasurement(tokens=1, layers=(), peak_bytes=0, activation_peak_bytes=0,
                        stranded_bytes=-1)
    for seconds in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="step_seconds"):
            StepMeasurement(tokens=1, layers=(), peak_bytes=0, activation_peak_bytes=0,
                            step_seconds=seconds)
    with pytest.raises(ValueError, match="budget_bytes"):
        plan_layers(llama_8b(), TOKENS, 0)
    with pytest.raises(ValueError, match="reserve_bytes"):
        plan_layers(llama_8b(), TOKENS, GIB, -1)


# Kept outputs.

MIB = 1 << 20

# The per-op figures for one 8B layer at s8k: (key, output MiB, ms).
LLAMA_8B_OPS = (
    (("aten.mm.default", 0), 64, 0.85),   # q
    (("aten.mm.default", 1), 16, 0.36),   # k
    (("aten.mm.default", 2), 16, 0.37),   # v
    (("aten._scaled_dot_product_flash_attention.default", 0), 64, 1.5),
    (("aten.mm.default", 3), 64, 0.85),   # o
    (("aten.mm.default", 4), 224, 2.49),  # gate
    (("aten.mm.default", 5), 224, 2.49),  # up
    (("aten.mm.default", 6), 64, 2.12),   # down
    (("aten.mul.Tensor", 0), 64, 0.01),   # cheap: never worth its bytes
)


def llama_8b_with_outputs(tokens=TOKENS):
    outputs = tuple(KeptOutput(key, mib * MIB / tokens, ms * 1e-3 / tokens)
                    for key, mib, ms in LLAMA_8B_OPS)
    return uniform_measurement(32, tokens, 2.25 * GIB / tokens, 12.1e-3 / tokens,
                               peak_bytes=int(27.5 * GIB), activation_peak_bytes=int(11.7 * GIB),
                               outputs=outputs)


def test_a_layers_steps_follow_the_upper_hull_and_end_resident():
    steps = layer_steps(llama_8b_with_outputs().layers[0])
    slopes = [step.slope for step in steps]
    assert slopes == sorted(slopes, reverse=True)
    assert [step.resident for step in steps] == [False] * (len(steps) - 1) + [True]
    # The kept outputs grow step by step, best per byte first: down, attention, then k/v.
    kept = [step.kept for step in steps[:-1]]
    assert all(a < b for a, b in zip(kept, kept[1:]))
    assert kept[0] == {("aten.mm.default", 6)}
    assert ("aten._scaled_dot_product_flash_attention.default", 0) in kept[1]
    # The cheap op never is: the whole layer is worth more per byte.
    assert all(("aten.mul.Tensor", 0) not in k for k in kept)
    # The steps add up to the whole layer.
    layer = llama_8b_with_outputs().layers[0]
    assert sum(s.bytes_per_token for s in steps) == pytest.approx(layer.saved_bytes_per_token)
    assert sum(s.seconds_per_token for s in steps) == pytest.approx(
        layer.recompute_seconds_per_token)


def test_a_point_under_the_hull_is_skipped():
    # Three ops: the second saves little for its bytes, so the hull goes from the first
    # straight to the first three (or the whole layer).
    outputs = (KeptOutput(("a", 0), 1.0, 10.0), KeptOutput(("b", 0), 1.0, 9.0),
               KeptOutput(("c", 0), 10.0, 1.0))
    steps = layer_steps(LayerCost(100.0, 30.0, outputs))
    assert [sorted(k for k, _ in s.kept) for s in steps[:-1]] == [["a"], ["a", "b"]]
    assert steps[-1].resident and steps[-1].bytes_per_token == pytest.approx(98.0)


def test_no_steps_for_a_layer_never_recomputed():
    assert layer_steps(LayerCost(100.0, 0.0, (KeptOutput(("a", 0), 1.0, 1.0),))) == []


@pytest.mark.parametrize("budget_gib", [27.6, 28, 30, 33, 38, 45, 60, 76, 100, 133])
@pytest.mark.parametrize("tokens", [4096, 8192, 16384])
def test_plans_with_kept_outputs_stay_within_the_budget(budget_gib, tokens):
    measured = llama_8b_with_outputs()
    budget = int(budget_gib * GIB)
    plan = plan_layers(measured, tokens, budget)
    base = checkpointed_peak(measured, tokens)
    assert plan.predicted_peak_bytes <= max(budget, base)
    assert plan.fits == (base <= budget)
    resident = plan.count(RESIDENT)
    assert plan.modes[32 - resident:] == (RESIDENT,) * resident
    layer = measured.layers[0]
    by_key = {o.key: o for o in layer.outputs}
    extra = resident * layer.saved_bytes_per_token * tokens
    for mode, kept in zip(plan.modes, plan.kept_outputs):
        assert (mode == SELECTIVE) == bool(kept)
        extra += sum(by_key[key].bytes_per_token for key in kept) * tokens
    assert plan.predicted_peak_bytes == pytest.approx(base + extra * (1 + FRAGMENTATION_MARGIN),
                                                      abs=64)
    kept_bytes = sum(by_key[k].bytes_per_token for ks in plan.kept_outputs for k in ks) * tokens
    assert plan.kept_output_bytes == pytest.approx(kept_bytes, abs=2)


def test_kept_outputs_buy_more_than_resident_layers_at_every_budget():
    with_outputs, without = llama_8b_with_outputs(), llama_8b()
    saved = []
    for gib in range(28, 140, 4):
        plan = plan_layers(with_outputs, TOKENS, gib * GIB)
        plain = plan_layers(without, TOKENS, gib * GIB)
        assert plan.predicted_seconds_saved >= plain.predicted_seconds_saved - 1e-9
        saved.append(plan.predicted_seconds_saved)
    assert saved == sorted(saved)
    # 40 GiB: every layer keeps outputs, none is resident (those bytes buy more kept).
    at_40 = plan_layers(with_outputs, TOKENS, int(0.95 * 40 * GIB))
    assert at_40.count(SELECTIVE) == 32 and at_40.count(RESIDENT) == 0
    assert at_40.predicted_seconds_saved > 4 * plan_layers(
        without, TOKENS, int(0.95 * 40 * GIB)).predicted_seconds_saved
    # The whole card: every layer resident, nothing kept apart.
    full = plan_layers(with_outputs, TOKENS, int(0.95 * 139.8 * GIB))
    assert full.count(RESIDENT) == 32 and full.kept_output_bytes == 0


def test_selective_layers_spread_over_the_layers():
    """Equal layers take each step in turn: at any budget their kept outputs differ by at
    most one step."""
    measured = llama_8b_with_outputs()
    for gib in (28, 29, 31):
        plan = plan_layers(measured, TOKENS, gib * GIB)
        sizes = [len(kept) for kept in plan.kept_outputs]
        steps = {len(s.kept) for s in layer_steps(measured.layers[0])}
        assert max(sizes) - min(sizes) <= max(steps), sizes


# Offloaded outputs.

ENGINE_DEFAULTS = OutputOffload(bytes_per_second=55e9, layers_on_device=2,
                                last_layers_without=3, min_bytes=1 << 20)


def llama_8b_offloading(tokens=TOKENS, layer_phase_gib=20.0):
    """The 8B layers with their ops, a 64 MiB input each, and the layers' backward peaking
    at `layer_phase_gib` (0: not measured)."""
    measured = llama_8b_with_outputs(tokens)
    layer = dataclasses.replace(measured.layers[0], input_bytes_per_token=64 * MIB / tokens)
    return dataclasses.replace(measured, layers=(layer,) * 32,
                               layer_phase_peak_bytes=int(layer_phase_gib * GIB))


def test_a_layer_offloads_its_best_outputs_that_fit_its_copy_window():
    layer = llama_8b_offloading().layers[0]
    by_key = {o.key: o for o in layer.outputs}
    for rate in (20e9, 55e9, 90e9):
        offload = dataclasses.replace(ENGINE_DEFAULTS, bytes_per_second=rate)
        keys, bytes_per_token, seconds_per_token = offloaded_candidates(
            layer, TOKENS, offload, COPY_WINDOW_SHARE)
        window = (COPY_WINDOW_SHARE * 12.1e-3 * rate - 64 * MIB) / TOKENS
        assert 0 < bytes_per_token <= window
        assert bytes_per_token == pytest.approx(sum(by_key[k].bytes_per_token for k in keys))
        assert seconds_per_token == pytest.approx(sum(by_key[k].seconds_per_token for k in keys))
        # Taken by rank: every op left out ranks below all taken ones it would not fit
        # beside, and does not fit the rest of the window.
        for key in set(by_key) - keys:
            assert by_key[key].bytes_per_token > window - bytes_per_token
        assert ("aten.mm.default", 6) in keys  # down: the most seconds per byte
    at_55 = offloaded_candidates(layer, TOKENS, ENGINE_DEFAULTS, COPY_WINDOW_SHARE)[0]
    # q, k, v, attention, o and down fit the window at 55 GB/s; gate and up do not.
    assert {("aten.mm.default", i) for i in (0, 1, 2, 3, 6)} <= at_55
    assert not {("aten.mm.default", 4), ("aten.mm.default", 5)} & at_55
    # Outputs the engine would keep on the device (below min_bytes) are never offloaded.
    small = dataclasses.replace(ENGINE_DEFAULTS, min_bytes=32 * MIB)
    keys = offloaded_candidates(layer, TOKENS, small, COPY_WINDOW_SHARE)[0]
    assert not {("aten.mm.default", 1), ("aten.mm.default", 2)} & keys


def test_at_todays_memory_every_layer_but_the_last_offloads():
    """The layers' backward peaks below the step's peak (the head's): the outputs in transit
    fit beside it, so a budget of the checkpointed step's own peak offloads outputs of every
    layer but the last ones, at the same predicted peak."""
    measured = llama_8b_offloading()
    base = checkpointed_peak(measured, TOKENS)
    plan = plan_layers(measured, TOKENS, base, 0, ENGINE_DEFAULTS)
    assert plan.offloading_layers == 29
    assert plan.offloaded_outputs[29:] == (frozenset(),) * 3
    assert plan.modes == (CHECKPOINT,) * 32 and plan.kept_output_bytes == 0
    assert plan.predicted_peak_bytes == base
    keys, _, seconds = offloaded_candidates(measured.layers[0], TOKENS, ENGINE_DEFAULTS,
                                            COPY_WINDOW_SHARE)
    assert plan.offloaded_outputs[0] == keys
    assert plan.predicted_seconds_saved == pytest.approx(29 * seconds * TOKENS)
    # Without the option nothing is offloaded, and nothing is saved at this budget.
    assert plan_layers(measured, TOKENS, base).predicted_seconds_saved == 0


def test_a_changed_length_whose_reserve_does_not_fit_still_offloads():
    """A changed length's reserve (room for its largest block, asked for at the head) beside
    a checkpointed peak that leaves no room for it: nothing is kept on the device, but the
    outputs in transit, on the device around the layers' backward only, fit beside that
    backward's peak and the reserve, so they are offloaded; the predicted peak stays the
    checkpointed step's. Unmeasured layers' backward (the step's peak stands for it), or a
    checkpointed step over the budget, offload nothing."""
    measured = llama_8b_offloading(layer_phase_gib=20.0)
    base = checkpointed_peak(measured, TOKENS)
    budget, reserve = base + 2 * GIB, 4 * GIB
    plan = plan_layers(measured, TOKENS, budget, reserve, ENGINE_DEFAULTS)
    assert plan.offloading_layers == 29 and plan.predicted_seconds_saved > 0
    assert plan.modes == (CHECKPOINT,) * 32 and plan.kept_output_bytes == 0
    assert plan.predicted_peak_bytes == base
    # Less room beside the layers' backward and the reserve: the windows shrink; none left
    # with the reserve beside that backward alone over the budget.
    tight = plan_layers(measured, TOKENS, budget, budget - int(20.2 * GIB), ENGINE_DEFAULTS)
    assert 0 < tight.offloaded_output_bytes < plan.offloaded_output_bytes
    none = plan_layers(measured, TOKENS, budget, budget - 20 * GIB + 1, ENGINE_DEFAULTS)
    assert none.offloading_layers == 0 and none.predicted_seconds_saved == 0
    unmeasured = llama_8b_offloading(layer_phase_gib=0)
    assert plan_layers(unmeasured, TOKENS, budget, reserve, ENGINE_DEFAULTS).offloading_layers == 0
    over = plan_layers(measured, TOKENS, base - 1, 0, ENGINE_DEFAULTS)
    assert over.offloading_layers == 0 and not over.fits


def test_the_plan_sizes_windows_with_the_offload_share():
    """The plan's windows are offload.window_share of each layer's forward: a wider share
    offloads at least the same outputs and saves at least as much; at 95 % of the 8B layer's
    12.1 ms the gate projection's output (224 MiB) fits beside the top-ranked ones."""
    measured = llama_8b_offloading()
    base = checkpointed_peak(measured, TOKENS)
    gate = ("aten.mm.default", 4)
    previous = None
    for share in (0.2, 0.5, COPY_WINDOW_SHARE, 0.95, 1.0):
        offload = dataclasses.replace(ENGINE_DEFAULTS, window_share=share)
        plan = plan_layers(measured, TOKENS, base, 0, offload)
        keys = offloaded_candidates(measured.layers[0], TOKENS, offload, share)[0]
        assert plan.offloaded_outputs[0] == keys and plan.predicted_peak_bytes <= base
        assert (gate in keys) == (share >= 0.95)
        if previous is not None:
            assert plan.offloaded_output_bytes >= previous.offloaded_output_bytes
            assert plan.predicted_seconds_saved >= previous.predicted_seconds_saved
        previous = plan
    assert OutputOffload.for_engine(55e9, 1, 1, 2, 0, window_share=0.9).window_share == 0.9


@pytest.mark.parametrize("room_gib", [0, 0.2, 0.5, 1, 4])
def test_outputs_in_transit_are_counted_and_their_windows_shrink_to_fit(room_gib):
    """Without a measured layer phase the outputs in transit add to the step's peak: two
    layers' worth (and the fragmentation margin); windows halve until that fits."""
    measured = llama_8b_offloading(layer_phase_gib=0)
    base = checkpointed_peak(measured, TOKENS)
    budget = base + int(room_gib * GIB)
    plan = plan_layers(measured, TOKENS, budget, 0, ENGINE_DEFAULTS)
    assert plan.predicted_peak_bytes <= budget
    if plan.offloading_layers:
        by_key = {o.key: o for o in measured.layers[0].outputs}
        largest = max(sum(by_key[k].bytes_per_token for k in keys)
                      for keys in plan.offloaded_outputs) * TOKENS
        transit = 2 * largest * (1 + FRAGMENTATION_MARGIN)
        device = plan.kept_output_bytes * (1 + FRAGMENTATION_MARGIN) + plan.count(
            RESIDENT) * measured.layers[0].saved_bytes_per_token * TOKENS * (
                1 + FRAGMENTATION_MARGIN)
        assert plan.predicted_peak_bytes == pytest.approx(base + transit + device, abs=64)
        # Allocations: the same, without the margins.
        assert plan.predicted_allocated_bytes == pytest.approx(
            base + 2 * largest + device / (1 + FRAGMENTATION_MARGIN), abs=64)
    full = offloaded_candidates(measured.layers[0], TOKENS, ENGINE_DEFAULTS,
                                COPY_WINDOW_SHARE)[1] * TOKENS
    fits_whole = 2 * full * (1 + FRAGMENTATION_MARGIN) <= room_gib * GIB
    assert (plan.offloaded_output_bytes == pytest.approx(29 * full, rel=1e-6)) == fits_whole


@pytest.mark.parametrize("budget_gib", [40, 55, 70])
@pytest.mark.parametrize("resident_storages", [False, True])
def test_outputs_in_transit_are_counted_beside_the_checkpointed_layers_only(
        budget_gib, resident_storages):
    """With the step's peak in the layers' backward (a fused loss), the offloaded outputs
    are in transit only from the lowest resident layer's backward down (their prefetch
    begins there): beside the resident layers' backward, everything kept but the resident
    layer keeping least; beside the checkpointed layers', what they keep and the transit.
    Resident layers offloading their own storages put transit beside their backward too."""
    measured = dataclasses.replace(llama_8b_offloading(layer_phase_gib=18.77),
                                   head_phase_peak_bytes=int(16.3 * GIB),
                                   peak_bytes=int(18.77 * GIB),
                                   activation_peak_bytes=int(3.53 * GIB))
    offload = dataclasses.replace(ENGINE_DEFAULTS, resident_storages=resident_storages)
    plan = plan_layers(measured, TOKENS, int(budget_gib * GIB), 0, offload)
    resident = plan.count(RESIDENT)
    assert plan.offloading_layers > 0 and resident >= 2
    by_key = {o.key: o for o in measured.layers[0].outputs}
    largest = max(sum(by_key[k].bytes_per_token for k in keys)
                  for keys in plan.offloaded_outputs) * TOKENS
    transit = 2 * largest
    layer = 2.25 * GIB - (plan.resident_offloaded_bytes / resident)
    below = plan.kept_output_bytes
    kept = below + resident * layer
    beside_resident = kept - layer + (transit if resident_storages else 0)
    assert plan.predicted_allocated_bytes == pytest.approx(
        18.77 * GIB + max(beside_resident, below + transit), abs=1024)
    if not resident_storages:  # the transit would have been counted beside the resident layers
        assert plan.predicted_allocated_bytes < 18.77 * GIB + kept - layer + transit - GIB / 4
    assert plan.predicted_peak_bytes <= budget_gib * GIB


def test_offloading_never_buys_less_and_resident_layers_offload_nothing():
    measured = llama_8b_offloading()
    saved = []
    for gib in range(28, 140, 4):
        offloading = plan_layers(measured, TOKENS, gib * GIB, 0, ENGINE_DEFAULTS)
        plain = plan_layers(measured, TOKENS, gib * GIB)
        assert offloading.predicted_seconds_saved >= plain.predicted_seconds_saved
        assert offloading.predicted_peak_bytes <= gib * GIB
        for mode, offloaded, kept in zip(offloading.modes, offloading.offloaded_outputs,
                                         offloading.kept_outputs):
            assert not (mode == RESIDENT and offloaded)
            assert not offloaded & kept  # an op's output is kept or offloaded, not both
        saved.append(offloading.predicted_seconds_saved)
    assert saved == sorted(saved)
    full = plan_layers(measured, TOKENS, int(0.95 * 139.8 * GIB), 0, ENGINE_DEFAULTS)
    assert full.count(RESIDENT) == 32 and full.offloaded_output_bytes == 0


RESIDENT_STORAGES = dataclasses.replace(ENGINE_DEFAULTS, resident_storages=True)


def with_storages(measured, tokens=TOKENS):
    """`measured` whose layers name their saved storages: a rotary table other layers save
    too (0), a 0.5 MiB one (below the engine's min_bytes), then 128 MiB ones and the rest,
    adding up to the layer's saved bytes."""
    layer = measured.layers[0]
    whole = layer.saved_bytes_per_token * tokens
    sizes = [0.0, 0.5 * MIB] + [128 * MIB] * 17
    sizes.append(whole - sum(sizes))
    layer = dataclasses.replace(layer, storages=tuple(size / tokens for size in sizes))
    return dataclasses.replace(measured, layers=(layer,) * len(measured.layers))


@pytest.mark.parametrize("budget_gib", [56, 64, 72, 76, 80])
def test_resident_layers_offload_their_own_storages_within_their_window(budget_gib):
    """A resident layer offloads its own saved storages (the last saved first, each that
    fits, none below min_bytes, none other layers save too) within the bytes its offloaded
    outputs would take, and counts only the rest on the device: at the same budget at
    least as many layers run resident, never over the budget."""
    plain = llama_8b_offloading()
    measured = with_storages(plain)
    budget = budget_gib * GIB
    before = plan_layers(plain, TOKENS, budget, 0, RESIDENT_STORAGES)
    plan = plan_layers(measured, TOKENS, budget, 0, RESIDENT_STORAGES)
    # Off (the default), the same measurement offloads no resident layer's storages.
    assert plan_layers(measured, TOKENS, budget, 0, ENGINE_DEFAULTS).resident_offloaded_bytes == 0
    assert plan.predicted_peak_bytes <= budget
    assert plan.count(RESIDENT) >= before.count(RESIDENT)
    assert plan.predicted_seconds_saved >= before.predicted_seconds_saved
    assert before.resident_offloaded_bytes == 0  # nothing named, nothing offloaded
    window = offloaded_candidates(plain.layers[0], TOKENS, ENGINE_DEFAULTS,
                                  COPY_WINDOW_SHARE)[1] * TOKENS
    sizes = [size * TOKENS for size in measured.layers[0].storages]
    total = 0
    for index, mode in enumerate(plan.modes):
        ordinals = plan.offloaded_storages(index)
        if mode != RESIDENT or index >= 32 - ENGINE_DEFAULTS.last_layers_without:
            assert not ordinals
            continue
        assert ordinals and not ordinals & {0, 1}  # never shared, never below min_bytes
        offloaded = sum(sizes[i] for i in ordinals)
        assert window - 128 * MIB < offloaded <= window + 64  # first fit, within the window
        assert ordinals == set(range(len(sizes) - len(ordinals), len(sizes)))  # last first
        total += offloaded
    assert plan.resident_offloaded_bytes == pytest.approx(total, abs=64)
    if plan.resident_offloaded_bytes:
        assert "of their saved tensors" in plan.describe()


def test_resident_layers_offload_more_residents_at_80_gib():
    """At 80 GiB the memory the resident layers' windows free runs more of them resident."""
    plain = llama_8b_offloading()
    before = plan_layers(plain, TOKENS, 80 * GIB, 0, RESIDENT_STORAGES)
    plan = plan_layers(with_storages(plain), TOKENS, 80 * GIB, 0, RESIDENT_STORAGES)
    assert plan.count(RESIDENT) > before.count(RESIDENT)
    assert plan.predicted_seconds_saved > before.predicted_seconds_saved


@pytest.mark.parametrize("host_share", [0, 0.3, 0.7, 0.95, 2])
def test_offloaded_outputs_stay_within_the_host_limit(host_share):
    """Inputs and offloaded outputs are in the host pool together at the end of the forward:
    what the copy windows chose is held to host_memory_limit less the pool's margin, the
    outputs worth most seconds per byte first; what is left out is reported."""
    measured = llama_8b_offloading()
    base = checkpointed_peak(measured, TOKENS)
    windows = plan_layers(measured, TOKENS, base, 0, ENGINE_DEFAULTS)
    inputs = 32 * 64 * MIB
    limit = int((inputs + host_share * windows.offloaded_output_bytes)
                * (1 + budget_module.HOST_POOL_MARGIN))
    offload = OutputOffload.for_engine(55e9, keep_last=1, prefetch_depth=1,
                                       max_inflight_d2h_groups=2, min_offload_bytes=1 << 20,
                                       host_memory_limit=limit)
    assert dataclasses.replace(offload, host_bytes=ENGINE_DEFAULTS.host_bytes) == ENGINE_DEFAULTS
    plan = plan_layers(measured, TOKENS, base, 0, offload)
    room = limit / (1 + budget_module.HOST_POOL_MARGIN) - inputs
    assert plan.offloaded_output_bytes <= max(0.0, room)
    assert plan.predicted_peak_bytes <= base
    assert plan.offloaded_output_bytes + plan.host_limited_bytes == pytest.approx(
        windows.offloaded_output_bytes, abs=64)
    if host_share >= 1:
        assert plan == windows
        return
    assert plan.host_limited_bytes > 0 and "host_memory_limit" in plan.describe()
    assert plan.predicted_seconds_saved < windows.predicted_seconds_saved
    # Never an output the windows did not choose; every one left out does not fit the rest.
    left = room - plan.offloaded_output_bytes
    by_key = {o.key: o for o in measured.layers[0].outputs}
    for chosen, held in zip(windows.offloaded_outputs, plan.offloaded_outputs):
        assert held <= chosen
        for key in chosen - held:
            assert by_key[key].bytes_per_token * TOKENS > left
    if host_share == 0:
        assert plan.offloading_layers == 0 and plan.predicted_seconds_saved == 0


def test_bad_offload_figures_are_refused():
    with pytest.raises(ValueError, match="OutputOffload"):
        dataclasses.replace(ENGINE_DEFAULTS, bytes_per_second=-1.0)
    with pytest.raises(ValueError, match="OutputOffload"):
        dataclasses.replace(ENGINE_DEFAULTS, last_layers_without=-1)
    with pytest.raises(ValueError, match="OutputOffload"):
        dataclasses.replace(ENGINE_DEFAULTS, host_bytes=-1.0)
    for share in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="window_share"):
            dataclasses.replace(ENGINE_DEFAULTS, window_share=share)
    with pytest.raises(ValueError, match="LayerCost"):
        LayerCost(1.0, 1.0, (), -1.0)
    with pytest.raises(ValueError, match="LayerCost"):
        LayerCost(1.0, 1.0, (), 0.0, (1.0, -1.0))


def test_bad_kept_outputs_are_refused():
    with pytest.raises(ValueError, match="KeptOutput"):
        KeptOutput(("a", 0), -1.0, 0.0)
    with pytest.raises(ValueError, match="outputs"):
        LayerCost(1.0, 1.0, (KeptOutput(("a", 0), 1.0, 1.0),) * 2)


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
