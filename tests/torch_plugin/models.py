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
