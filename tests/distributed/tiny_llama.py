"""A tiny random Llama and fixed token data for the multi-process tests (CPU, offline)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 128
SEQ = 32
LAYERS = 3


def tiny_llama(seed: int = 0, layers: int = LAYERS) -> LlamaForCausalLM:
    """A 3-layer Llama (hidden 64) with weights from `seed`: the same on every call and rank."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        attn_implementation="sdpa", bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config)


class TokenDataset(Dataset):
    """Fixed random token ids; labels are the inputs (causal LM loss)."""

    def __init__(self, count: int = 16, seq: int = SEQ, seed: int = 123):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB, (count, seq), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}
