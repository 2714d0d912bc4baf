"""A tiny Llama, token data and TrainingArguments for the reliability tests' HF cases
(CPU, offline: the model is built from a config, nothing is downloaded)."""

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

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


class TokenDataset(Dataset):
    """Fixed random token ids; labels are the inputs (causal LM loss)."""

    def __init__(self, count: int = 16, seq: int = SEQ, seed: int = 11):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB, (count, seq), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def training_args(output_dir, **overrides) -> TrainingArguments:
    settings = dict(
        output_dir=str(output_dir), max_steps=4, per_device_train_batch_size=2,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        seed=0, dataloader_num_workers=0, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, disable_tqdm=True)
    settings.update(overrides)
    return TrainingArguments(**settings)
