"""memory_budget on tiny Llamas (CPU, host backend): the measured step, the plan each later
step runs, bit-identical losses and gradients to full checkpointing in every plan, and a
predicted peak that bounds the measured one.

Times are read from a clock that ticks once per reading (the `ticking_clock` fixture), so
that every run of a test measures the same figures and plans alike."""

import dataclasses
import functools
import itertools
import logging
import weakref

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import rotate_half

from ckpt_offload import budget as budget_policy
from ckpt_offload.budget import (CHECKPOINT, HOST_POOL_MARGIN, RESIDENT, SELECTIVE, LayerPlan,
                                 OutputOffload, checkpointed_allocated_peak, checkpointed_peak,
                                 plan_layers)
from ckpt_offload.hf import ActivationOffloadCallback, enable_activation_offload
from ckpt_offload.hf import layer_budget
from ckpt_offload.hf.compile import LAYER_CALL_IS_CHECKPOINTED
from ckpt_offload.hf.layer_budget import MEASURED_STEP
from ckpt_offload.hf.peak import LiveTensorMeter
from tiny import (FAMILIES, HOST, VOCAB, assert_same_weights, budget_for,
                  keep_outputs_on_device, tiny_family, tiny_llama, tiny_lora, train)

LAYERS = 6
STEPS = 5


@pytest.fixture(autouse=True)
def ticking_clock(monkeypatch):
    ticks = itertools.count()  # whole numbers: differences exact at any reading
    monkeypatch.setattr(layer_budget, "_clock", lambda: float(next(ticks)))


def llama(dropout: float = 0.0, layers: int = LAYERS, vocab: int = VOCAB) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        attention_dropout=dropout, attn_implementation="eager",
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config)


def batches(lengths, seed=5):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (2, n), generator=generator) for n in lengths]


def run(model, ids_list, handle=None, seed=11, after_step=None):
    """Forward and backward of each batch; (losses, gradients by step). The global RNG is
    seeded once, so dropout draws the same numbers in every run that consumes them alike.
    after_step(), if given, runs after each step's backward, its loss released."""
    model.train()
    torch.manual_seed(seed)
    losses, grads = [], []
    for ids in ids_list:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        del loss
        if after_step is not None:
            after_step()
    return losses, grads


def model_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def metered_run(model, handle, ids_list, metered, seed=11, loss_of=model_loss):
    """run() of `model` under `handle`, each step's stats() read after its forward, and the
    peak of what the steps `metered(step)` selects allocated (LiveTensorMeter, None for the
    others): ((losses, grads), [(stats, peak) per step]). `loss_of(model, ids)`: the loss."""
    model.train()
    torch.manual_seed(seed)
    losses, grads, steps = [], [], []
    for step, ids in enumerate(ids_list, start=1):
        model.zero_grad(set_to_none=True)
        meter = LiveTensorMeter().start() if metered(step) else None
        try:
            loss = loss_of(model, ids)
            stats = handle.stats()
            loss.backward()
        finally:
            if meter is not None:
                meter.stop()
                assert meter.remove()
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        steps.append((stats, meter.peak() if meter is not None else None))
    return (losses, grads), steps


def plan_from(handle, measured):
    """`handle` plans from `measured` (the measurement budget_for sized its budget from)
    instead of measuring its second step again: the CPU meter reads a step's peak as Python
    frees tensors, so a second measurement's peak, and with it the plan, can differ."""
    handle._budget.measurements[measured.tokens] = measured


def recorded_prefetches(handle):
    """A list that gets "prefetch" each time the handle's engine is asked to prefetch ahead
    (the call still goes through)."""
    events = []
    prefetch = handle.engine.prefetch_ahead
    handle.engine.prefetch_ahead = lambda: (events.append("prefetch"), prefetch())[1]
    return events


def checkpointed(model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def assert_identical(expected, actual):
    (losses_a, grads_a), (losses_b, grads_b) = expected, actual
    assert len(losses_a) == len(losses_b)
    for step, (a, b) in enumerate(zip(losses_a, losses_b)):
        assert torch.equal(a, b), f"loss of step {step + 1}"
    for step, (a, b) in enumerate(zip(grads_a, grads_b)):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), f"step {step + 1}: {name}"


def measurement_of(make_model, lengths):
    """A run with an unlimited budget: its measurement (and the plan: every layer resident)."""
    model = checkpointed(make_model())
    handle = enable_activation_offload(model, memory_budget="1TiB", **HOST)
    run(model, batches(lengths), handle)
    measured = handle._budget.measurement
    handle.disable()
    return measured


class OpCounter(TorchDispatchMode):
    """Counts the ops that run while it is entered, by name."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] = self.counts.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("resident, selective", [(0, 0), (0, 3), (2, 0), (LAYERS, 0)])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_every_plan_is_bit_identical_to_checkpointing(resident, selective, dropout, monkeypatch):
    keep_outputs_on_device(monkeypatch)
    lengths = [32] * STEPS
    measured = measurement_of(lambda: llama(dropout), lengths)
    tokens = 2 * 32
    budget = budget_for(measured, tokens, resident, selective)
    plan = plan_layers(measured, tokens, budget)
    expected = run(checkpointed(llama(dropout)), batches(lengths))

    model = checkpointed(llama(dropout))
    handle = enable_activation_offload(model, memory_budget=budget, **HOST)
    plan_from(handle, measured)
    actual = run(model, batches(lengths), handle)

    assert_identical(expected, actual)
    modes = handle.layer_modes()
    assert modes == list(plan.modes)
    # At least as many as asked for (the first resident layer can cost nothing: where the
    # step peaks in the layers' backward, its saved tensors are in that peak already).
    planned = modes.count(RESIDENT)
    assert planned >= resident and modes.count(SELECTIVE) >= selective
    # Resident layers are the last ones.
    assert modes[LAYERS - planned:] == [RESIDENT] * planned
    stats = handle.stats()
    assert stats["budget_resident_layers"] == planned
    assert stats["budget_selective_layers"] == modes.count(SELECTIVE)
    assert stats["budget_checkpointed_layers"] == modes.count(CHECKPOINT)
    assert (stats["budget_kept_output_bytes"] > 0) == (SELECTIVE in modes)
    assert stats["budget_predicted_peak_bytes"] <= budget
    assert stats["budget_bytes"] == budget
    # Every layer forms a group, resident ones too; the head's tensors are offloaded after
    # the last, as without a budget, where a layer is checkpointed (resident layers offload
    # nothing, and the head's candidates are sized by the largest offloaded input).
    assert stats["groups"] == LAYERS
    assert (stats["head_offloaded_tensors"] > 0) == (planned < LAYERS)
    handle.disable()


MODELS = {
    "llama": lambda: llama(),
    "llama-dropout": lambda: llama(dropout=0.2),
    "lora": lambda: tiny_lora(llama()),
}


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_selective_layers_skip_their_kept_ops_in_the_recompute(model_name):
    """A plan whose layers keep their first four matrix multiplies' outputs (the q, k, v and
    o projections; with LoRA, a projection's base and adapter products): each layer's
    recompute runs its other ops only, and losses and gradients stay bit-identical
    (dropout's draws replay in order around the kept ops; LoRA adds out of place)."""
    make_model = MODELS[model_name]
    lengths = [32] * STEPS
    kept = frozenset(("aten.mm.default", i) for i in range(4))
    plan = LayerPlan(tokens=64, budget_bytes=1 << 40, modes=(SELECTIVE,) * LAYERS,
                     predicted_peak_bytes=0, predicted_seconds_saved=0.0,
                     checkpointed_peak_bytes=0, kept_outputs=(kept,) * LAYERS)

    def backward_ops(handle=None):
        model = checkpointed(make_model())
        if handle is not None:
            handle = enable_activation_offload(model, memory_budget="1TiB", **HOST)
            handle._budget._plans[(64, False)] = plan
        losses, grads, counts = [], [], []
        torch.manual_seed(11)
        model.train()
        for ids in batches(lengths):
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            counter = OpCounter()
            with counter:
                loss.backward()
            losses.append(loss.detach().clone())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                          if p.grad is not None})
            counts.append(counter.counts.get("aten.mm.default", 0))
        return (losses, grads), counts

    expected, plain_counts = backward_ops()
    actual, counts = backward_ops(handle=True)
    assert_identical(expected, actual)
    assert counts[:2] == plain_counts[:2]  # checkpointed, then measured
    assert counts[2:] == [c - 4 * LAYERS for c in plain_counts[2:]]


class UnseenInPlaceRotary(torch.autograd.Function):
    """Llama's rotary embedding written into q and k in place where the dispatcher does not
    see it (through numpy here; on the GPU a Triton kernel, as Liger-Kernel's rotary
    embedding writes the projections' outputs), returning them."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        ctx.save_for_backward(cos, sin)
        for tensor in (q, k):
            rotated = tensor * cos + rotate_half(tensor) * sin
            tensor.detach().numpy()[...] = rotated.detach().numpy()
        return q.view_as(q), k.view_as(k)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors

        def unrotated(grad):  # the rotation's transpose
            half = grad.shape[-1] // 2
            turned = grad * sin
            return grad * cos + torch.cat((turned[..., half:], -turned[..., :half]), dim=-1)

        return unrotated(grad_q), unrotated(grad_k), None, None


def unseen_in_place_rotary(q, k, cos, sin, *args, **kwargs):
    return UnseenInPlaceRotary.apply(q, k, cos, sin)


def test_outputs_written_in_place_unseen_are_no_candidates(monkeypatch):
    """An op's output that code the dispatcher does not see writes in place after the op
    (the rotary embedding into the q and k projections' outputs) would be rotated twice in
    a recompute that skipped the op: keeping it changes the gradients. The measured step
    compares each candidate's content at the end of its layer's recompute with what its op
    made: the written ones are no candidates, and a plan keeping every other candidate is
    bit-identical to full checkpointing."""
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", unseen_in_place_rotary)
    lengths = [32] * STEPS
    expected = run(checkpointed(llama()), batches(lengths))
    measured = measurement_of(llama, lengths)
    projections = [("aten.mm.default", i) for i in range(4)]  # q, k, v, o
    for layer in measured.layers:
        keys = {output.key for output in layer.outputs}
        assert projections[0] not in keys and projections[1] not in keys  # written
        assert projections[2] in keys and projections[3] in keys

    def run_keeping(kept_per_layer):
        plan = LayerPlan(tokens=64, budget_bytes=1 << 40, modes=(SELECTIVE,) * LAYERS,
                         predicted_peak_bytes=0, predicted_seconds_saved=0.0,
                         checkpointed_peak_bytes=0, kept_outputs=tuple(kept_per_layer))
        model = checkpointed(llama())
        handle = enable_activation_offload(model, memory_budget="1TiB", **HOST)
        plan_from(handle, measured)
        handle._budget._plans[(64, False)] = plan
        result = run(model, batches(lengths), handle)
        handle.disable()
        return result

    every_candidate = [frozenset(o.key for o in layer.outputs) for layer in measured.layers]
    assert_identical(expected, run_keeping(every_candidate))
    # Keeping the q projection's output anyway: the recompute rotates it twice.
    with pytest.raises(AssertionError, match="step"):
        assert_identical(expected, run_keeping([frozenset(projections[:1])] * LAYERS))


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_offloaded_outputs_go_to_the_host_and_the_recompute_skips_them(model_name):
    """A plan whose layers offload their first four matrix multiplies' outputs with their
    inputs, every other layer keeping its fifth on the device besides: each recompute skips
    those ops, the engine moves the outputs, losses and gradients stay bit-identical, and
    after every step the host pool holds nothing."""
    make_model = MODELS[model_name]
    lengths = [32] * STEPS
    offloaded = frozenset(("aten.mm.default", i) for i in range(4))
    kept = tuple(frozenset({("aten.mm.default", 4)}) if i % 2 else frozenset()
                 for i in range(LAYERS))
    plan = LayerPlan(tokens=64, budget_bytes=1 << 40,
                     modes=tuple(SELECTIVE if k else CHECKPOINT for k in kept),
                     predicted_peak_bytes=0, predicted_seconds_saved=0.0,
                     checkpointed_peak_bytes=0, kept_outputs=kept,
                     offloaded_outputs=(offloaded,) * LAYERS)

    def backward_ops(with_plan):
        model = checkpointed(make_model())
        handle = enable_activation_offload(model, memory_budget="1TiB", **HOST)
        handle._budget._plans[(64, False)] = plan if with_plan else LayerPlan(
            tokens=64, budget_bytes=1 << 40, modes=(CHECKPOINT,) * LAYERS,
            predicted_peak_bytes=0, predicted_seconds_saved=0.0, checkpointed_peak_bytes=0)
        losses, grads, counts, moved = [], [], [], []
        torch.manual_seed(11)
        model.train()
        for ids in batches(lengths):
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            counter = OpCounter()
            with counter:
                loss.backward()
            stats = handle.stats()
            losses.append(loss.detach().clone())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                          if p.grad is not None})
            counts.append(counter.counts.get("aten.mm.default", 0))
            moved.append(stats["offloaded_tensors"])
            del loss
            assert handle.stats()["host_live_bytes"] == 0
        handle.disable()
        return (losses, grads), counts, moved

    expected, plain_counts, plain_moved = backward_ops(with_plan=False)
    actual, counts, moved = backward_ops(with_plan=True)
    assert_identical(expected, actual)
    assert counts[:2] == plain_counts[:2]  # checkpointed, then measured
    skipped = 4 * LAYERS + LAYERS // 2
    assert counts[2:] == [c - skipped for c in plain_counts[2:]]
    # Every layer's input moves (the last group's too: the head's restore prefetches it),
    # and with a plan its four outputs.
    assert moved[:2] == plain_moved[:2] and plain_moved[2:] == [LAYERS] * (STEPS - 2)
    assert moved[2:] == [m + 4 * LAYERS for m in plain_moved[2:]]


def test_a_budget_at_todays_memory_offloads_outputs_bit_identically():
    """memory_budget at the checkpointed step's own peak, which the head's logits set (a
    large vocabulary): nothing fits on the device beside it, but the layers offload op
    outputs, all except the last ones (whose groups are on the device while the head runs),
    their transit below the head's peak; the measured peak stays within the predicted one."""
    lengths = [32] * STEPS
    make_model = functools.partial(llama, vocab=4096)
    measured = measurement_of(make_model, lengths)
    budget = checkpointed_peak(measured, 64)
    assert measured.layer_phase_peak_bytes < budget
    expected = run(checkpointed(make_model()), batches(lengths))
    model = checkpointed(make_model())
    handle = enable_activation_offload(model, memory_budget=budget, **HOST)
    actual, steps = metered_run(model, handle, batches(lengths),
                                lambda step: step > MEASURED_STEP)
    for step, (stats, peak) in enumerate(steps[MEASURED_STEP:], start=MEASURED_STEP + 1):
        assert stats["budget_offloading_layers"] == LAYERS - 3
        assert stats["budget_offloaded_output_bytes"] > 0
        assert stats["budget_resident_layers"] == 0
        assert peak <= stats["budget_predicted_allocated_bytes"], step
        assert stats["budget_predicted_allocated_bytes"] <= stats["budget_predicted_peak_bytes"]
    assert_identical(expected, actual)
    handle.disable()


@pytest.mark.parametrize("rate, share", [(None, budget_policy.COPY_WINDOW_SHARE),
                                         (None, 0.3), (2e9, budget_policy.COPY_WINDOW_SHARE),
                                         (0, budget_policy.COPY_WINDOW_SHARE)])
def test_the_plan_uses_the_budgets_copy_rate_and_window_share(rate, share):
    """The copy windows are sized with the budget's copy rate (None: the device's, measured
    on CUDA; the policy's figure without one; 0: nothing offloaded) and its window share;
    stats() report the rate the plan used."""
    lengths = [32] * STEPS
    make_model = functools.partial(llama, vocab=4096)
    budget = checkpointed_peak(measurement_of(make_model, lengths), 64)
    model = checkpointed(make_model())
    handle = enable_activation_offload(model, memory_budget=budget, **HOST)
    handle._budget.copy_bytes_per_second = rate
    handle._budget.copy_window_share = share
    run(model, batches(lengths), handle)
    used = budget_policy.HOST_COPY_BYTES_PER_SECOND if rate is None else rate
    config = handle.engine.config
    offload = OutputOffload.for_engine(
        used, config.keep_last, config.prefetch_depth, config.max_inflight_d2h_groups,
        config.min_offload_bytes, config.host_memory_limit_bytes(), share) if used else None
    measured = handle._budget.measurement
    assert handle._budget.latest_plan == plan_layers(measured, 64, budget, 0, offload)
    assert handle.budget_stats()["budget_copy_bytes_per_second"] == used
    if rate is None and share == budget_policy.COPY_WINDOW_SHARE:
        assert handle._budget.latest_plan.offloading_layers == LAYERS - 3
    if not used:
        assert handle._budget.latest_plan.offloaded_output_bytes == 0
    handle.disable()


@pytest.mark.parametrize("held_to_the_limit", [True, False])
def test_offloaded_outputs_are_held_to_the_host_memory_limit(monkeypatch, held_to_the_limit):
    """A host_memory_limit that holds the layers' inputs and half of what the copy windows
    would offload: the plan offloads within it, so the pool never refuses a block (one it
    refused would stay on the device, unplanned). Unheld, the pool refuses."""
    lengths = [32] * STEPS
    make_model = functools.partial(llama, vocab=4096)
    measured = measurement_of(make_model, lengths)
    budget = checkpointed_peak(measured, 64)
    expected = run(checkpointed(make_model()), batches(lengths))
    model = checkpointed(make_model())
    handle = enable_activation_offload(model, memory_budget=budget, **HOST)
    windows = plan_layers(measured, 64, budget, 0, handle._budget._output_offload())
    # The checkpointed step's pool holds the layers' inputs and the head's offloads.
    inputs = sum(layer.input_bytes_per_token for layer in measured.layers) * 64
    assert measured.host_peak_bytes > inputs
    assert windows.offloaded_output_bytes > 0 and windows.host_limited_bytes == 0
    limit = int((measured.host_peak_bytes + windows.offloaded_output_bytes / 2)
                * (1 + HOST_POOL_MARGIN))
    handle.disable()
    if not held_to_the_limit:
        monkeypatch.setattr(budget_policy, "_within_host",
                            lambda measured, tokens, chosen, offload: (chosen, 0.0))
    handle = enable_activation_offload(model, memory_budget=budget, host_memory_limit=limit,
                                       **HOST)
    actual, steps = metered_run(model, handle, batches(lengths), lambda step: False)
    assert_identical(expected, actual)
    stats = handle.stats()
    plan = steps[-1][0]
    if held_to_the_limit:
        assert 0 < plan["budget_offloaded_output_bytes"] <= windows.offloaded_output_bytes / 2
        assert plan["budget_host_limited_bytes"] >= windows.offloaded_output_bytes / 2
        assert stats["cap_fallbacks"] == 0
        assert stats["host_peak_bytes"] <= limit / (1 + HOST_POOL_MARGIN)
    else:
        assert plan["budget_offloaded_output_bytes"] == windows.offloaded_output_bytes
        assert stats["cap_fallbacks"] > 0
    assert stats["host_live_bytes"] == 0
    handle.disable()


@pytest.mark.parametrize("offloading", [False, True])
def test_a_step_that_offloads_outputs_prefetches_as_each_recompute_begins(offloading):
    """Without offloaded outputs a layer's backward prefetches the layer below once its MLP's
    backward is done (its peak); with them (larger groups) as its recompute begins."""
    model = checkpointed(llama())
    handle = enable_activation_offload(model, memory_budget="1TiB", **HOST)
    offloaded = frozenset({("aten.mm.default", 0)}) if offloading else frozenset()
    handle._budget._plans[(64, False)] = LayerPlan(
        tokens=64, budget_bytes=1 << 40, modes=(CHECKPOINT,) * LAYERS, predicted_peak_bytes=0,
        predicted_seconds_saved=0.0, checkpointed_peak_bytes=0,
        offloaded_outputs=(offloaded,) * LAYERS)
    events = recorded_prefetches(handle)
    def note_mlp_backward(module, inputs, output):  # the MLP's input gradient is ready
        if inputs[0].requires_grad:
            inputs[0].register_hook(lambda grad: events.append("mlp backward"))

    for layer in model.model.layers:
        layer.mlp.register_forward_hook(note_mlp_backward)
    model.train()
    for ids in batches([32] * 3):
        events.clear()
        model(input_ids=ids, labels=ids).loss.backward()
    first = ["mlp backward", "prefetch"] if not offloading else ["prefetch", "mlp backward"]
    assert events == first * LAYERS
    handle.disable()


class FusedLoss(torch.autograd.Function):
    """Cross-entropy of `hidden @ weight.T` whose gradients are computed in forward, as
    fused linear cross-entropy kernels do: its backward only scales them, so the loss
    restores nothing ahead of the layers below it."""

    @staticmethod
    def forward(ctx, hidden, weight, labels):
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])
        logits = (flat_hidden @ weight.t()).float()
        rows = torch.arange(logits.shape[0])
        loss = torch.nn.functional.cross_entropy(logits, labels.reshape(-1))
        grad_logits = logits.softmax(-1)
        grad_logits[rows, labels.reshape(-1)] -= 1
        grad_logits = (grad_logits / logits.shape[0]).to(hidden.dtype)
        ctx.save_for_backward((grad_logits @ weight).view_as(hidden),
                              grad_logits.t() @ flat_hidden)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("offloading", [False, True])
def test_resident_layers_over_a_fused_loss_prefetch_the_first_layer_below(offloading, dtype):
    """Under a fused loss, the lowest resident layer's backward prefetches the first
    checkpointed layer below it, so every restore of the step is issued ahead of need
    (nothing else would restore that layer before its recompute asks for it). The final
    norm's tensors stay on the device too (offload_head=False), as under Liger's loss on the
    GPU: their restore would prefetch the layers below. In float32 a layer's norm saves its
    input itself: a resident layer's stays on the device (only the checkpointed layers'
    groups are offloaded), where it would otherwise be restored once per node on demand."""
    model = checkpointed(llama().to(dtype))
    handle = enable_activation_offload(model, memory_budget="1TiB", offload_head=False,
                                       **HOST)
    offloaded = frozenset({("aten.mm.default", 0)}) if offloading else frozenset()
    below = LAYERS // 2
    handle._budget._plans[(64, False)] = LayerPlan(
        tokens=64, budget_bytes=1 << 40, modes=(CHECKPOINT,) * below + (RESIDENT,) * below,
        predicted_peak_bytes=0, predicted_seconds_saved=0.0, checkpointed_peak_bytes=0,
        offloaded_outputs=(offloaded,) * below + (frozenset(),) * below)
    events = recorded_prefetches(handle)
    model.train()
    for ids in batches([32] * 3):
        events.clear()
        hidden = model.model(input_ids=ids).last_hidden_state
        FusedLoss.apply(hidden, model.lm_head.weight, ids).backward()
    assert handle.layer_modes() == [CHECKPOINT] * below + [RESIDENT] * below
    stats = handle.stats()
    assert stats["head_offloaded_tensors"] == 0
    assert stats["restored_tensors"] == stats["offloaded_tensors"] >= below
    assert stats["prefetched_tensors"] == stats["restored_tensors"]
    assert events == ["prefetch"] * (below + 1)  # the lowest resident layer's, then each one's
    handle.disable()


def fused_loss(model, ids):
    hidden = model.model(input_ids=ids).last_hidden_state
    return FusedLoss.apply(hidden, model.lm_head.weight, ids)


def test_a_fused_loss_plan_counts_kept_bytes_where_the_step_peaks(monkeypatch):
    """Under a fused loss the head makes no logits and the step peaks in the layers'
    backward, where every resident layer but one is freed or in that peak already: the plan
    keeps more layers resident than counting each on top of the step's peak would, every
    planned step's peak stays within its predicted allocations, and losses and gradients
    are those of the same run without a budget."""
    keep_outputs_on_device(monkeypatch)
    ids_list = batches([32] * STEPS)
    runs = {}
    for name, budget in (("plain", None), ("all resident", "1TiB")):
        model = checkpointed(llama())
        handle = enable_activation_offload(model, memory_budget=budget, offload_head=False,
                                           **HOST)
        runs[name] = metered_run(model, handle, ids_list, lambda step: False,
                                 loss_of=fused_loss)[0]
        measured = handle._budget.measurement
        handle.disable()
    assert measured.head_phase_peak_bytes < measured.layer_phase_peak_bytes
    assert 0 < measured.head_rise_bytes < measured.layers[0].saved_bytes_per_token * 64
    assert measured.head_phase_peak_bytes == max(measured.forward_peak_bytes,
                                                 measured.head_peak_bytes)
    assert measured.head_peak_bytes > 0 and measured.forward_peak_bytes > 0
    budget = budget_for(measured, 64, 2)
    plan = plan_layers(measured, 64, budget)
    blind = plan_layers(dataclasses.replace(measured, layer_phase_peak_bytes=0,
                                            head_phase_peak_bytes=0, head_rise_bytes=0,
                                            forward_peak_bytes=0, head_peak_bytes=0),
                        64, budget)
    assert plan.count(RESIDENT) > blind.count(RESIDENT)

    model = checkpointed(llama())
    handle = enable_activation_offload(model, memory_budget=budget, offload_head=False, **HOST)
    plan_from(handle, measured)
    actual, steps = metered_run(model, handle, ids_list, lambda step: step > MEASURED_STEP,
                                loss_of=fused_loss)
    for step, (stats, peak) in enumerate(steps[MEASURED_STEP:], start=MEASURED_STEP + 1):
        assert stats["budget_resident_layers"] == plan.count(RESIDENT), step
        assert peak <= stats["budget_predicted_allocated_bytes"], step
    assert_identical(runs["plain"], actual)
    assert_identical(runs["plain"], runs["all resident"])
    handle.disable()


def test_a_dropped_step_frees_its_offloaded_outputs():
    """A forward whose loss is dropped (no backward): what its layers offloaded goes back to
    the pool by the next step."""
    lengths = [32] * 4
    model = checkpointed(llama())
    offloaded = frozenset(("aten.mm.default", i) for i in range(4))
    handle = enable_activation_offload(model, memory_budget="1TiB", **HOST)
    handle._budget._plans[(64, False)] = LayerPlan(
        tokens=64, budget_bytes=1 << 40, modes=(CHECKPOINT,) * LAYERS, predicted_peak_bytes=0,
        predicted_seconds_saved=0.0, checkpointed_peak_bytes=0,
        offloaded_outputs=(offloaded,) * LAYERS)
    model.train()
    ids_list = batches(lengths)
    for ids in ids_list[:2]:
        model(input_ids=ids, labels=ids).loss.backward()
    loss = model(input_ids=ids_list[2], labels=ids_list[2]).loss
    assert handle.stats()["host_live_bytes"] > 0
    del loss
    model(input_ids=ids_list[3], labels=ids_list[3]).loss.backward()
    assert handle.stats()["host_live_bytes"] == 0
    handle.disable()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_plans_are_bit_identical_in_every_model_family(family, monkeypatch):
    """Each family's layers are measured with kept-output candidates, and a plan with
    selective layers and one with resident layers train bit-identically to full
    checkpointing (attention dropout on: the RNG replays around kept ops and is drawn once
    by resident layers)."""
    keep_outputs_on_device(monkeypatch)
    layers = 4
    make_model = functools.partial(tiny_family, family, layers=layers, dropout=0.2)
    lengths = [32] * STEPS
    expected = run(checkpointed(make_model()), batches(lengths))
    measured = measurement_of(make_model, lengths)
    assert len(measured.layers) == layers
    assert all(layer.outputs for layer in measured.layers)
    for resident, selective in ((0, 2), (2, 0)):
        budget = budget_for(measured, 64, resident, selective)
        model = checkpointed(make_model())
        handle = enable_activation_offload(model, memory_budget=budget, **HOST)
        plan_from(handle, measured)
        actual = run(model, batches(lengths), handle)
        assert_identical(expected, actual)
        modes = handle.layer_modes()
        assert modes.count(RESIDENT) >= resident and modes.count(SELECTIVE) >= selective, modes
        handle.disable()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_offloaded_outputs_are_bit_identical_in_every_model_family(family):
    """Each family's layers offload every other measured candidate with their inputs and keep
    one more on the device (attention dropout on): losses and gradients are bit-identical
    to full checkpointing, the outputs pass through the engine, and the host pool is empty
    after every step."""
    layers = 4
    make_model = functools.partial(tiny_family, family, layers=layers, dropout=0.2)
    lengths = [32] * STEPS
    expected = run(checkpointed(make_model()), batches(lengths))
    measured = measurement_of(make_model, lengths)
    offloaded, kept = [], []
    for cost in measured.layers:
        keys = [output.key for output in cost.outputs]
        assert len(keys) >= 3, (family, keys)
        offloaded.append(frozenset(keys[0::2]))
        kept.append(frozenset(keys[1:2]))
    plan = LayerPlan(tokens=64, budget_bytes=1 << 40, modes=(SELECTIVE,) * layers,
                     predicted_peak_bytes=0, predicted_seconds_saved=0.0,
                     checkpointed_peak_bytes=0, kept_outputs=tuple(kept),
                     offloaded_outputs=tuple(offloaded))
    model = checkpointed(make_model())
    handle = enable_activation_offload(model, memory_budget="1TiB", **HOST)
    handle._budget._plans[(64, False)] = plan
    moved = []

    def after_step():
        stats = handle.stats()
        moved.append(stats["offloaded_tensors"])
        assert stats["host_live_bytes"] == 0

    actual = run(model, batches(lengths), handle, after_step=after_step)
    assert handle.layer_modes() == [SELECTIVE] * layers
    assert_identical(expected, actual)
    # From the planned steps on, each layer's offloaded outputs move with its input.
    offloaded_count = sum(len(keys) for keys in offloaded)
    assert all(m >= moved[0] + offloaded_count for m in moved[MEASURED_STEP:]), moved
    handle.disable()


def test_a_budget_with_resident_storage_offloads_plans_and_runs_them():
    """With resident layers' storage offloads turned on, a budget where they buy more
    resident layers plans them from the measured storages and runs them: bit-identical,
    the planned storages move, the measured peak within the prediction, the pool empty."""
    lengths = [32] * STEPS
    make_model = functools.partial(llama, vocab=4096)
    measured = measurement_of(make_model, lengths)
    offload_on = OutputOffload.for_engine(budget_policy.HOST_COPY_BYTES_PER_SECOND, 1, 1, 2, 0,
                                          resident_storages=True)
    layer = measured.layers[0].saved_bytes_per_token * 64
    budget = next(b for b in (int(checkpointed_peak(measured, 64) + k * layer / 4)
                              for k in range(40))
                  if plan_layers(measured, 64, b, 0, offload_on).resident_offloaded_bytes)
    planned = plan_layers(measured, 64, budget, 0, offload_on)
    off = dataclasses.replace(offload_on, resident_storages=False)
    assert planned.count(RESIDENT) > plan_layers(measured, 64, budget, 0, off).count(RESIDENT)
    expected = run(checkpointed(make_model()), batches(lengths))
    model = checkpointed(make_model())
    handle = enable_activation_offload(model, memory_budget=budget, **HOST)
    handle._budget.resident_storage_offload = True
    plan_from(handle, measured)
    actual, steps = metered_run(model, handle, batches(lengths),
                                lambda step: step > MEASURED_STEP)
    for step, (stats, peak) in enumerate(steps[MEASURED_STEP:], start=MEASURED_STEP + 1):
        assert stats["budget_resident_offloaded_bytes"] == planned.resident_offloaded_bytes
        assert stats["budget_resident_layers"] == planned.count(RESIDENT)
        assert stats["offloaded_bytes"] >= planned.resident_offloaded_bytes  # as forward ends
        assert peak <= stats["budget_predicted_peak_bytes"], step
    assert_identical(expected, actual)
    assert handle.stats()["host_live_bytes"] == 0
    handle.disable()


@pytest.mark.parametrize("family", FAMILIES)
def test_resident_layers_offload_saved_storages_bit_identically(family):
    """Every layer resident, each offloading every other of its own saved storages (dropout
    on): losses and gradients are bit-identical to full checkpointing, those storages pass
    through the engine, and the host pool is empty after every step."""
    layers = 4
    make_model = functools.partial(tiny_family, family, layers=layers, dropout=0.2)
    lengths = [32] * STEPS
    expected = run(checkpointed(make_model()), batches(lengths))
    model = checkpointed(make_model())
    handle = enable_activation_offload(model, memory_budget="1TiB", **HOST)
    measured, plans = [], []

    def plan_then(plan_for):
        def planned(measurement, tokens, changed):
            measured.append(measurement)
            chosen = []
            for cost in measurement.layers:
                own = [i for i, size in enumerate(cost.storages) if size > 0]
                assert len(own) >= 2, (family, cost.storages)
                chosen.append(frozenset(own[0::2]))
            plans.append(LayerPlan(
                tokens=tokens, budget_bytes=1 << 40, modes=(RESIDENT,) * layers,
                predicted_peak_bytes=0, predicted_seconds_saved=0.0, checkpointed_peak_bytes=0,
                resident_offloaded=tuple(chosen)))
            return plans[-1]
        return planned

    handle._budget._plan_for = plan_then(handle._budget._plan_for)
    moved, offered = [], []

    def after_step():
        stats = handle.stats()
        moved.append(stats["offloaded_bytes"])  # the head's are counted apart
        offered.append((stats["offloaded_tensors"], stats["restored_tensors"],
                        stats["prefetched_tensors"]))
        assert stats["host_live_bytes"] == 0

    actual = run(model, batches(lengths), handle, after_step=after_step)
    assert handle.layer_modes() == [RESIDENT] * layers
    # Every layer's offloaded storage came back once, prefetched: each resident layer's
    # first restore starts the layer below's (with prefetch deferred nothing else would),
    # and a storage several nodes saved keeps its restore for all of them.
    assert all(restored == prefetched == entries > 0
               for entries, restored, prefetched in offered[MEASURED_STEP:]), offered
    assert_identical(expected, actual)
    # From the planned steps on, the chosen storages move (the inputs too where saved).
    cost = measured[0].layers
    chosen_bytes = sum(cost[i].storages[o] * 64 for i in range(layers)
                       for o in plans[0].offloaded_storages(i))
    assert chosen_bytes > 0
    assert all(m >= chosen_bytes for m in moved[MEASURED_STEP:]), (moved, chosen_bytes)
    handle.disable()


@pytest.mark.skipif(LAYER_CALL_IS_CHECKPOINTED,
                    reason="FSDP2's hooks on a layer run inside its checkpoint here: no candidates")
def test_fsdp2_layers_measure_and_keep_outputs_bit_identically(tmp_path):
    """FSDP2 (one process, gloo through a file) where its hooks on a layer run before the
    layer's checkpoint: the measured step offers the unsharded model's candidates, and a
    plan that keeps the projections' outputs trains bit-identically to plain FSDP2."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    lengths = [32] * STEPS
    kept = frozenset(("aten.mm.default", i) for i in range(4))
    plan = LayerPlan(tokens=64, budget_bytes=1 << 40, modes=(SELECTIVE,) * LAYERS,
                     predicted_peak_bytes=0, predicted_seconds_saved=0.0,
                     checkpointed_peak_bytes=0, kept_outputs=(kept,) * LAYERS)
    unsharded = measurement_of(llama, lengths)

    def sharded_run(handle=None):
        model = checkpointed(llama())
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        if handle is not None:
            handle = enable_activation_offload(model, memory_budget="1TiB", **HOST)
            handle._budget._plans[(64, False)] = plan
        model.train()
        torch.manual_seed(11)
        losses, grads = [], []
        for ids in batches(lengths):
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach().clone())
            grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        return (losses, grads), handle

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0,
                            world_size=1)
    try:
        expected, _ = sharded_run()
        actual, handle = sharded_run(handle=True)
    finally:
        dist.destroy_process_group()
    assert_identical(expected, actual)
    assert handle.layer_modes() == [SELECTIVE] * LAYERS
    measured = handle._budget.measurement
    assert [len(c.outputs) for c in measured.layers] == [len(c.outputs) for c in unsharded.layers]
    assert all(c.outputs for c in measured.layers)
    handle.disable()


def test_kept_output_candidates_are_ops_whose_skipping_changes_nothing_but_time():
    """New outputs only: not a view of an input, not written in place later nor returned
    (the recompute would get the changed tensor), no random draws (the recompute replays
    them in order), no empty buffers, no higher-order ops; attention without dropout draws
    nothing."""
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 16, generator=generator), torch.randn(16, 16, generator=generator)
    # Needing gradients, attention saves its outputs for backward, as in a layer.
    q, k, v = (torch.randn(1, 2, 8, 8, generator=generator).requires_grad_()
               for _ in range(3))
    meter = layer_budget._OutputMeter(layer_budget._Timer(cuda=False))
    alive = []  # the layer's saved tensors, say: alive when its recompute ends
    with meter:
        a = x @ w
        b = a * 2
        a.add_(1)  # `a` changes after it was made: mm is no candidate
        alive.append(torch.nn.functional.dropout(b, 0.5, training=True))
        alive.append(b.view(-1))
        alive.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.0))
        alive.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.5))
        returned = x * 3
        alive.append(torch.empty_like(x))  # filled, if at all, where the meter does not see
        alive.append(torch.empty(4, 4))
        # A higher-order op runs under the meter (torch refuses one a mode does not take).
        flexed = flex_attention(q.detach(), k.detach(), v.detach())  # no CPU backward
        x.exp()  # freed before the end, no op read it: nothing tells who did
        alive.append(x.sin().cos())  # freed, but read by the next op: as it was made
    before = {output.key for output in meter.candidates(tokens=8)}
    meter.finish((returned, None))  # what the layer returns: changed after it
    keys = {output.key for output in meter.candidates(tokens=8)}
    last_mul = ("aten.mul.Tensor", meter.counts["aten.mul.Tensor"] - 1)
    assert {last_mul, ("aten.exp.default", 0)} <= before - keys
    assert ("aten.sin.default", 0) in keys and ("aten.cos.default", 0) in keys
    assert ("aten.mm.default", 0) not in keys
    assert ("aten.mul.Tensor", 0) in keys
    assert flexed.shape == q.shape
    assert not any("flex" in name for name, _ in keys), keys
    assert not any(name.startswith(("aten.view", "aten.bernoulli", "aten.native_dropout",
                                    "aten.empty"))
                   for name, _ in keys), keys
    attention = sorted(key for key in keys if "scaled_dot_product" in key[0])
    assert [ordinal for _, ordinal in attention] == [0], keys
    by_key = {output.key: output for output in meter.candidates(tokens=8)}
    assert by_key[("aten.mul.Tensor", 0)].bytes_per_token == 8 * 16 * 4 / 8


def test_an_op_the_meter_cannot_follow_leaves_the_step_alone(monkeypatch, caplog):
    """The meter's own bookkeeping failing on an op: the step runs as without it, the
    layers offer no kept outputs, and the log says which op (once)."""
    follows = layer_budget._draws_random_numbers

    def refusing(func, args, kwargs):
        if "silu" in str(func):
            raise RuntimeError("an op the meter cannot follow")
        return follows(func, args, kwargs)

    monkeypatch.setattr(layer_budget, "_draws_random_numbers", refusing)
    monkeypatch.setattr(layer_budget, "_UNMETERED_SAID", set())
    lengths = [32] * (MEASURED_STEP + 2)
    expected = run(checkpointed(llama()), batches(lengths))
    model = checkpointed(llama())
    handle = enable_activation_offload(model, memory_budget="1TiB", **HOST)
    with caplog.at_level(logging.WARNING, logger="ckpt_offload.hf"):
        actual = run(model, batches(lengths), handle)
    assert_identical(expected, actual)
    measured = handle._budget.measurement
    assert len(measured.layers) == LAYERS
    assert all(cost.outputs == () and cost.saved_bytes_per_token > 0
               for cost in measured.layers)
    said = [r.getMessage() for r in caplog.records if "could not meter" in r.getMessage()]
    assert len(said) == 1 and "aten.silu" in said[0], said
    assert handle.layer_modes() == [RESIDENT] * LAYERS


def test_steps_before_the_plan_checkpoint_every_layer():
    model = checkpointed(llama())
    handle = enable_activation_offload(model, memory_budget="1TiB", **HOST)
    run(model, batches([32] * MEASURED_STEP), handle)
    assert handle.layer_modes() is None
    assert handle.stats()["groups"] == LAYERS
    run(model, batches([32]), handle)
    assert handle.layer_modes() == [RESIDENT] * LAYERS
    assert handle.stats()["budget_resident_layers"] == LAYERS
    handle.disable()


def test_lora_plans_are_bit_identical(monkeypatch):
    keep_outputs_on_device(monkeypatch)
    def make_model():
        return tiny_lora(tiny_llama(layers=4))

    lengths = [32] * STEPS
    measured = measurement_of(make_model, lengths)
    budget = budget_for(measured, 64, 2)
    expected = run(checkpointed(make_model()), batches(lengths))
    model = checkpointed(make_model())
    handle = enable_activation_offload(model, memory_budget=budget, **HOST)
    plan_from(handle, measured)
    actual = run(model, batches(lengths), handle)
    assert_identical(expected, actual)
    modes = handle.layer_modes()
    assert modes == list(plan_layers(measured, 64, budget).modes)
    assert modes[2:] == [RESIDENT, RESIDENT] and RESIDENT not in modes[:2]
    handle.disable()


def test_each_new_length_is_measured_and_shorter_ones_planned_from_a_longer_one(monkeypatch):
    """Lengths vary (as with packing): a step longer than every one measured so far is
    measured (every layer checkpointed); any other is planned from the shortest measured
    step at least as long, with room kept for its largest block when its length differs
    from the previous step's. Where anything is kept, the predicted peak and that room
    never exceed the budget; the predicted allocations bound the planned step's measured
    peak."""
    keep_outputs_on_device(monkeypatch)
    lengths = [32, 32, 32, 64, 64, 96, 32, 96, 128, 64, 48]
    measuring_steps = {2, 4, 6, 9}
    measured = measurement_of(llama, [32] * 3)
    budget = budget_for(measured, 64, 4)
    expected = run(checkpointed(llama()), batches(lengths))

    model = checkpointed(llama())
    handle = enable_activation_offload(model, memory_budget=budget, **HOST)
    ids_list = batches(lengths)
    actual, steps = metered_run(model, handle, ids_list,
                                lambda step: step > 1 and step not in measuring_steps)
    resident = {}
    for step, ((stats, peak), ids) in enumerate(zip(steps, ids_list), start=1):
        planned = peak is not None
        assert stats["budget_measuring"] == int(step in measuring_steps), step
        if planned:
            changed = lengths[step - 1] != lengths[step - 2]
            assert stats["budget_tokens"] == ids.numel()
            assert (stats["budget_reserve_bytes"] > 0) == changed, step
            kept = stats["budget_resident_layers"] + stats["budget_selective_layers"]
            # Nothing is kept where the checkpointed step and the reserve alone are over.
            assert (not kept or stats["budget_predicted_peak_bytes"]
                    + stats["budget_reserve_bytes"] <= budget), step
            assert peak <= stats["budget_predicted_allocated_bytes"], step
            resident[(ids.shape[1], changed)] = stats["budget_resident_layers"]
    assert_identical(expected, actual)
    assert sorted(handle._budget.measurements) == [64, 128, 192, 256]
    assert resident[(32, False)] == 4
    assert resident[(32, True)] < resident[(32, False)]
    after_a_change = [resident[(n, True)] for n in (32, 48, 64, 96)]
    assert after_a_change == sorted(after_a_change, reverse=True), resident
    handle.disable()


def test_planned_token_counts_are_rounded_up_to_a_few_per_doubling():
    """A step is planned for its tokens rounded up to PLAN_TOKEN_BITS significant bits: never
    fewer tokens, at most 1/128 more, exact for powers of two and multiples of 256 below
    32k, and at most 128 counts per doubling of length."""
    planned = layer_budget.planned_tokens
    counts = range(1, 70000)
    assert all(t <= planned(t) <= t * (1 + 1 / 128) for t in counts)
    assert all(planned(t) == t for t in range(256, 32768, 256))
    assert all(planned(1 << k) == 1 << k for k in range(20))
    assert all(planned(planned(t)) == planned(t) for t in counts)
    assert len({planned(t) for t in range(4097, 8193)}) == 128
    assert len({planned(t) for t in range(1, 256)}) == 255  # short steps plan exactly


def test_steps_whose_lengths_all_differ_share_a_few_plans(monkeypatch):
    """Lengths that differ at every step (dynamic padding): steps whose token counts round
    to the same planned count share one plan, made for that count (a few tokens more: never
    less room); losses and gradients stay bit-identical to full checkpointing."""
    keep_outputs_on_device(monkeypatch)
    lengths = [264, 264] + list(range(257, 264))  # 528 tokens measured, then 514 ... 526
    expected = run(checkpointed(llama()), batches(lengths))
    model = checkpointed(llama())
    handle = enable_activation_offload(model, memory_budget="1TiB", **HOST)
    actual, steps = metered_run(model, handle, batches(lengths), lambda step: False)
    assert_identical(expected, actual)
    planned = [stats["budget_tokens"] for stats, _ in steps[2:]]
    assert planned == [516, 516, 520, 520, 524, 524, 528]
    assert sorted(handle._budget._plans) == [(516, True), (520, True), (524, True),
                                             (528, True)]
    handle.disable()


@pytest.mark.parametrize("ratio", [None, 2])
def test_a_step_far_shorter_than_every_measured_one_is_measured_itself(monkeypatch, ratio):
    """With a measured-length ratio (off by default), a step more than that many times
    shorter than every measured one is measured (its peak, far below the longer step's,
    would otherwise be planned as that one's), and a step within the ratio of a measurement
    is planned from it. Without one, every shorter step is planned from the longer step."""
    keep_outputs_on_device(monkeypatch)
    lengths = [64, 64, 64, 24, 24, 40]  # tokens: 128, 128, 128, 48, 48, 80
    long = measurement_of(llama, [64] * 3)
    budget = budget_for(long, 128, 2)
    expected = run(checkpointed(llama()), batches(lengths))

    model = checkpointed(llama())
    handle = enable_activation_offload(model, memory_budget=budget, **HOST)
    assert handle._budget.measured_length_ratio is None
    handle._budget.measured_length_ratio = ratio
    plan_from(handle, long)
    actual, steps = metered_run(model, handle, batches(lengths), lambda step: False)
    assert_identical(expected, actual)
    measuring = [stats["budget_measuring"] for stats, _ in steps]
    if ratio is None:
        assert measuring == [0] * 6 and sorted(handle._budget.measurements) == [128]
        assert steps[4][0]["budget_resident_layers"] == plan_layers(long, 48, budget).count(
            RESIDENT)
        handle.disable()
        return
    assert measuring == [0, 0, 0, 1, 0, 0]
    assert sorted(handle._budget.measurements) == [48, 128]
    short = handle._budget.measurements[48]
    assert short.peak_bytes < long.peak_bytes
    # The short step's plan comes from its own measurement, and spends the memory the long
    # step's peak would have taken.
    stats = steps[4][0]
    assert stats["budget_tokens"] == 48
    from_short = plan_layers(short, 48, budget)
    assert stats["budget_resident_layers"] == from_short.count(RESIDENT)
    assert from_short.count(RESIDENT) > plan_layers(long, 48, budget).count(RESIDENT)
    assert steps[5][0]["budget_tokens"] == 80  # planned from the 128-token measurement
    handle.disable()


def test_the_measured_steps_stranded_pieces_count_in_its_peak(monkeypatch):
    """What the allocator's meter reads as stranded when the measured step's head begins
    (free pieces no fresh logits block can use) is part of the checkpointed step's reserved
    peak that every plan is built on."""
    stranded = 3 << 20
    monkeypatch.setattr(LiveTensorMeter, "stranded", lambda self: stranded)
    measured = measurement_of(llama, [32] * 3)
    assert measured.stranded_bytes == stranded
    assert checkpointed_peak(measured, 64) == measured.peak_bytes + stranded
    assert checkpointed_peak(measured, 128) > measured.peak_bytes + 2 * stranded


def test_stats_report_the_stranded_pieces_of_the_plans_own_measurement(monkeypatch):
    """budget_stranded_bytes is the figure of the measurement the running plan came from:
    a longer step is measured anew, and each length plans from the shortest measured step
    that covers it."""
    reading = [1 << 20]  # what the meter reads; it changes before the second measurement
    monkeypatch.setattr(LiveTensorMeter, "stranded", lambda self: reading[0])
    model = checkpointed(llama())
    handle = enable_activation_offload(model, memory_budget="1TiB", **HOST)
    assert handle.budget_stats()["budget_stranded_bytes"] == 0  # no plan yet
    stranded = []
    for ids in batches([32, 32, 32, 64, 64, 32]):
        reading[0] = (5 << 20) if ids.shape[1] == 64 else (1 << 20)
        run(model, [ids], handle)
        stranded.append(handle.budget_stats()["budget_stranded_bytes"])
    # Steps 1-2: no plan; 3: planned from the 32-token measurement; 4: 64 tokens measured
    # (the stats keep step 3's plan); 5: planned from the 64-token one; 6: the 32-token one.
    assert stranded == [0, 0, 1 << 20, 1 << 20, 5 << 20, 1 << 20]
    handle.disable()


class SteppedClock:
    """The wall clock of a test: each reading 1 us after the one before, plus the seconds
    the test adds between steps."""

    def __init__(self):
        self.seconds = 0.0
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        return self.seconds + self.readings * 1e-6


def timed_steps(monkeypatch, model, handle, seconds, between=0.0):
    """One step of 32 tokens per entry of `seconds`, the clock moved on by it inside the
    step's forward (as the final norm runs) and by `between` after its backward (what an
    optimizer step or a generation would take); stats() after each step."""
    clock = SteppedClock()
    monkeypatch.setattr(layer_budget, "_clock", clock)
    seconds = iter(seconds)

    def forward_takes(module, args, output):
        if torch.is_grad_enabled():
            clock.seconds += next(seconds)

    hook = model.model.norm.register_forward_hook(forward_takes)
    stats = []
    try:
        while True:
            try:
                run(model, batches([32]), handle)
            except StopIteration:
                return stats
            clock.seconds += between
            stats.append(handle.stats())
    finally:
        hook.remove()


def test_stats_report_the_plans_predicted_and_measured_step_times(monkeypatch):
    """The measured step's time, from its forward's start to its backward's end (not what
    runs between steps), is the checkpointed step's; a plan's predicted time is that less
    the recompute it saves; its measured time is the median of its latest steps (one slow
    step does not move it)."""
    model = checkpointed(llama())
    handle = enable_activation_offload(model, memory_budget="1TiB", **HOST)
    # Steps 1-2 run checkpointed (2 is measured); step 5 is slow.
    stats = timed_steps(monkeypatch, model, handle, [1.0, 2.0, 1.5, 1.5, 9.0, 1.5, 1.5],
                        between=30.0)
    assert [s["budget_measured_steps"] for s in stats] == [0, 0, 1, 2, 3, 4, 5]
    last = stats[-1]
    assert last["budget_resident_layers"] == LAYERS
    # The measured step: 2 s and the clock's readings in it (1 us each).
    assert 2000 < last["budget_checkpointed_step_ms"] < 2010
    assert last["budget_predicted_saved_ms"] > 0
    assert last["budget_predicted_step_ms"] == pytest.approx(
        last["budget_checkpointed_step_ms"] - last["budget_predicted_saved_ms"])
    medians = [s["budget_measured_step_ms"] for s in stats[2:]]
    assert medians == pytest.approx([1500, 1500, 1500, 1500, 1500], abs=0.1)
    handle.disable()


class FakeEvent:
    """torch.cuda.Event's timing surface on a test clock: complete once `done` is set (or
    waited for)."""

    clock = 0.0
    made: list = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.time, self.done, self.waited = None, False, False
        FakeEvent.made.append(self)

    def record(self):
        self.time = FakeEvent.clock

    def query(self):
        return self.done

    def synchronize(self):
        self.done = self.waited = True

    def elapsed_time(self, end):
        assert end.done  # and so the start, recorded before it on the stream
        return (end.time - self.time) * 1e3


def test_cuda_step_times_are_read_once_their_events_complete(monkeypatch):
    """On CUDA a step's time is read from its events once they completed: stats never wait
    for the device; only the measured step's time, read as the plan is made, does. A step
    whose backward never ran is not timed."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(FakeEvent, "made", [])
    times = layer_budget._StepTimes()
    x = torch.ones(2, requires_grad=True)

    def step(label, seconds, backward=True):
        times.begin(True, label)
        y = x * 2
        times.watch(y)
        FakeEvent.clock += seconds
        if backward:
            y.sum().backward()

    step("plan", 1.0)
    step("plan", 3.0)
    step("plan", 7.0, backward=False)  # abandoned
    assert times.median("plan") == (0.0, 0)  # recorded, not complete: not waited for
    assert not any(event.waited for event in FakeEvent.made)
    for event in FakeEvent.made:
        event.done = True
    assert times.median("plan") == (2.0, 2)
    step("measured", 5.0)
    assert times.latest("measured") == 5.0 and FakeEvent.made[-1].waited


@pytest.mark.parametrize("plan_seconds", [2.0, 2.2])
def test_a_plan_slower_than_the_checkpointed_step_is_said_once(monkeypatch, caplog, plan_seconds):
    """Where step times are the device's (here: a test's clock), a plan whose steps take
    more than SLOW_PLAN_SHARE over the checkpointed step's time is said once, as a warning,
    once SLOW_PLAN_STEPS of them were timed; a plan as fast is not."""
    monkeypatch.setattr(layer_budget, "PACE_CHECKED_ON_CPU", True)
    model = checkpointed(llama())
    handle = enable_activation_offload(model, memory_budget="1TiB", **HOST)
    with caplog.at_level(logging.INFO, logger="ckpt_offload.hf"):
        timed_steps(monkeypatch, model, handle, [1.0, 2.0] + [plan_seconds] * 8, between=5.0)
    slow = [r for r in caplog.records if "the plan's steps take" in r.getMessage()]
    assert handle.stats()["budget_measured_step_ms"] == pytest.approx(plan_seconds * 1e3,
                                                                      abs=0.1)
    if plan_seconds <= 2.0 * (1 + layer_budget.SLOW_PLAN_SHARE):
        assert slow == []
    else:
        assert len(slow) == 1 and slow[0].levelno == logging.WARNING
        assert "memory_budget=None" in slow[0].getMessage()
    handle.disable()


class RunsOutOfMemory:
    """A forward hook on a model's final norm that, in the training forwards `steps` (counted
    from 1), reports an out-of-memory error to the budgets as the CUDA allocator does and
    raises it."""

    def __init__(self, model, steps):
        self.steps, self.forwards = set(steps), 0
        self.hook = model.model.norm.register_forward_hook(self)

    def __call__(self, module, args, output):
        if not (torch.is_grad_enabled() and module.training):
            return
        self.forwards += 1
        if self.forwards in self.steps:
            layer_budget._on_out_of_memory(0, 1 << 30, 0, 0)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")


def test_running_out_of_memory_under_a_plan_halves_what_later_plans_keep(monkeypatch, caplog):
    """Each out-of-memory error while a plan that keeps anything runs drops that step and
    halves what later plans keep above the checkpointed step, said as a warning; below
    BACK_OFF_FLOOR nothing is kept, and an error under that plan changes nothing. The steps
    that ran stay bit-identical to full checkpointing, and a disabled handle's budget is no
    longer told."""
    keep_outputs_on_device(monkeypatch)
    monkeypatch.setattr(layer_budget, "_LIVE_BUDGETS", weakref.WeakSet())
    measured = measurement_of(llama, [32] * 3)
    budget = budget_for(measured, 64, LAYERS)  # every layer resident, just
    lengths, failing = [32] * 12, {3, 5, 7, 9, 11}
    ids_list = batches(lengths)
    ran = [ids for step, ids in enumerate(ids_list, start=1) if step not in failing]
    expected = run(checkpointed(llama()), ran)

    model = checkpointed(llama())
    handle = enable_activation_offload(model, memory_budget=budget, **HOST)
    plan_from(handle, measured)
    oom = RunsOutOfMemory(model, failing)
    model.train()
    torch.manual_seed(11)
    losses, grads, kept, shares = [], [], [], []
    with caplog.at_level(logging.WARNING, logger="ckpt_offload.hf"):
        for ids in ids_list:
            model.zero_grad(set_to_none=True)
            try:
                loss = model(input_ids=ids, labels=ids).loss
            except torch.OutOfMemoryError:
                continue
            loss.backward()
            losses.append(loss.detach().clone())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                          if p.grad is not None})
            stats = handle.stats()
            if stats["budget_tokens"]:  # planned (the first step is not)
                kept.append((stats["budget_predicted_allocated_bytes"],
                             stats["budget_resident_layers"],
                             LAYERS - stats["budget_checkpointed_layers"]))
                shares.append(stats["budget_kept_share"])
    oom.hook.remove()
    assert_identical(expected, (losses, grads))
    # Planned steps 2, 4, 6, 8, 10, 12; errors in 3, 5, 7, 9 back off, 11's (nothing kept)
    # does not.
    warnings = [r.getMessage() for r in caplog.records if "out of memory" in r.getMessage()]
    assert len(warnings) == 4 and all("memory_budget below" in m for m in warnings)
    assert shares == [1.0, 0.5, 0.25, 0.125, 0.0, 0.0]
    # What plans allocate falls with each back-off, to the checkpointed step's.
    allocated, resident, not_checkpointed = zip(*kept)
    assert all(a > b for a, b in zip(allocated[:5], allocated[1:5]))
    assert resident[0] == LAYERS and resident[1] < LAYERS
    assert not_checkpointed[-2:] == (0, 0)
    assert allocated[-1] == checkpointed_allocated_peak(measured, 64)
    handle.disable()
    assert list(layer_budget._LIVE_BUDGETS) == []


def test_running_out_of_memory_between_steps_changes_no_plan(monkeypatch, caplog):
    """An out-of-memory error after a planned step's backward (an evaluation, the optimizer:
    what the plan kept is freed by then) is not laid at the plan."""
    monkeypatch.setattr(layer_budget, "_LIVE_BUDGETS", weakref.WeakSet())
    model = checkpointed(llama())
    handle = enable_activation_offload(model, memory_budget="1TiB", **HOST)
    with caplog.at_level(logging.WARNING, logger="ckpt_offload.hf"):
        run(model, batches([32] * 4), handle,
            after_step=lambda: layer_budget._on_out_of_memory(0, 1 << 30, 0, 0))
    assert handle.stats()["budget_resident_layers"] == LAYERS
    assert handle.budget_kept_share == 1.0
    assert not [r for r in caplog.records if "out of memory" in r.getMessage()]
    handle.disable()


def test_a_trainer_retrying_after_running_out_of_memory_keeps_the_back_off(
        tmp_path, monkeypatch, caplog):
    """auto_find_batch_size: the Trainer retries with half the batch after an out-of-memory
    error; the callback's new installation keeps the budget's back-off."""
    monkeypatch.setattr(layer_budget, "_LIVE_BUDGETS", weakref.WeakSet())
    model = tiny_llama()
    callback = ActivationOffloadCallback(memory_budget="1TiB", **HOST)
    oom = RunsOutOfMemory(model, {4})  # the second planned step
    with caplog.at_level(logging.WARNING, logger="ckpt_offload.hf"):
        trainer, losses = train(model, tmp_path, callbacks=[callback], max_steps=6,
                                auto_find_batch_size=True)
    oom.hook.remove()
    assert oom.forwards > 6  # the retry ran its own steps
    assert trainer._train_batch_size == 1
    warnings = [r for r in caplog.records if "out of memory" in r.getMessage()]
    assert len(warnings) == 1
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logs[-1]["offload/budget_kept_share"] == 0.5
    assert callback.handle is None  # uninstalled at the end, as always


def test_layers_the_model_does_not_checkpoint_stay_so(caplog):
    model = checkpointed(llama())
    layers = model.model.layers
    layers[0].gradient_checkpointing = False  # the user's own choice (as every_n_layers does)
    expected_model = checkpointed(llama())
    expected_model.model.layers[0].gradient_checkpointing = False
    lengths = [32] * STEPS
    expected = run(expected_model, batches(lengths))
    handle = enable_activation_offload(model, memory_budget=1, **HOST)
    with caplog.at_level(logging.INFO, logger="ckpt_offload.hf"):
        actual = run(model, batches(lengths), handle)
    assert_identical(expected, actual)
    notes = [r.getMessage() for r in caplog.records if "model's own settings" in r.getMessage()]
    assert len(notes) == 1 and "1 of 6 layers" in notes[0]
    # A budget of one byte is below what the step needs: every layer stays checkpointed.
    assert handle.layer_modes() == [CHECKPOINT] * LAYERS
    assert any("below what the step needs" in r.getMessage() for r in caplog.records)
    assert layers[0].gradient_checkpointing is False
    handle.disable()
    assert layers[0].gradient_checkpointing is False


def test_the_measurement_counts_a_layers_own_saved_bytes():
    """Every layer saves the same tensors; parameters and storages that every layer saves
    (the rotary tables, the mask) are not a layer's own."""
    measured = measurement_of(llama, [32] * 3)
    per_token = {cost.saved_bytes_per_token for cost in measured.layers}
    assert len(per_token) == 1
    hidden, heads, ffn = 64, 4, 128
    # At least the layer's input, the attention probabilities (eager: heads x seq per token),
    # the MLP's gate and up outputs, as float32.
    lower = 4 * (hidden + heads * 32 + 2 * ffn)
    assert per_token.pop() >= lower
    assert all(cost.recompute_seconds_per_token > 0 for cost in measured.layers)
    assert measured.tokens == 64


def test_trainer_with_a_budget_logs_the_plan_and_trains_bit_identically(tmp_path, caplog):
    plain = tiny_llama()
    _, plain_losses = train(plain, tmp_path / "plain", max_steps=5)
    model = tiny_llama()
    callback = ActivationOffloadCallback(memory_budget="1TiB", **HOST)
    with caplog.at_level(logging.INFO, logger="ckpt_offload.hf"):
        trainer, losses = train(model, tmp_path / "budget", callbacks=[callback], max_steps=5)
    assert losses == plain_losses
    assert_same_weights(plain, model)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logs[-1]["offload/budget_resident_layers"] == 4
    assert logs[0]["offload/budget_resident_layers"] == 0
    assert logs[-1]["offload/budget_predicted_peak_gib"] > 0
    assert logs[-1]["offload/budget_predicted_step_ms"] > 0
    assert logs[-1]["offload/budget_measured_step_ms"] > 0
    assert logs[-1]["offload/budget_checkpointed_step_ms"] >= logs[-1][
        "offload/budget_predicted_step_ms"]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("4 of 4 layers without checkpointing" in m for m in messages) == 1


def test_bad_budgets_are_refused_naming_the_field():
    model = checkpointed(llama(layers=2))
    for value in ("lots", -1, 0, 1.5, True, [1]):
        with pytest.raises(ValueError, match="memory_budget"):
            enable_activation_offload(model, memory_budget=value, **HOST)
    with pytest.raises(ValueError, match="offload_memory_budget"):
        from ckpt_offload.hf import OffloadArguments
        OffloadArguments(activation_offloading=True, offload_memory_budget="lots")
