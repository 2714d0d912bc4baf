"""ActivationOffloadCallback with TRL's RL and preference trainers (trl, pinned in
requirements/lock.txt) on tiny Llamas (CPU, host backend).

Each trainer runs its reference, old-policy or KL forwards inside
trl.models.utils.disable_gradient_checkpointing() (gradient_checkpointing_disable, a
forward under no_grad, gradient_checkpointing_enable), which gives every layer a fresh
checkpoint function; GRPO and RLOO also generate between steps. For each trainer, with
and without the callback: losses and every gradient bit-identical, every offloaded layer
input prefetched on every step, the profiled step's layer recompute seen by the peak
breakdown, and nothing of ckpt_offload left on the model after training."""

import functools
import itertools

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch import nn
from transformers import PreTrainedTokenizerFast, TrainerCallback

import trl
from ckpt_offload.hf import ActivationOffloadCallback, layer_budget
from ckpt_offload.hf.install import installations
from tiny import HOST, budget_for, keep_outputs_on_device, tiny_llama, tiny_lora

STEPS = 3


@functools.lru_cache(maxsize=None)
def tokenizer():
    """Character-level, with tiny_llama's special ids (pad 0, bos 1, eos 2)."""
    words = ["<pad>", "<s>", "</s>", "<unk>"] + [chr(c) for c in range(32, 127)]
    inner = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)},
                                       unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    inner.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")


PROMPTS = [f"q{i}: how many {'ab'[i % 2]}?" for i in range(8)]


def preference_data():
    return Dataset.from_dict({
        "prompt": PROMPTS,
        "chosen": [f" {i} {'ab'[i % 2]}s." for i in range(8)],
        "rejected": [f" none at all {i}" for i in range(8)],
    })


def unpaired_data():
    return Dataset.from_dict({
        "prompt": PROMPTS,
        "completion": [f" {i} {'ab'[i % 2]}s." if i % 2 else f" no idea {i}" for i in range(8)],
        "label": [bool(i % 2) for i in range(8)],
    })


def prompt_data():
    return Dataset.from_dict({"prompt": PROMPTS})


def count_a(completions, **kwargs):
    """A reward that differs between completions, so that the advantages are not zero."""
    return [float(text.count("a")) - 0.1 * len(text) for text in completions]


COMMON = dict(
    max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-3, logging_steps=1,
    save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
    dataloader_num_workers=0, gradient_checkpointing=True,
    gradient_checkpointing_kwargs={"use_reentrant": False}, disable_tqdm=True, bf16=False)

GENERATION = dict(num_generations=2, max_completion_length=8, beta=0.04)


def dpo(model, args, ref_model=None):
    return trl.DPOTrainer(model=model, ref_model=ref_model, args=trl.DPOConfig(**args),
                          train_dataset=preference_data(), processing_class=tokenizer())


def dpo_ref_model(model, args):
    return dpo(model, args, ref_model=tiny_llama(seed=0))


def kto(model, args):
    return trl.KTOTrainer(model=model, args=trl.KTOConfig(**args),
                          train_dataset=unpaired_data(), processing_class=tokenizer())


def grpo(model, args):
    return trl.GRPOTrainer(model=model, reward_funcs=count_a,
                           args=trl.GRPOConfig(**GENERATION, **args),
                           train_dataset=prompt_data(), processing_class=tokenizer())


def rloo(model, args):
    return trl.RLOOTrainer(model=model, reward_funcs=count_a,
                           args=trl.RLOOConfig(**GENERATION, **args),
                           train_dataset=prompt_data(), processing_class=tokenizer())


def lora():
    return tiny_lora(tiny_llama())


# (trainer, model): DPO with the adapter-disabled base as its reference and with a separate
# reference model, KTO (reference and KL forwards), GRPO and RLOO (generation, then the
# reference forward, before every step).
CASES = {
    "dpo_lora": (dpo, lora),
    "dpo_ref_model": (dpo_ref_model, tiny_llama),
    "kto_lora": (kto, lora),
    "grpo_lora": (grpo, lora),
    "rloo_lora": (rloo, lora),
}


class Recorder(TrainerCallback):
    """Per optimizer step: the trainable parameters' gradients before the optimizer, and
    (with an offload callback) the engine figures of the step's micro-step."""

    def __init__(self, offload=None):
        self.offload = offload
        self.grads = []
        self.stats = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({name: param.grad.clone() for name, param in model.named_parameters()
                           if param.grad is not None})

    def on_step_end(self, args, state, control, **kwargs):
        if self.offload is not None:
            handle = self.offload.handle
            self.stats.append(dict(handle.stats(), layer_modes=handle.layer_modes(),
                                   measurement=handle._budget.measurement))


def train(case, tmp_path, offload, steps=STEPS, **options):
    make_trainer, make_model = CASES[case]
    model = make_model()
    trainer = make_trainer(model, dict(COMMON, output_dir=str(tmp_path), max_steps=steps))
    callback = ActivationOffloadCallback(keep_last=1, **HOST, **options) if offload else None
    recorder = Recorder(callback)
    trainer.add_callback(recorder)
    if callback is not None:
        callback.attach(trainer)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return model, losses, recorder, callback


def leftovers(model):
    """Objects of ckpt_offload's still on any module of `model` (attributes, hooks)."""
    found = []
    for name, module in model.named_modules():
        values = list(module.__dict__.values())
        for hooks in (module._forward_hooks, module._forward_pre_hooks,
                      module._backward_hooks, module._backward_pre_hooks):
            values.extend(hooks.values())
        for value in values:
            owner = getattr(type(value), "__module__", "") or ""
            if owner.startswith("ckpt_offload"):
                found.append((name, type(value).__name__))
    return found


def hook_names(model):
    return {name: [getattr(h, "__name__", type(h).__name__) for h in m._forward_hooks.values()]
            for name, m in model.named_modules() if m._forward_hooks}


@pytest.mark.parametrize("case", list(CASES))
def test_trl_trainer_keeps_prefetch_and_stays_bit_identical(case, tmp_path):
    plain_model, plain_losses, plain, _ = train(case, tmp_path / "plain", offload=False)
    model, losses, recorder, callback = train(case, tmp_path / "offload", offload=True)

    assert len(losses) == STEPS and losses == plain_losses
    assert len(recorder.grads) == len(plain.grads) == STEPS
    for step, (ref, got) in enumerate(zip(plain.grads, recorder.grads)):
        assert ref.keys() == got.keys() and ref
        for name in ref:
            assert torch.equal(ref[name], got[name]), (step, name)
    for ref, got in zip(plain_model.parameters(), model.parameters()):
        assert torch.equal(ref, got)

    layers = model.config.num_hidden_layers
    for step, stats in enumerate(recorder.stats):
        # Every layer input offloaded came back through a prefetch, on every step (the
        # helper's toggles before a step would leave all but one to be waited for).
        assert stats["offloaded_tensors"] == layers, (step, stats)
        assert stats["prefetched_tensors"] == stats["restored_tensors"] == layers, (step, stats)
        assert stats["cap_fallbacks"] == 0
    # The profiled step (the second, after the helper's toggles) saw the layers' recompute.
    breakdown = callback.peak_breakdown
    assert breakdown is not None and breakdown["layer_recompute_bytes"] > 0, breakdown

    assert callback.handle is None and not installations(model)
    assert leftovers(model) == []
    assert not isinstance(model.__dict__.get("forward"), nn.Module)
    assert hook_names(model) == hook_names(plain_model)
    # The checkpoint functions are those the trainer set last, as in the plain run.
    funcs = {n: m.__dict__.get("_gradient_checkpointing_func") for n, m in model.named_modules()}
    plain_funcs = {n: m.__dict__.get("_gradient_checkpointing_func")
                   for n, m in plain_model.named_modules()}
    assert funcs.keys() == plain_funcs.keys()
    for name, func in funcs.items():
        plain_func = plain_funcs[name]
        assert type(func) is type(plain_func), name
        if isinstance(func, functools.partial):
            assert (func.func, func.args, func.keywords) == (
                plain_func.func, plain_func.args, plain_func.keywords), name


@pytest.mark.parametrize("case", list(CASES))
def test_trl_trainer_with_a_memory_budget_stays_bit_identical(case, tmp_path, monkeypatch):
    """memory_budget under each trainer's toggles and varying lengths: with every layer
    resident, and with a budget that makes layers selective, losses and gradients match the
    run without offload; every training step is timed (its backward reaches its outputs)."""
    ticks = itertools.count()  # a clock that ticks per reading: the same plans every run
    monkeypatch.setattr(layer_budget, "_clock", lambda: float(next(ticks)))
    steps = 5  # measured at step 2, planned from step 3
    _, plain_losses, plain, _ = train(case, tmp_path / "plain", offload=False, steps=steps)

    _, losses, recorder, _ = train(case, tmp_path / "all", offload=True, steps=steps,
                                   memory_budget="1TiB")
    measured = recorder.stats[-1]["measurement"]
    layers = len(measured.layers)
    plans = [s["layer_modes"] for s in recorder.stats[2:]]
    assert plans == [["resident"] * layers] * (steps - 2)
    # Each step's backward ends its time: the measured step's and every planned one's.
    assert measured.step_seconds > 0
    assert [s["budget_measured_steps"] for s in recorder.stats[2:]] == list(range(1, steps - 1))
    runs = [(losses, recorder)]

    keep_outputs_on_device(monkeypatch)
    budget = budget_for(measured, measured.tokens, resident=0, selective=2)
    _, losses, recorder, _ = train(case, tmp_path / "some", offload=True, steps=steps,
                                   memory_budget=budget)
    assert any("selective" in s["layer_modes"] for s in recorder.stats[2:]), recorder.stats
    runs.append((losses, recorder))

    for losses, recorder in runs:
        assert losses == plain_losses
        for step, (ref, got) in enumerate(zip(plain.grads, recorder.grads, strict=True)):
            assert ref.keys() == got.keys() and ref
            for name in ref:
                assert torch.equal(ref[name], got[name]), (step, name)
