"""The end of forward and the model's head (host backend, CPU): what moves after the last
checkpointed layer, when it comes back, and that training stays bit-identical."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import ckpt_offload
from models import grads, make_llama_stack

HIDDEN = 64
VOCAB = 1024
SEQ = 48
# Layer inputs (2 x 48 x 64 bfloat16: 12 KiB) move; the norm's reciprocal roots, the loss and
# the labels (< 1 KiB) are small: neither head tensors nor triggers.
HOST = dict(backend="host", min_offload_bytes=4096)


class FrozenRMSNorm(nn.Module):
    """transformers' LlamaRMSNorm, with its weight frozen as under LoRA."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(dtype)


class StatsProbe(torch.autograd.Function):
    """Identity whose backward records the engine's figures at that point of backward.

    On a scalar (the loss) it saves it, so that its backward begins with an unpack, as
    autograd's own first node would."""

    @staticmethod
    def forward(ctx, x, engine, log, label):
        if x.dim() == 0:
            ctx.save_for_backward(x)
        ctx.engine, ctx.log, ctx.label = engine, log, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors  # noqa: B018 - the unpack is the point
        ctx.log[ctx.label] = dict(ctx.engine.stats()) if ctx.engine is not None else {}
        return grad, None, None, None


class LanguageModel(nn.Module):
    """Checkpointed layers, then a language model's head: final RMSNorm (saves its input in
    float32, twice a bfloat16 hidden state), a frozen LM head and a cross-entropy loss (saves
    vocabulary-sized log-probabilities). Probes mark the head's backward stages."""

    def __init__(self, layers=4):
        super().__init__()
        self.stack = make_llama_stack(layers=layers, hidden=HIDDEN, heads=4, ffn=128,
                                      dtype=torch.bfloat16)
        torch.manual_seed(3)
        self.norm = FrozenRMSNorm(HIDDEN).to(torch.bfloat16)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False).to(torch.bfloat16)
        self.lm_head.weight.requires_grad_(False)  # frozen, as with LoRA

    def forward(self, x, labels, layer_call, engine=None, log=None):
        log = {} if log is None else log
        for layer in self.stack.layers:
            x = layer_call(layer, x)
        h = self.norm(x)
        # Between the LM head's backward and the norm's: the head tensors must be back.
        h = StatsProbe.apply(h, engine, log, "before_norm_backward")
        logits = self.lm_head(h).float()
        loss = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
        # The first node of backward: the loss's.
        return StatsProbe.apply(loss, engine, log, "backward_start")


def plain_ckpt(layer, x):
    return torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)


def batch(seed=0, seq=SEQ):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, seq, HIDDEN, generator=generator).to(torch.bfloat16)
    labels = torch.randint(0, VOCAB, (2, seq), generator=generator)
    return x, labels


def step(model, engine_kwargs=None, seed=0):
    model.zero_grad(set_to_none=True)
    x, labels = batch(seed)
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
