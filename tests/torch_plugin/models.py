"""Tiny models shared by the plugin tests (CPU, deterministic)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """A pre-norm MLP block: the shape of a transformer layer without attention."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


class LlamaLikeLayer(nn.Module):
    """Attention (causal SDPA, rotary-free) + gated MLP, pre-norm, residuals."""

    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x, scale: float = 1.0):
        b, s, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).chunk(3, dim=-1)
        shape = (b, s, self.heads, h // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h)) * scale
        m = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(m)) * self.up(m))


class Stack(nn.Module):
    def __init__(self, layers, hidden: int, vocab: int = 0):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.head = nn.Linear(hidden, vocab or hidden)

    def forward(self, x, layer_call):
        for layer in self.layers:
            x = layer_call(layer, x)
        return self.head(x).float().pow(2).mean()


def make_mlp_stack(layers=6, hidden=64, seed=0):
    torch.manual_seed(seed)
    return Stack([Block(hidden) for _ in range(layers)], hidden)


def make_llama_stack(layers=4, hidden=64, heads=4, ffn=128, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return Stack([LlamaLikeLayer(hidden, heads, ffn) for _ in range(layers)], hidden).to(dtype)


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# A language model's shape after the checkpointed layers (tests/torch_plugin/head_test.py).
LM_HIDDEN = 64
LM_VOCAB = 1024
LM_SEQ = 48


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
        self.stack = make_llama_stack(layers=layers, hidden=LM_HIDDEN, heads=4, ffn=128,
                                      dtype=torch.bfloat16)
        torch.manual_seed(3)
        self.norm = FrozenRMSNorm(LM_HIDDEN).to(torch.bfloat16)
        self.lm_head = nn.Linear(LM_HIDDEN, LM_VOCAB, bias=False).to(torch.bfloat16)
        self.lm_head.weight.requires_grad_(False)  # frozen, as with LoRA

    def forward(self, x, labels, layer_call, engine=None, log=None):
        log = {} if log is None else log
        for layer in self.stack.layers:
            x = layer_call(layer, x)
        h = self.norm(x)
        # Between the LM head's backward and the norm's: the head tensors must be back.
        h = StatsProbe.apply(h, engine, log, "before_norm_backward")
        logits = self.lm_head(h).float()
        loss = F.cross_entropy(logits.view(-1, LM_VOCAB), labels.view(-1))
        # The first node of backward: the loss's.
        return StatsProbe.apply(loss, engine, log, "backward_start")


def batch(seed=0, seq=LM_SEQ):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, seq, LM_HIDDEN, generator=generator).to(torch.bfloat16)
    labels = torch.randint(0, LM_VOCAB, (2, seq), generator=generator)
    return x, labels
