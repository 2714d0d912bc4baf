"""Tiny Llama models, data and Trainer runs for the HF integration tests (CPU, offline)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

VOCAB = 128
SEQ = 32

# backend="host" moves CPU tensors through the engine; min_offload_bytes=0 offloads the tiny
# hidden states (2 x 32 x 64 floats) too.
HOST = dict(backend="host", min_offload_bytes=0)


def tiny_llama(seed: int = 0, attn: str = "sdpa", tied: bool = False,
               layers: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=tied, attn_implementation=attn,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config)


def tiny_lora(model: LlamaForCausalLM):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                            lora_dropout=0.0))


class TokenDataset(Dataset):
    """Fixed random token ids; labels are the inputs (causal LM loss)."""

    def __init__(self, count: int = 16, seq: int = SEQ, seed: int = 123, vocab: int = VOCAB):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, vocab, (count, seq), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def training_args(output_dir, args_class=TrainingArguments, **overrides) -> TrainingArguments:
    settings = dict(
        output_dir=str(output_dir), max_steps=4, per_device_train_batch_size=2,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        seed=0, dataloader_num_workers=0, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, disable_tqdm=True)
    settings.update(overrides)
    return args_class(**settings)


class Probe(TrainerCallback):
    """Records what the model looks like when training begins and what each step offloaded.

    Put in front of the offload callback (which moves itself first when the Trainer is made:
    train(probe=...) does it), its on_train_begin sees the model as the Trainer prepared it;
    its on_step_end reads the offload callback's handle, if any."""

    def __init__(self, offload_callback=None):
        self.offload_callback = offload_callback
        self.begin_forward = None
        self.begin_forward_attr = None
        self.begin_funcs = None
        self.step_totals = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.begin_forward = model.forward
        self.begin_forward_attr = model.__dict__.get("forward")
        self.begin_funcs = checkpoint_funcs(model)

    def on_step_end(self, args, state, control, **kwargs):
        handle = self.offload_callback.handle if self.offload_callback else None
        if handle is not None:
            self.step_totals.append(handle.totals())


def checkpoint_funcs(model):
    """Each module's own `_gradient_checkpointing_func` (absent ones as None), by name."""
    return {name: module.__dict__.get("_gradient_checkpointing_func")
            for name, module in model.named_modules()
            if "_gradient_checkpointing_func" in module.__dict__}


def train(model, tmp_path, callbacks=(), eval_dataset=None, probe=None, **arg_overrides):
    """Trains `model` with Trainer; returns (trainer, train losses by step). `probe` goes
    first among the callbacks, ahead of the offload callback."""
    trainer = Trainer(model=model, args=training_args(tmp_path, **arg_overrides),
                      train_dataset=TokenDataset(), eval_dataset=eval_dataset,
                      callbacks=list(callbacks))
    if probe is not None:
        trainer.callback_handler.callbacks.insert(0, probe)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return trainer, losses


def assert_same_weights(model_a, model_b):
    a, b = dict(model_a.named_parameters()), dict(model_b.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
