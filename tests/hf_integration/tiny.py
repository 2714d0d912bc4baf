"""Tiny models (Llama and other decoder families), data, Trainer runs and budgets for the HF
integration tests (CPU, offline)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from ckpt_offload.budget import CHECKPOINT, RESIDENT, SELECTIVE, checkpointed_peak, plan_layers

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


# Decoder families beside Llama, as (config class, model class, fields beyond the shared tiny
# shape): dense, sliding-window, QK-norm, fused-projection and mixture-of-experts layers.
FAMILIES = {
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=16)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, sliding_window=16)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}),
}


def tiny_family(family: str, seed: int = 0, layers: int = 4, dropout: float = 0.0):
    """A tiny model of one of FAMILIES (eager attention: deterministic on every device)."""
    import transformers

    config_name, model_name, fields = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        attention_dropout=dropout, attn_implementation="eager",
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **fields)
    return getattr(transformers, model_name)(config)


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


def keep_outputs_on_device(monkeypatch) -> None:
    """Handles made after this plan without offloaded outputs, as budget_for's plans are.
    Whether a plan offloads turns on the measured peaks of the layers' backward, which the
    CPU meter reads as Python frees tensors (garbage collection moves them between runs of a
    whole test file), so a test that expects budget_for's plan asks for this."""
    import ckpt_offload.budget

    monkeypatch.setattr(ckpt_offload.budget, "HOST_COPY_BYTES_PER_SECOND", 0)


def budget_for(measured, tokens, resident, selective=0):
    """memory_budget: the smallest budget that the step fits with every layer checkpointed
    and whose plan at `tokens` runs at least `resident` layers resident and `selective`
    selective. (The layers not checkpointed only grow in number with the budget, selective
    ones may turn resident: the budget is the smallest with enough of them whose plan has
    enough selective ones.)"""
    layers = len(measured.layers)
    for needed in range(resident + selective, layers + 1):
        def enough(plan):
            return (plan.count(RESIDENT) >= resident
                    and plan.count(CHECKPOINT) <= layers - needed)

        low, high = checkpointed_peak(measured, tokens), 1 << 40
        while low < high:
            middle = (low + high) // 2
            if enough(plan_layers(measured, tokens, middle)):
                high = middle
            else:
                low = middle + 1
        if plan_layers(measured, tokens, low).count(SELECTIVE) >= selective:
            return low
    raise AssertionError(f"no budget plans {resident} resident and {selective} selective "
                         f"layers")
