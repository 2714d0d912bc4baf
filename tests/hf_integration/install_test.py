"""enable_activation_offload on models in custom loops: bit-exact gradients, what gets tagged,
wrappers (DDP, accelerate), and misuse that must leave the model untouched."""

import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import ckpt_offload
from ckpt_offload.hf import enable_activation_offload
from ckpt_offload.hf.install import installations
from tiny import HOST, VOCAB, checkpoint_funcs, tiny_llama

LAYERS = 4


def batch(seed=5, size=2, seq=24):
    ids = torch.randint(3, VOCAB, (size, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def train_steps(model, steps=3, call=None):
    """A few AdamW steps; returns (losses, final parameters)."""
    call = call or model
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for step in range(steps):
        loss = call(**batch(seed=step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def checkpointed_llama(**kwargs):
    model = tiny_llama(**kwargs)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def assert_same(reference, got):
    ref_losses, ref_params = reference
    losses, params = got
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert ref_params.keys() == params.keys()
    for name in ref_params:
        assert torch.equal(ref_params[name], params[name]), name


def model_state(model):
    """What an installation may touch: forward and each module's checkpointing attributes."""
    return (model.__dict__.get("forward"), checkpoint_funcs(model),
            {n: m.__dict__.get("gradient_checkpointing") for n, m in model.named_modules()})


def test_custom_loop_bit_identical_and_disable_restores():
    reference = train_steps(checkpointed_llama())
    model = checkpointed_llama()
    before = model_state(model)
    handle = enable_activation_offload(model, keep_last=1, **HOST)
    got = train_steps(model)
    assert_same(reference, got)
    stats = handle.stats()
    # Every layer: the LM head's offloaded tensor (the final norm's input) is restored during
    # the LM head's backward and brings the last layer's input back with it.
    assert stats["offloaded_tensors"] == LAYERS
    assert stats["restored_tensors"] == LAYERS
    assert stats["kept_resident_tensors"] == 0
    assert stats["head_offloaded_tensors"] >= 1
    assert stats["micro_steps"] == 3
    totals = handle.totals()
    assert totals["offloaded_tensors"] == 3 * LAYERS
    assert totals["host_live_bytes"] == 0
    handle.disable()
    handle.disable()  # idempotent
    assert model_state(model) == before
    after = checkpoint_funcs(model)
    assert all(after[name] is func for name, func in before[1].items())


@pytest.mark.parametrize("keep_last", [0, 2])
def test_keep_last_decides_how_many_layers_stay(keep_last):
    model = checkpointed_llama()
    # Without the head's offload, nothing restores the kept layers early: they stay.
    with enable_activation_offload(model, keep_last=keep_last, offload_head=False,
                                   **HOST) as handle:
        model(**batch()).loss.backward()
        assert handle.stats()["offloaded_tensors"] == LAYERS - keep_last
        assert handle.stats()["kept_resident_tensors"] == keep_last
    assert "forward" not in model.__dict__


def test_no_grad_and_eval_forwards_are_not_engine_steps():
    model = checkpointed_llama()
    handle = enable_activation_offload(model, **HOST)
    with torch.no_grad():
        model(**batch())
    model.eval()
    with torch.inference_mode():
        model(**batch())
    model(**batch()).loss.backward()  # eval mode with grad: layers do not checkpoint
    assert handle.totals()["micro_steps"] == 0
    assert handle.totals()["offloaded_tensors"] == 0
    handle.disable()


def test_a_context_entered_by_the_user_is_used_not_nested():
    model = checkpointed_llama()
    handle = enable_activation_offload(model, **HOST)
    with ckpt_offload.offload_activations(keep_last=0, **HOST) as engine:
        model(**batch()).loss.backward()
    assert engine.stats()["offloaded_tensors"] == LAYERS
    assert handle.totals()["micro_steps"] == 0
    handle.disable()


def test_forward_that_raises_leaves_the_handle_usable():
    model = checkpointed_llama()
    handle = enable_activation_offload(model, **HOST)
    with pytest.raises(ValueError):
        model(input_ids=batch()["input_ids"], labels=torch.zeros(3, dtype=torch.long))
    assert ckpt_offload.current_engine() is None
    model(**batch()).loss.backward()
    assert handle.stats()["offloaded_tensors"] == LAYERS
    handle.disable()


def test_checkpointing_off_is_turned_on_and_back_off():
    reference = train_steps(checkpointed_llama())
    model = tiny_llama()
    model.train()
    before = model_state(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = enable_activation_offload(model, **HOST)
    # Turned on through transformers' current name, not a deprecated one that warns.
    assert not [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert model.is_gradient_checkpointing
    assert_same(reference, train_steps(model))
    handle.disable()
    assert model_state(model) == before
    assert not model.is_gradient_checkpointing
    assert "_require_grads_hooks" not in model.__dict__
    assert not model.get_input_embeddings()._forward_hooks


def test_transformers_own_offload_is_replaced_with_a_warning():
    reference = train_steps(checkpointed_llama())
    model = tiny_llama()
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False}, offload=True)
    model.train()
    with pytest.warns(UserWarning, match="save_on_cpu"):
        handle = enable_activation_offload(model, **HOST)
    assert_same(reference, train_steps(model))
    assert handle.stats()["offloaded_tensors"] == LAYERS
    handle.disable()


# A model of GradientCheckpointingLayers outside transformers' model classes, called with
# the hidden states as a keyword argument.


class KeywordLayer(GradientCheckpointingLayer):
    def __init__(self, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, hidden_states, scale=1.0):
        return hidden_states + scale * self.down(F.gelu(self.up(self.norm(hidden_states))))


class OddlyNamedLayer(GradientCheckpointingLayer):
    def __init__(self, hidden):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class Stack(nn.Module):
    def __init__(self, layer_cls, call, layers=LAYERS, hidden=32):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, hidden)
        self.layers = nn.ModuleList(layer_cls(hidden) for _ in range(layers))
        self.call = call

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = self.call(layer, h)
        return h.pow(2).mean()


def stack_grads(model):
    model.zero_grad(set_to_none=True)
    model(torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(3))).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def checkpoint_layers(model):
    for layer in model.layers:
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = functools.partial(
            torch.utils.checkpoint.checkpoint, use_reentrant=False)
    return model


def keyword_call(layer, h):
    return layer(hidden_states=h, scale=0.5)


def test_hidden_states_keyword_is_moved_to_a_position_and_offloaded():
    reference = stack_grads(checkpoint_layers(Stack(KeywordLayer, keyword_call)))
    model = checkpoint_layers(Stack(KeywordLayer, keyword_call))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle = enable_activation_offload(model, keep_last=1, **HOST)
        got = stack_grads(model)
    assert all(torch.equal(reference[n], got[n]) for n in reference)
    # No head after the layers that could restore the kept one ahead: it stays.
    assert handle.stats()["offloaded_tensors"] == LAYERS - 1
    handle.disable()


def test_layer_without_positional_or_hidden_states_input_warns_once():
    def call(layer, h):
        return layer(x=h)

    reference = stack_grads(checkpoint_layers(Stack(OddlyNamedLayer, call)))
    model = checkpoint_layers(Stack(OddlyNamedLayer, call))
    handle = enable_activation_offload(model, **HOST)
    with pytest.warns(UserWarning, match="OddlyNamedLayer passed no tensor") as record:
        got = stack_grads(model)
    assert len([w for w in record if "OddlyNamedLayer" in str(w.message)]) == 1
    assert all(torch.equal(reference[n], got[n]) for n in reference)
    assert handle.stats()["offloaded_tensors"] == 0
    handle.disable()


def test_stack_without_transformers_model_gets_checkpointing_turned_on():
    def call(layer, h):
        return layer(h)

    reference = stack_grads(checkpoint_layers(Stack(KeywordLayer, call)))
    model = Stack(KeywordLayer, call)
    handle = enable_activation_offload(model, **HOST)
    got = stack_grads(model)
    assert all(torch.equal(reference[n], got[n]) for n in reference)
    assert handle.stats()["offloaded_tensors"] == LAYERS - 1  # no head: the last one stays
    handle.disable()
    assert all("gradient_checkpointing" not in layer.__dict__ for layer in model.layers)
    assert checkpoint_funcs(model) == {}


# Misuse: a clear error and an untouched model.


def test_model_without_checkpointing_layers_is_rejected():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(ValueError, match="GradientCheckpointingLayer"):
        enable_activation_offload(model, **HOST)
    assert "forward" not in model.__dict__


@pytest.mark.parametrize("overrides, field", [
    (dict(keep_last=-1), "keep_last"),
    (dict(prefetch_depth="2"), "prefetch_depth"),
    (dict(host_memory_limit="24 parsecs"), "host_memory_limit"),
    (dict(backend="tpu"), "backend"),
    (dict(keep_lats=1), "keep_lats"),
])
def test_bad_overrides_name_the_field_and_change_nothing(overrides, field):
    model = checkpointed_llama()
    before = model_state(model)
    with pytest.raises(ValueError, match=field):
        enable_activation_offload(model, **overrides)
    assert model_state(model) == before


def test_installing_twice_is_an_error_until_disabled():
    model = checkpointed_llama()
    first = enable_activation_offload(model, **HOST)
    with pytest.raises(RuntimeError, match="already installed"):
        enable_activation_offload(model, **HOST)
    from peft import LoraConfig, get_peft_model

    with pytest.raises(RuntimeError, match="already installed"):
        peft_model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
        enable_activation_offload(peft_model)
    first.disable()


def test_reinstall_after_disable():
    model = checkpointed_llama()
    enable_activation_offload(model, **HOST).disable()
    handle = enable_activation_offload(model, keep_last=0, **HOST)
    model(**batch()).loss.backward()
    assert handle.stats()["offloaded_tensors"] == LAYERS
    handle.disable()


# enable_input_require_grads (called by peft and by Trainer for peft models) makes the
# embedding output a leaf that AccumulateGrad holds until backward.


def lora_llama_with_input_require_grads():
    from tiny import tiny_lora

    model = checkpointed_llama()
    model.enable_input_require_grads()
    model = tiny_lora(model)
    model.train()
    return model


def embedding_hook_names(model):
    return [hook.__name__ for hook in model.get_input_embeddings()._forward_hooks.values()]


def test_first_layer_input_is_offloaded_under_enable_input_require_grads():
    reference = train_steps(lora_llama_with_input_require_grads())
    model = lora_llama_with_input_require_grads()
    hooks_before = list(model.get_input_embeddings()._forward_hooks.values())
    assert hooks_before and set(embedding_hook_names(model)) == {"make_inputs_require_grads"}
    handle = enable_activation_offload(model, keep_last=1, **HOST)
    got = train_steps(model)
    assert_same(reference, got)
    # Every layer, the first layer's input included.
    assert handle.stats()["offloaded_tensors"] == LAYERS
    assert handle.stats()["kept_resident_tensors"] == 0
    handle.disable()
    assert list(model.get_input_embeddings()._forward_hooks.values()) == hooks_before
    embeds = model.get_input_embeddings()(batch()["input_ids"])
    assert embeds.is_leaf and embeds.requires_grad  # the original hook is back


def test_embedding_output_still_requires_grad_and_is_not_a_leaf():
    model = lora_llama_with_input_require_grads()
    with enable_activation_offload(model, **HOST):
        embeds = model.get_input_embeddings()(batch()["input_ids"])
        assert embeds.requires_grad and not embeds.is_leaf
        with torch.no_grad():  # outside training the original hook's behaviour
            assert model.get_input_embeddings()(batch()["input_ids"]).requires_grad


def test_require_grads_hook_registered_after_install_is_swapped_at_the_next_step():
    model = checkpointed_llama()
    handle = enable_activation_offload(model, keep_last=1, **HOST)
    model.enable_input_require_grads()  # e.g. gradient_checkpointing_enable on a peft model
    for p in model.parameters():
        p.requires_grad_(False)
    model.model.layers[0].mlp.down_proj.weight.requires_grad_(True)
    model(**batch()).loss.backward()
    assert handle.stats()["offloaded_tensors"] == LAYERS
    handle.disable()
    assert set(embedding_hook_names(model)) == {"make_inputs_require_grads"}


# Wrappers: layers are found through the wrapper; the wrapper's forward is wrapped.


def test_ddp_wrapped_model(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0,
                            world_size=1)
    try:
        plain = checkpointed_llama()
        reference = train_steps(plain, call=DistributedDataParallel(plain))
        model = checkpointed_llama()
        ddp = DistributedDataParallel(model)
        handle = enable_activation_offload(ddp, **HOST)
        assert_same(reference, train_steps(model, call=ddp))
        assert handle.totals()["offloaded_tensors"] == 3 * LAYERS
        handle.disable()
        assert "forward" not in ddp.__dict__
    finally:
        dist.destroy_process_group()


def test_accelerate_prepared_model_with_autocast_forward():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    def run(offload):
        AcceleratorState._reset_state(True)  # state is per process; Trainer tests make one
        accelerator = Accelerator(cpu=True, mixed_precision="bf16")
        model = accelerator.prepare(checkpointed_llama())
        patched_forward = model.__dict__.get("forward")
        assert patched_forward is not None  # accelerate's autocast wrapper, an instance attr
        handle = enable_activation_offload(model, **HOST) if offload else None
        result = train_steps(model)
        if handle is not None:
            assert handle.totals()["offloaded_tensors"] == 3 * LAYERS
            handle.disable()
            assert model.__dict__.get("forward") is patched_forward
        AcceleratorState._reset_state(True)
        return result

    assert_same(run(offload=False), run(offload=True))


class TokensWithANote(torch.utils.data.Dataset):
    """Token data with a column the model's forward does not take: the Trainer drops it by
    reading inspect.signature(model.forward)."""

    def __init__(self):
        from tiny import TokenDataset

        self.tokens = TokenDataset()

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {**self.tokens[i], "note": torch.tensor(i)}


def test_forward_keeps_its_signature_and_a_trainer_reads_it(tmp_path):
    import inspect

    from transformers import Trainer

    from tiny import training_args

    model = tiny_llama()
    plain_signature = inspect.signature(model.forward)
    handle = enable_activation_offload(model, keep_last=0, **HOST)
    assert inspect.signature(model.forward) == plain_signature
    assert model.forward.__name__ == "forward" and model.forward.__doc__
    # A Trainer made on the installed model (no callback: the handle offloads; the
    # Trainer leaves checkpointing, which the installation turned on, as it is).
    trainer = Trainer(model=model, train_dataset=TokensWithANote(),
                      args=training_args(tmp_path, max_steps=2, gradient_checkpointing=False))
    trainer.train()
    assert handle.totals()["offloaded_tensors"] == 2 * 4
    handle.disable()


def decoder_then_own_loss(model, ids):
    """A custom loop with its own loss on the decoder's output (what users of a fused loss
    such as Cut Cross-Entropy write): the causal LM's forward is never called."""
    hidden = model.model(input_ids=ids).last_hidden_state
    logits = model.lm_head(hidden).float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def test_decoder_called_directly_is_offloaded_bit_identically():
    def run(offload):
        model = checkpointed_llama()
        handle = (enable_activation_offload(model, keep_last=1, offload_head=False, **HOST)
                  if offload else None)
        losses, grads, offloaded = [], [], []
        for step in range(2):
            loss = decoder_then_own_loss(model, batch(seed=step)["input_ids"])
            loss.backward()
            losses.append(loss.detach())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            model.zero_grad(set_to_none=True)
            if handle is not None:
                offloaded.append(handle.stats()["offloaded_tensors"])
        return model, handle, losses, grads, offloaded

    _, _, ref_losses, ref_grads, _ = run(offload=False)
    model, handle, losses, grads, offloaded = run(offload=True)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    for expected, got in zip(ref_grads, grads):
        assert all(torch.equal(expected[name], got[name]) for name in expected)
    assert offloaded == [LAYERS - 1, LAYERS - 1]
    assert handle.stats()["micro_steps"] == 2
    # Through the causal LM's forward it is still one step per forward, not one per wrapper.
    model(**batch()).loss.backward()
    assert handle.stats()["micro_steps"] == 3
    handle.disable()
    assert all("forward" not in module.__dict__ for module in model.modules())


def test_deep_copy_of_a_model_offloaded_at_every_level_is_plain():
    model = checkpointed_llama()
    handle = enable_activation_offload(model, **HOST)
    copy_of = copy.deepcopy(model)
    assert installations(copy_of) == []
    loss = decoder_then_own_loss(copy_of, batch()["input_ids"])
    loss.backward()
    assert torch.equal(loss, decoder_then_own_loss(model, batch()["input_ids"]))
    assert handle.stats()["micro_steps"] == 1  # the original's call only
    handle.disable()


def record_mlp_backward_starts(model, events):
    """Appends ("mlp", i) when layer i's MLP begins its backward (the gradient of its output
    is ready), in the forward's graph, which backward runs through."""
    for index, layer in enumerate(model.model.layers):
        def hook(module, inputs, output, index=index):
            if torch._C._current_graph_task_id() == -1 and output.requires_grad:
                output.register_hook(lambda grad: events.append(("mlp", index)))
        layer.mlp.register_forward_hook(hook)


def test_the_layer_below_is_prefetched_after_the_mlp_backward_not_before():
    # The prefetched input would otherwise sit on the device through the MLP's backward,
    # the layer's memory peak.
    reference = checkpointed_llama()
    ref_loss = reference(**batch()).loss
    ref_loss.backward()
    model = checkpointed_llama()
    events = []
    record_mlp_backward_starts(model, events)
    handle = enable_activation_offload(model, keep_last=1, offload_head=False, **HOST)
    prefetch = handle.engine.prefetch_ahead

    def recording_prefetch():
        prefetch()
        events.append(("prefetched", handle.engine.stats()["prefetched_tensors"]))

    handle.engine.prefetch_ahead = recording_prefetch
    loss = model(**batch()).loss
    loss.backward()
    assert torch.equal(loss, ref_loss)
    for (name, param), (_, ref_param) in zip(model.named_parameters(),
                                             reference.named_parameters()):
        assert torch.equal(param.grad, ref_param.grad), name
    # Layer 3 (kept) fetches layer 2 after its MLP's backward, and so on down; layer 0 has
    # nothing below it.
    assert events == [("mlp", 3), ("prefetched", 1), ("mlp", 2), ("prefetched", 2),
                      ("mlp", 1), ("prefetched", 3), ("mlp", 0), ("prefetched", 3)]
    stats = handle.stats()
    assert stats["prefetched_tensors"] == stats["restored_tensors"] == LAYERS - 1
    handle.disable()


def test_layers_without_an_mlp_prefetch_as_their_recompute_begins():
    model = checkpointed_llama()
    for layer in model.model.layers:
        layer._modules["feed_forward"] = layer._modules.pop("mlp")  # a family naming it so
        layer.__class__ = FeedForwardDecoderLayer
    reference = copy.deepcopy(model)
    handle = enable_activation_offload(model, keep_last=1, offload_head=False, **HOST)
    loss = model(**batch()).loss
    loss.backward()
    ref_loss = reference(**batch()).loss
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    stats = handle.stats()
    assert stats["prefetched_tensors"] == stats["restored_tensors"] == LAYERS - 1
    handle.disable()


class FeedForwardDecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose MLP is called `feed_forward`: no `mlp` module when checkpoint is
    called (transformers checkpoints either __call__ or forward, by release), one only for
    the duration of each (re)computation."""

    def forward(self, hidden_states, *args, **kwargs):
        self.mlp = self.feed_forward
        try:
            return super().forward(hidden_states, *args, **kwargs)
        finally:
            del self.mlp


# Gradient checkpointing toggled while installed (TRL's disable_gradient_checkpointing()
# around reference and old-policy forwards, every_n_layers, an assignment): each training
# forward takes over the function it finds, and disable() gives back the user's latest.


def trl_toggle(model, **enable):
    """What trl.models.utils.disable_gradient_checkpointing() does around a forward."""
    model.gradient_checkpointing_disable()
    with torch.no_grad():
        model(**batch(seed=9))
    model.gradient_checkpointing_enable({"use_reentrant": False}, **enable)


def toggled_steps(model, handle=None, steps=3, **enable):
    """Steps with a TRL toggle before each one after the first; returns (losses, grads,
    engine stats per step)."""
    losses, grads, stats = [], [], []
    for step in range(steps):
        if step:
            trl_toggle(model, **enable)
        model.zero_grad(set_to_none=True)
        loss = model(**batch(seed=step)).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if handle is not None:
            stats.append(handle.stats())
    return losses, grads, stats


def test_toggling_checkpointing_while_installed_keeps_prefetch_and_recompute():
    ref_losses, ref_grads, _ = toggled_steps(checkpointed_llama())
    model = checkpointed_llama()
    flags = [layer.gradient_checkpointing for layer in model.model.layers]
    handle = enable_activation_offload(model, keep_last=1, **HOST)
    losses, grads, stats = toggled_steps(model, handle)

    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    for ref, got in zip(ref_grads, grads):
        assert ref.keys() == got.keys()
        assert all(torch.equal(ref[n], got[n]) for n in ref)
    for step in stats:
        # Every offloaded input comes back through a prefetch, also after the toggles.
        assert step["offloaded_tensors"] == step["restored_tensors"] == LAYERS
        assert step["prefetched_tensors"] == stats[0]["prefetched_tensors"] > 0
    # The profiled step (the second) came after a toggle: its recomputes were seen.
    assert stats[-1]["peak_layer_recompute_bytes"] > 0
    user = model.model.layers[0].__dict__["_gradient_checkpointing_func"].original
    handle.disable()
    # The user's latest function (the last enable's) on every module, flags as they are.
    assert not installations(model)
    funcs = checkpoint_funcs(model)
    assert isinstance(user, functools.partial) and all(f is user for f in funcs.values())
    assert [layer.gradient_checkpointing for layer in model.model.layers] == flags


def test_every_n_layers_set_while_installed():
    reference = checkpointed_llama()
    ref = toggled_steps(reference, every_n_layers=2)
    model = checkpointed_llama()
    handle = enable_activation_offload(model, keep_last=0, offload_head=False, **HOST)
    losses, grads, stats = toggled_steps(model, handle, every_n_layers=2)
    assert all(torch.equal(a, b) for a, b in zip(ref[0], losses))
    assert all(torch.equal(ref[1][-1][n], grads[-1][n]) for n in grads[-1])
    assert stats[0]["offloaded_tensors"] == LAYERS
    for step in stats[1:]:  # layers 0 and 2 checkpointed
        assert step["offloaded_tensors"] == step["restored_tensors"] == 2
        assert step["prefetched_tensors"] == 1  # layer 0's, after layer 2's backward
    handle.disable()
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [
        True, False, True, False]
    funcs = list(checkpoint_funcs(model).values())
    assert all(f is funcs[0] for f in funcs)  # the last enable's partial
    assert (funcs[0].func, funcs[0].keywords) == (torch.utils.checkpoint.checkpoint,
                                                  {"use_reentrant": False})
    assert not installations(model)


def test_a_function_assigned_while_installed_is_wrapped_and_given_back():
    model = checkpointed_llama()
    handle = enable_activation_offload(model, keep_last=1, **HOST)
    model(**batch()).loss.backward()
    first = handle.stats()
    mine = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    model.model.layers[1]._gradient_checkpointing_func = mine
    model.zero_grad(set_to_none=True)
    model(**batch()).loss.backward()
    assert handle.stats()["prefetched_tensors"] == first["prefetched_tensors"]
    assert model.model.layers[1].__dict__["_gradient_checkpointing_func"].original is mine
    handle.disable()
    assert model.model.layers[1].__dict__["_gradient_checkpointing_func"] is mine


def test_checkpointing_turned_on_by_the_installation_goes_off_after_toggles():
    model = tiny_llama()
    model.train()
    before = model_state(model)
    hooks = dict(model.get_input_embeddings()._forward_hooks)
    handle = enable_activation_offload(model, **HOST)
    toggled_steps(model, handle)
    assert model.get_input_embeddings()._forward_hooks  # one per enable, transformers' way
    handle.disable()
    assert model_state(model) == before
    assert not model.is_gradient_checkpointing
    assert dict(model.get_input_embeddings()._forward_hooks) == hooks


# Forwards that cannot offload anything (no_grad, inference mode, eval: a generation's
# decode steps) run the user's code and nothing of ckpt_offload's.


def test_a_forward_without_grad_calls_the_users_checkpoint_function_as_it_is():
    model = checkpointed_llama()
    calls = []

    def users(function, *args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)

    for layer in model.model.layers:
        layer._gradient_checkpointing_func = users
    with torch.no_grad():
        plain = model(**batch()).logits
    # What transformers does without ckpt_offload: up to 5.23 a layer in training mode calls
    # its function without grad too; from 5.24 it runs its forward directly.
    untouched = list(calls)
    assert untouched in ([False] * LAYERS, [])
    calls.clear()
    with pytest.warns(UserWarning, match="users is replaced"):
        handle = enable_activation_offload(model, **HOST)
    wrapper = model.model.layers[0].__dict__["_gradient_checkpointing_func"]
    with torch.no_grad():
        assert torch.equal(model(**batch()).logits, plain)
    assert calls == untouched
    with torch.inference_mode():
        model(**batch())
    assert handle.totals()["micro_steps"] == 0 and ckpt_offload.current_engine() is None
    with torch.no_grad():
        assert torch.equal(model(**batch()).logits, plain)
    assert model.model.layers[0].__dict__["_gradient_checkpointing_func"] is wrapper
    handle.disable()
    assert all(layer.__dict__["_gradient_checkpointing_func"] is users
               for layer in model.model.layers)


def test_forwards_without_offload_look_for_torch_compile_only_before_training(monkeypatch):
    from ckpt_offload.hf import install as install_module

    looks = []
    real = install_module.enclosing_compiled_module
    monkeypatch.setattr(install_module, "enclosing_compiled_module",
                        lambda max_frames=24: looks.append(max_frames) or real(max_frames))
    model = checkpointed_llama()
    handle = enable_activation_offload(model, **HOST)
    with torch.no_grad():
        model(**batch())
    assert looks == [install_module._NEAR_FRAMES]  # the outermost level, close by
    looks.clear()
    model(**batch()).loss.backward()
    assert looks == [24]  # a training forward looks further (the decoder's is inside it)
    looks.clear()
    with torch.no_grad():
        model(**batch())
    model.eval()
    with torch.inference_mode():
        model(**batch())
    assert looks == []
    handle.disable()


def test_a_compiled_forward_without_grad_compiles_the_regions():
    model = checkpointed_llama()
    handle = enable_activation_offload(model, **HOST)
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        compiled(**batch())
    assert handle.regions is not None
    assert handle.regions.layer_count == LAYERS
    handle.disable()
