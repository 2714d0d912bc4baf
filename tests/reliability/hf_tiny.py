"""A tiny Llama, token data and TrainingArguments for the reliability tests' HF cases
(CPU, offline: the model is built from a config, nothing is downloaded)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tiny
from tiny import training_args  # noqa: F401  (the HF tests' TrainingArguments)

VOCAB = 96
SEQ = 16


def tiny_llama(seed: int = 0, checkpointing: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def batch(seed: int = 0, size: int = 2, seq: int = SEQ):
    ids = torch.randint(3, VOCAB, (size, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def TokenDataset(count: int = 16, seq: int = SEQ, seed: int = 11):
    """Fixed random token ids of this module's vocabulary; labels are the inputs."""
    return tiny.TokenDataset(count=count, seq=seq, seed=seed, vocab=VOCAB)
