"""torch.compile with ckpt_offload (CPU, inductor, host backend): the model is compiled region
by region, dynamo sees no graph break, and losses and gradients are bit-identical to the
same regional compile without offload."""

import copy
import logging

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import ckpt_offload.hf.compile as hf_compile
from ckpt_offload.hf import (ActivationOffloadCallback, compile_regions,
                             enable_activation_offload)
from ckpt_offload.hf.compile import CompiledLoss
from tiny import (HOST, Probe, assert_same_weights, tiny_family, tiny_llama, tiny_lora,
                  train)

LAYERS = 4
# Compiled modules per checkpointed layer: the layer, or where transformers checkpoints from
# inside the layer's call, its parts that hold weights (attention, MLP and two norms).
PER_LAYER = 1 if hf_compile.LAYER_CALL_IS_CHECKPOINTED else 4


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test traces from scratch, so that graph breaks are seen, and says its notices."""
    torch._dynamo.reset()
    counters.clear()
    hf_compile._told.clear()
    yield
    torch._dynamo.reset()


def graph_breaks():
    return sum(counters["graph_break"].values())


def compiled_modules(model):
    return [name for name, m in model.named_modules() if m._compiled_call_impl is not None]


def loss_and_grads(model, call, ids):
    model.zero_grad(set_to_none=True)
    loss = call(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def assert_same(a, b):
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys() and a[1]
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


class RegionsProbe(Probe):
    """Records, at each step's end, which modules the offload installation compiled."""

    def __init__(self, offload_callback):
        super().__init__(offload_callback)
        self.regions = []

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        regions = self.offload_callback.handle.regions
        self.regions.append(len(regions.modules) if regions is not None else 0)


def test_trainer_torch_compile_is_regional_without_graph_breaks_and_bit_identical(tmp_path):
    model = tiny_lora(tiny_llama(tied=True))
    callback = ActivationOffloadCallback(keep_last=1, **HOST)
    probe = RegionsProbe(callback)
    trainer, losses = train(model, tmp_path / "offload", callbacks=[callback], probe=probe,
                            torch_compile=True)

    assert graph_breaks() == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 2  # a layer region and the loss at least
    # Every step: 4 layers (or their parts) and the final norm compiled, every layer input
    # offloaded.
    assert probe.regions == [LAYERS * PER_LAYER + 1] * 4
    assert [t["offloaded_tensors"] for t in probe.step_totals] == [4, 8, 12, 16]
    # Uninstalled at the end: nothing of the regional compile is left on the model.
    assert compiled_modules(model) == []
    assert all("_loss_function" not in m.__dict__ for m in model.modules())

    # The same regional compile without offload (and without the Trainer's compile).
    reference = tiny_lora(tiny_llama(tied=True))
    regions = compile_regions(reference)
    _, reference_losses = train(reference, tmp_path / "reference")
    regions.remove()
    assert losses == reference_losses and len(losses) == 4
    assert_same_weights(reference, model)


def test_torch_compile_of_an_offloaded_model_compiles_its_regions_and_says_so(caplog):
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    handle = enable_activation_offload(model, keep_last=1, **HOST)
    compiled = torch.compile(model)
    ids = torch.randint(3, 128, (2, 32), generator=torch.Generator().manual_seed(5))
    with caplog.at_level(logging.WARNING, logger="ckpt_offload.hf"):
        steps = [loss_and_grads(model, compiled, ids) for _ in range(2)]
    notices = [r.message for r in caplog.records if "region by region" in r.message]
    assert len(notices) == 1 and "4 checkpointed layers" in notices[0]
    assert graph_breaks() == 0, dict(counters["graph_break"])
    assert len(compiled_modules(model)) == LAYERS * PER_LAYER + 1
    assert isinstance(model.__dict__["_loss_function"], CompiledLoss)
    assert handle.stats()["offloaded_tensors"] == LAYERS
    handle.disable()
    assert compiled_modules(model) == [] and "_loss_function" not in model.__dict__

    reference = tiny_llama()
    reference.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False})
    reference.train()
    compile_regions(reference)
    for step in steps:
        assert_same(step, loss_and_grads(reference, reference, ids))


@pytest.mark.parametrize("family", ["cohere", "gemma3", "qwen3_moe"])
def test_torch_compile_of_other_families_is_regional_and_bit_identical(family):
    """Layer layouts unlike Llama's (parallel attention and MLP, four norms per layer,
    mixture-of-experts) compile region by region without a graph break, bit-identical to
    the same regional compile without offload."""
    ids = torch.randint(3, 128, (2, 32), generator=torch.Generator().manual_seed(5))

    def checkpointed():
        model = tiny_family(family, layers=LAYERS)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        return model

    reference = checkpointed()
    compile_regions(reference)
    expected = [loss_and_grads(reference, reference, ids) for _ in range(2)]
    torch._dynamo.reset()
    counters.clear()

    model = checkpointed()
    handle = enable_activation_offload(model, keep_last=1, **HOST)
    compiled = torch.compile(model)
    for step in expected:
        assert_same(loss_and_grads(model, compiled, ids), step)
    if family != "qwen3_moe":
        # Some transformers versions route experts through an op inductor cannot compile on
        # CPU in float32 (data-dependent group sizes): that part of the region runs eagerly,
        # with or without offload. Dense layers compile whole.
        assert graph_breaks() == 0, dict(counters["graph_break"])
    assert handle.stats()["offloaded_tensors"] == LAYERS
    handle.disable()


def test_compile_option_leaves_user_compiled_modules_and_copies_alone():
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    model.model.layers[0].compile()  # the user's own
    own = model.model.layers[0]._compiled_call_impl
    handle = enable_activation_offload(model, compile={"dynamic": False}, **HOST)
    # 3 layers (or their parts) and the norm; layer 0 was theirs.
    assert len(handle.regions.modules) == (LAYERS - 1) * PER_LAYER + 1
    assert handle.regions.layer_count == LAYERS - 1
    assert handle.regions.options == {"dynamic": False}

    copied = copy.deepcopy(model)
    assert compiled_modules(copied) == []  # torch drops compiled calls from copies
    assert copied.__dict__["_loss_function"] is model.__dict__["_loss_function"].function

    ids = torch.randint(3, 128, (2, 32), generator=torch.Generator().manual_seed(5))
    model(input_ids=ids, labels=ids).loss.backward()
    handle.disable()
    assert compiled_modules(model) == ["model.layers.0"]
    assert model.model.layers[0]._compiled_call_impl is own


@pytest.mark.parametrize("value", ["yes", 1, ["inductor"]])
def test_bad_compile_value_names_the_field(value):
    model = tiny_llama()
    with pytest.raises(ValueError, match="^compile: "):
        enable_activation_offload(model, compile=value, **HOST)
    assert compiled_modules(model) == []


@pytest.mark.parametrize("mode,kept", [("reduce-overhead", "default"),
                                       ("max-autotune", "max-autotune-no-cudagraphs")])
def test_cuda_graph_modes_are_left_out_and_said_once(caplog, mode, kept):
    with caplog.at_level(logging.WARNING, logger="ckpt_offload.hf"):
        first = compile_regions(tiny_llama(), mode=mode)
        second = compile_regions(tiny_llama(), mode=mode)
    assert first.options == second.options == {"mode": kept}
    notices = [r.message for r in caplog.records if "without CUDA graphs" in r.message]
    assert len(notices) == 1
    first.remove()
    second.remove()


def test_memory_budget_plans_under_regional_compile_are_bit_identical():
    """compile=True with a memory budget: the plan runs the compiled layers (resident ones
    directly, their recomputes measured in step 2) without a graph break, bit-identical to
    the same regional compile without offload, with every layer resident and with some."""
    ids = torch.randint(3, 128, (2, 32), generator=torch.Generator().manual_seed(5))

    def checkpointed():
        model = tiny_llama()
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        return model

    reference = checkpointed()
    compile_regions(reference)
    expected = [loss_and_grads(reference, reference, ids) for _ in range(4)]

    model = checkpointed()
    handle = enable_activation_offload(model, compile=True, memory_budget="1TiB", **HOST)
    for step in expected:
        assert_same(loss_and_grads(model, model, ids), step)
    assert handle.layer_modes() == ["resident"] * LAYERS
    measured = handle._budget.measurement
    handle.disable()

    layer = max(c.saved_bytes_per_token for c in measured.layers) * measured.tokens
    model = checkpointed()
    handle = enable_activation_offload(model, compile=True, **HOST,
                                       memory_budget=int(measured.peak_bytes + 2.5 * layer))
    for step in expected:
        assert_same(loss_and_grads(model, model, ids), step)
    assert handle.layer_modes() == ["checkpoint"] * (LAYERS - 2) + ["resident"] * 2
    assert graph_breaks() == 0, dict(counters["graph_break"])
    handle.disable()
