"""Copies of a model while ckpt_offload is installed on it: copy.deepcopy (reference models,
EMA teachers) and torch.save/torch.load of the whole model. A copy is the model without
ckpt_offload: it trains bit-identically to the original, with its own weights, and never
touches the original's engine; the original keeps offloading."""

import copy
import inspect
import subprocess
import sys
import textwrap

import pytest
import torch

from ckpt_offload.hf import ActivationOffloadCallback, enable_activation_offload, installations
from hf_tiny import TokenDataset, batch, tiny_llama, training_args
from reliability_util import ckpt_offload_objects, fresh_host_config

LAYERS = 4


def one_step(model):
    """Loss and every parameter's gradient of one forward and backward."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch()).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def assert_identical(a, b):
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys() and len(a[1]) > 0
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


def lora_llama():
    from tiny import tiny_lora

    return tiny_lora(tiny_llama())


@pytest.mark.parametrize("make", [tiny_llama, lora_llama], ids=["llama", "lora"])
def test_deepcopy_trains_bit_identically_with_its_own_weights(make):
    reference = one_step(make())
    model = make()
    handle = enable_activation_offload(model, **fresh_host_config(keep_last=0))
    twin = copy.deepcopy(model)

    assert installations(twin) == [] and ckpt_offload_objects(twin) == []
    assert twin.forward.__self__ is twin  # the copy's forward is bound to the copy
    assert inspect.signature(twin.forward) == inspect.signature(model.forward)
    assert_identical(one_step(model), reference)
    assert handle.stats()["offloaded_tensors"] == LAYERS
    micro_steps = handle.totals()["micro_steps"]
    original_grads = {n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None}

    assert_identical(one_step(twin), reference)
    # The copy's step ran neither the original's engine nor its parameters.
    assert handle.totals()["micro_steps"] == micro_steps
    for name, param in model.named_parameters():
        if param.grad is not None:
            assert torch.equal(param.grad, original_grads[name]), name

    # Training the copy changes the copy only; the original still offloads, as before.
    with torch.no_grad():
        for param in twin.parameters():
            param.add_(0.01)
    changed = one_step(twin)
    assert not torch.equal(changed[0], reference[0])
    assert_identical(one_step(model), reference)
    assert handle.stats()["offloaded_tensors"] == LAYERS
    assert handle.totals()["micro_steps"] == micro_steps + 1
    handle.disable()


def test_deepcopy_when_checkpointing_was_turned_on_by_the_installation():
    # Documented: the copy keeps the non-reentrant checkpointing that ckpt_offload turned on.
    reference = one_step(tiny_llama(checkpointing=False))
    model = tiny_llama(checkpointing=False)
    handle = enable_activation_offload(model, **fresh_host_config(keep_last=0))
    twin = copy.deepcopy(model)
    handle.disable()
    assert not model.is_gradient_checkpointing
    assert twin.is_gradient_checkpointing and ckpt_offload_objects(twin) == []
    for layer in twin.model.layers:
        assert layer._gradient_checkpointing_func.keywords == {"use_reentrant": False}
    assert_identical(one_step(twin), reference)


def test_teacher_copied_during_training(tmp_path):
    """An EMA-teacher-style callback deep-copies the model while the Trainer trains it (the
    offload callback installs first) and runs the copy each step."""
    from transformers import Trainer, TrainerCallback

    class Teacher(TrainerCallback):
        def __init__(self, offload_callback):
            self.offload_callback = offload_callback
            self.teacher = None
            self.engine_steps_during_teacher = []

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.teacher = copy.deepcopy(model)
            self.initial = {n: p.detach().clone() for n, p in model.named_parameters()}

        def on_step_end(self, args, state, control, **kwargs):
            handle = self.offload_callback.handle
            before = handle.totals()["micro_steps"]
            self.teacher.train()
            self.teacher(**batch()).loss.backward()
            self.engine_steps_during_teacher.append(handle.totals()["micro_steps"] - before)

    def run(offload):
        model = tiny_llama()
        callbacks = [ActivationOffloadCallback(**fresh_host_config())] if offload else []
        teacher = Teacher(callbacks[0]) if offload else None
        trainer = Trainer(model=model, args=training_args(tmp_path / str(offload)),
                          train_dataset=TokenDataset(),
                          callbacks=callbacks + ([teacher] if teacher else []))
        trainer.train()
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        return losses, trainer, teacher, callbacks

    plain_losses, _, _, _ = run(False)
    losses, trainer, teacher, (offload,) = run(True)
    assert losses == plain_losses and len(losses) == 4
    assert offload.final_totals["offloaded_tensors"] == 4 * LAYERS
    assert teacher.engine_steps_during_teacher == [0, 0, 0, 0]
    assert ckpt_offload_objects(teacher.teacher) == []
    for name, param in teacher.teacher.named_parameters():
        assert torch.equal(param, teacher.initial[name]), name  # untouched by training


LOAD_WITHOUT_CKPT_OFFLOAD = textwrap.dedent("""
    import sys
    import torch
    sys.modules["ckpt_offload"] = None  # importing it fails: the pickle must not need it
    model = torch.load(sys.argv[1], weights_only=False)
    inputs = torch.load(sys.argv[2])
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    torch.save({"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()},
                "modules": sorted({type(m).__module__ for m in model.modules()})}, sys.argv[3])
""")


def test_torch_save_loads_and_trains_where_ckpt_offload_is_not_importable(tmp_path):
    def make():
        model = tiny_llama()
        # transformers' own require-grads hook is a local function, which pickle refuses
        # with or without ckpt_offload (see the next test).
        model.disable_input_require_grads()
        return model

    reference = one_step(make())
    model = make()
    handle = enable_activation_offload(model, **fresh_host_config(keep_last=0))
    torch.save(model, tmp_path / "model.pt")
    torch.save(batch(), tmp_path / "batch.pt")
    result = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_CKPT_OFFLOAD, str(tmp_path / "model.pt"),
         str(tmp_path / "batch.pt"), str(tmp_path / "out.pt")],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    loaded = torch.load(tmp_path / "out.pt")
    assert_identical((loaded["loss"], loaded["grads"]), reference)
    assert not any(name.startswith("ckpt_offload") for name in loaded["modules"])
    # The original still offloads.
    assert_identical(one_step(model), reference)
    assert handle.stats()["offloaded_tensors"] == LAYERS
    handle.disable()


def test_torch_save_refusal_is_the_same_as_without_ckpt_offload(tmp_path):
    plain = tiny_llama()
    with pytest.raises(Exception) as without:
        torch.save(plain, tmp_path / "plain.pt")
    model = tiny_llama()
    handle = enable_activation_offload(model, **fresh_host_config())
    with pytest.raises(type(without.value)) as installed:
        torch.save(model, tmp_path / "installed.pt")
    assert str(installed.value) == str(without.value)
    assert "make_inputs_require_grads" in str(installed.value)
    handle.disable()
