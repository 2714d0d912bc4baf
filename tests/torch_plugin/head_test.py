"""The end of forward and the model's head (host backend, CPU): what moves after the last
checkpointed layer, when it comes back, and that training stays bit-identical."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import ckpt_offload
from models import (LM_HIDDEN as HIDDEN, LM_SEQ as SEQ, LM_VOCAB, LanguageModel, batch, grads,
                    make_llama_stack)

# Layer inputs (2 x 48 x 64 bfloat16: 12 KiB) move; the norm's reciprocal roots, the loss and
# the labels (< 1 KiB) are small: neither head tensors nor triggers.
HOST = dict(backend="host", min_offload_bytes=4096)


def plain_ckpt(layer, x):
    return torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)


def step(model, engine_kwargs=None, seed=0, seq=SEQ):
    model.zero_grad(set_to_none=True)
    x, labels = batch(seed, seq)
    log = {}
    if engine_kwargs is None:
        loss = model(x, labels, plain_ckpt)
        loss.backward()
        return loss.detach(), grads(model), None, log
    with ckpt_offload.offload_activations(**engine_kwargs) as engine:
        loss = model(x, labels, ckpt_offload.checkpoint, engine, log)
        loss.backward()
    return loss.detach(), grads(model), engine, log


def assert_same(reference, got):
    assert torch.equal(reference[0], got[0])
    assert reference[1].keys() == got[1].keys()
    for name in reference[1]:
        assert torch.equal(reference[1][name], got[1][name]), name


@pytest.mark.parametrize("keep_last, prefetch_depth", [(1, 1), (0, 1), (0, 0), (2, 2)])
def test_final_norm_input_is_offloaded_and_back_before_the_norms_backward(keep_last,
                                                                         prefetch_depth):
    model = LanguageModel()
    reference = step(model)
    for seed in range(2):  # the second step reuses the pool and the hooks' state
        got = step(model, dict(keep_last=keep_last, prefetch_depth=prefetch_depth, **HOST),
                   seed=0)
        assert_same(reference, got)
    stats, log = got[2].stats(), got[3]
    # The norm's float32 input: twice a layer input, the one head tensor that qualifies
    # (the log-probabilities are vocabulary-sized; the LM head's weight is a parameter).
    assert stats["head_offloaded_tensors"] == 1
    assert stats["head_offloaded_bytes"] == 2 * SEQ * HIDDEN * 4
    assert stats["head_restored_tensors"] == 1
    # Layer inputs, counted apart: all of them, the last keep_last too, since the head's
    # trigger restores those ahead as well.
    assert stats["offloaded_tensors"] == 4
    assert stats["kept_resident_tensors"] == 0
    # Restored when backward reached the LM head's weight (its trigger), before the norm's
    # backward asked for it; not yet when backward began. The last layer's input is
    # prefetched with it (prefetch_depth > 0).
    assert log["backward_start"]["head_restored_tensors"] == 0
    assert log["backward_start"]["restored_tensors"] == 0
    assert log["before_norm_backward"]["head_restored_tensors"] == 1
    assert log["before_norm_backward"]["restored_tensors"] == prefetch_depth


@pytest.mark.parametrize("keep_last", [0, 1])
def test_first_unpack_ends_the_forward_and_frees_every_source(keep_last):
    model = LanguageModel()
    got = step(model, dict(keep_last=keep_last, prefetch_depth=1, **HOST))
    start = got[3]["backward_start"]
    # Every layer input and the head tensor were copied out, and their device sources were
    # handed back before the loss's backward ran.
    assert start["offloaded_tensors"] == 4
    assert start["head_offloaded_tensors"] == 1
    assert start["device_held_bytes"] == 0
    assert start["restored_tensors"] == 0


def test_offload_head_false_keeps_the_head():
    model = LanguageModel()
    reference = step(model)
    got = step(model, dict(keep_last=1, offload_head=False, **HOST))
    assert_same(reference, got)
    stats = got[2].stats()
    assert stats["head_offloaded_tensors"] == 0 and stats["head_kept_tensors"] == 0
    assert stats["offloaded_tensors"] == 3


def test_a_head_candidate_that_nothing_large_follows_stays():
    # The head ends with the norm: nothing large is saved after its input, so it is kept.
    model = LanguageModel()
    x, labels = batch()
    with ckpt_offload.offload_activations(keep_last=1, **HOST) as engine:
        for layer in model.stack.layers:
            x = ckpt_offload.checkpoint(layer, x)
        model.norm(x).float().sum().backward()
    stats = engine.stats()
    assert stats["head_offloaded_tensors"] == 0
    assert stats["head_kept_tensors"] == 1
    assert stats["kept_resident_tensors"] == 1  # no trigger: the kept layer stays too


def head_step_stats(head):
    """Stats of an offloaded step of LanguageModel's layers followed by
    `head(model, hidden_states, labels) -> loss`, after checking its loss and gradients
    against the same step without offload."""
    model = LanguageModel()
    results = []
    for engine_kwargs in (None, dict(keep_last=1, **HOST)):
        model.zero_grad(set_to_none=True)
        x, labels = batch()
        hooks = (ckpt_offload.offload_activations(**engine_kwargs) if engine_kwargs
                 else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
        call = ckpt_offload.checkpoint if engine_kwargs else plain_ckpt
        with hooks as engine:
            for layer in model.stack.layers:
                x = call(layer, x)
            loss = head(model, x, labels)
            loss.backward()
        results.append((loss.detach().as_subclass(torch.Tensor), grads(model)))
    assert torch.equal(results[0][0], results[1][0])
    for name in results[0][1]:
        assert torch.equal(results[0][1][name], results[1][1][name]), name
    return engine.stats()


class Marked(torch.Tensor):
    """A tensor subclass, as tensor-parallel or quantized activations are: not the
    offloader's to move, still an activation that a head tensor's restore may wait for."""


def test_a_tensor_subclass_activation_triggers_the_head():
    # The loss saves its input as a Marked tensor, kept where it is; it was made by a later
    # node than the norm's float32 input, which it triggers. Without a trigger that input
    # would stay (test_a_head_candidate_that_nothing_large_follows_stays).
    stats = head_step_stats(
        lambda model, h, labels: model.norm(h).float().as_subclass(Marked).pow(2).mean())
    assert stats["head_offloaded_tensors"] == stats["head_restored_tensors"] == 1
    assert stats["head_kept_tensors"] == 0
    assert stats["offloaded_tensors"] == 4 and stats["kept_resident_tensors"] == 0


def test_head_tensors_between_layers_wait_for_no_later_group():
    # A saved tensor between two checkpointed layers is not part of the head: the next
    # layer's group begins before anything triggers it.
    model = LanguageModel()
    x, _ = batch()
    reference_grads = None
    for engine_kwargs in (None, dict(keep_last=1, **HOST)):
        model.zero_grad(set_to_none=True)
        h = x.clone()
        engine = ckpt_offload.offload_activations(**engine_kwargs) if engine_kwargs else None
        with engine or torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            for i, layer in enumerate(model.stack.layers):
                call = ckpt_offload.checkpoint if engine else plain_ckpt
                h = call(layer, h)
                if i == 1:
                    h = model.norm(h) * 2  # saved outside any group, between layers
            loss = h.float().pow(2).mean()
            loss.backward()
        if engine is None:
            reference_grads = grads(model)
        else:
            got = grads(model)
            for name in reference_grads:
                assert torch.equal(reference_grads[name], got[name]), name
            assert engine.stats()["head_offloaded_tensors"] == 0
            assert engine.stats()["offloaded_tensors"] == 3


def test_a_trainable_weights_transpose_is_a_trigger_not_a_head_tensor():
    # A full fine-tune's LM head saves its input and its weight's transpose, a view of a
    # parameter that stays on the device anyway: the input and the norm's input are copied
    # out, the transpose is not. The transpose triggers the norm's input, not the input the
    # same node saved: the log-probabilities trigger that.
    # At 256 tokens the transpose (1024 x 64 bfloat16, 128 KiB) is within the size a head
    # tensor may have (twice a 64 KiB layer input).
    model = LanguageModel()
    model.lm_head.weight.requires_grad_(True)
    reference = step(model, seq=256)
    got = step(model, dict(keep_last=1, **HOST), seq=256)
    assert_same(reference, got)
    stats = got[2].stats()
    assert stats["head_offloaded_tensors"] == 2
    # The norm's float32 input and the LM head's bfloat16 input; no 128 KiB transpose.
    assert stats["head_offloaded_bytes"] == 2 * 256 * HIDDEN * (4 + 2)


def _cross_entropy_grad(h, weight, labels):
    """The loss and its gradient by h, computed by hand as a fused kernel would: no graph."""
    logits = (h @ weight.t()).float()
    probs = logits.softmax(-1)
    loss = -probs.gather(-1, labels.unsqueeze(-1)).log().mean()
    probs.scatter_add_(-1, labels.unsqueeze(-1), -torch.ones_like(probs[..., :1]))
    return loss, ((probs / labels.numel()).to(h.dtype) @ weight).to(h.dtype)


class SavesWeightLoss(torch.autograd.Function):
    """A fused loss as Cut Cross-Entropy saves it: the hidden states and the classifier's
    weight, a parameter, both unpacked by this one node at the start of backward."""

    @staticmethod
    def forward(ctx, h, weight, labels):
        ctx.save_for_backward(h, weight, labels)
        return _cross_entropy_grad(h, weight, labels)[0]

    @staticmethod
    def backward(ctx, grad):
        h, weight, labels = ctx.saved_tensors
        return _cross_entropy_grad(h, weight, labels)[1] * grad.to(h.dtype), None, None


class SavesGradientLoss(torch.autograd.Function):
    """A fused loss as Liger's saves it: the gradient of its input, computed in forward
    outside autograd, which its backward only scales."""

    @staticmethod
    def forward(ctx, h, weight, labels):
        loss, grad_h = _cross_entropy_grad(h, weight, labels)
        ctx.save_for_backward(grad_h)
        return loss

    @staticmethod
    def backward(ctx, grad):
        (grad_h,) = ctx.saved_tensors
        return grad_h * grad.to(grad_h.dtype), None, None


def test_a_tensor_saved_by_a_candidate_s_own_node_does_not_trigger_it():
    # The norm's input is triggered by the hidden states, which a later node saved; the
    # hidden states wait for a trigger themselves, and the weight saved with them is none:
    # restoring them at its unpack would make the loss's node wait for its own input.
    # Nothing follows, so they stay.
    stats = head_step_stats(lambda model, h, labels: SavesWeightLoss.apply(
        model.norm(h), model.lm_head.weight, labels))
    assert stats["head_offloaded_tensors"] == stats["head_restored_tensors"] == 1
    assert stats["head_offloaded_bytes"] == 2 * SEQ * HIDDEN * 4
    assert stats["head_kept_tensors"] == 1
    # The norm input's trigger copied the kept layer out too.
    assert stats["offloaded_tensors"] == 4 and stats["kept_resident_tensors"] == 0


def test_a_gradient_computed_in_forward_triggers_nothing():
    # The loss's backward only scales its saved gradient, so the norm's backward would
    # follow its trigger at once: the norm's input stays, and so does the kept layer.
    stats = head_step_stats(lambda model, h, labels: SavesGradientLoss.apply(
        model.norm(h), model.lm_head.weight, labels))
    assert stats["head_offloaded_tensors"] == 0
    assert stats["head_kept_tensors"] == 1
    assert stats["offloaded_tensors"] == 3 and stats["kept_resident_tensors"] == 1


class VisionLanguageModel(nn.Module):
    """A vision tower before the language model: a checkpointed vision layer, then a
    projector of three trainable linears that runs outside any checkpoint, saving five
    hidden-state-sized tensors between the tower's group and the first language layer's,
    followed by the LanguageModel's layers and head (its LM head trainable, so the head's
    input is saved)."""

    IMAGE_TOKENS = 32

    def __init__(self):
        super().__init__()
        self.lm = LanguageModel()
        self.lm.lm_head.weight.requires_grad_(True)
        torch.manual_seed(5)
        self.vision_layer = make_llama_stack(layers=1, hidden=HIDDEN, heads=4, ffn=128,
                                             dtype=torch.bfloat16).layers[0]
        self.projector = nn.Sequential(
            nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
            nn.Linear(HIDDEN, HIDDEN)).to(torch.bfloat16)

    def forward(self, image, x, labels, layer_call):
        vision = self.projector(layer_call(self.vision_layer, image))
        h = torch.cat([vision, x], dim=1)
        for layer in self.lm.stack.layers:
            h = layer_call(layer, h)
        logits = self.lm.lm_head(self.lm.norm(h)).float()
        labels = torch.cat([torch.zeros_like(labels[:, :self.IMAGE_TOKENS]), labels], dim=1)
        return F.cross_entropy(logits.view(-1, LM_VOCAB), labels.view(-1))


def test_a_vision_towers_tensors_leave_the_language_models_head_its_budget():
    # The projector's tensors come after a closed group, so they may be offloaded like head
    # tensors, but the next group begins after them: they are not the head, and the LM
    # head's input and the final norm's must still be offloaded after them.
    model = VisionLanguageModel()
    x, labels = batch()
    image = torch.randn(2, model.IMAGE_TOKENS, HIDDEN,
                        generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    results = []
    for engine_kwargs in (None, dict(keep_last=1, **HOST)):
        model.zero_grad(set_to_none=True)
        if engine_kwargs is None:
            model(image, x, labels, plain_ckpt).backward()
            results.append(grads(model))
            continue
        with ckpt_offload.offload_activations(**engine_kwargs) as engine:
            model(image, x, labels, ckpt_offload.checkpoint).backward()
        results.append(grads(model))
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name
    stats = engine.stats()
    tokens = model.IMAGE_TOKENS + SEQ
    projector_bytes = 2 * model.IMAGE_TOKENS * HIDDEN * 2
    # Four of the projector's five tensors (its window's budget), then the final norm's
    # float32 input and the LM head's bfloat16 input, in a window of their own.
    assert stats["head_offloaded_tensors"] == 4 + 2
    assert stats["head_offloaded_bytes"] == 4 * projector_bytes + 2 * tokens * HIDDEN * (4 + 2)
