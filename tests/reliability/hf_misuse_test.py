"""Bad input and misuse of ckpt_offload.hf (enable_activation_offload,
ActivationOffloadCallback), through the public API only: every failure is a clear error and
leaves the model exactly as it was (nothing half-installed)."""

import pytest
import torch
from torch import nn
from transformers import TrainerControl, TrainerState, TrainingArguments

import ckpt_offload
from ckpt_offload.hf import ActivationOffloadCallback, enable_activation_offload
from hf_tiny import batch, tiny_llama
from reliability_util import fresh_host_config, saved_tensor_hooks_active

def snapshot(model):
    """Every module's own attributes by identity (hooks, checkpoint functions, forward,
    flags), its hook dictionaries' entries, and the parameters' values."""
    modules = {}
    for name, module in model.named_modules():
        attrs = {key: id(value) for key, value in module.__dict__.items()}
        hook_dicts = {key: tuple((k, id(v)) for k, v in value.items())
                      for key, value in module.__dict__.items()
                      if key.endswith("hooks") and isinstance(value, dict)}
        modules[name] = (type(module), attrs, hook_dicts)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return modules, params


def assert_untouched(model, before):
    modules, params = snapshot(model)
    assert modules == before[0]
    assert params.keys() == before[1].keys()
    for name in params:
        assert torch.equal(params[name], before[1][name]), name
    assert not saved_tensor_hooks_active()
    assert ckpt_offload.current_engine() is None


def one_step_loss(model):
    model.zero_grad(set_to_none=True)
    loss = model(**batch()).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


BAD_OVERRIDES = [
    (dict(keep_last=-1), "keep_last", "accepted: an int from 0"),
    (dict(keep_last=True), "keep_last", "accepted: an int from 0"),
    (dict(prefetch_depth=2.0), "prefetch_depth", "accepted: an int from 0"),
    (dict(max_inflight_d2h_groups=0), "max_inflight_d2h_groups", "accepted: an int from 1"),
    (dict(host_memory_limit="12XB"), "host_memory_limit", "a size string like '24GiB'"),
    (dict(host_memory_limit=1.01), "host_memory_limit", "a fraction of RAM in (0, 1]"),
    (dict(backend="tpu"), "backend", "('auto', 'cuda', 'host')"),
    (dict(scope="layers"), "scope", "('checkpoint_inputs', 'all')"),
]


@pytest.mark.parametrize("overrides, field, accepted", BAD_OVERRIDES,
                         ids=[f"{f}" + str(i) for i, (_, f, _) in enumerate(BAD_OVERRIDES)])
def test_bad_settings_raise_before_anything_is_installed(overrides, field, accepted):
    model = tiny_llama()
    before = snapshot(model)
    for make in (lambda: enable_activation_offload(model, **overrides),
                 lambda: ActivationOffloadCallback(**overrides)):
        with pytest.raises(ValueError) as caught:
            make()
        message = str(caught.value)
        assert message.startswith(f"{field}:") and accepted in message, message
        assert_untouched(model, before)


def test_model_without_checkpointing_layers_is_rejected_untouched():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    before = snapshot(model)
    with pytest.raises(ValueError,
                       match="contains no transformers.modeling_layers.GradientCheckpointingLayer"):
        enable_activation_offload(model, **fresh_host_config())
    assert_untouched(model, before)
    callback = ActivationOffloadCallback(**fresh_host_config())
    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="GradientCheckpointingLayer"):
        callback.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
    assert callback.handle is None
    assert_untouched(model, before)


def test_installing_twice_is_refused_and_the_first_installation_keeps_working():
    reference = one_step_loss(tiny_llama())
    model = tiny_llama()
    before = snapshot(model)
    first = enable_activation_offload(model, **fresh_host_config(keep_last=1))
    installed = snapshot(model)
    with pytest.raises(RuntimeError, match="already installed.*call disable"):
        enable_activation_offload(model, **fresh_host_config(keep_last=0))
    callback = ActivationOffloadCallback(**fresh_host_config())
    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    with pytest.raises(RuntimeError, match="already installed"):
        callback.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
    assert callback.handle is None
    assert snapshot(model)[0] == installed[0]
    loss, got = one_step_loss(model)
    assert torch.equal(loss, reference[0])
    assert all(torch.equal(got[n], reference[1][n]) for n in got)
    # 4 layers, keep_last=1, the kept one released by the LM head's offloaded tensor.
    assert first.stats()["offloaded_tensors"] == 4
    first.disable()
    first.disable()  # documented as idempotent
    assert_untouched(model, (before[0], snapshot(model)[1]))


class InstallFailure(RuntimeError):
    pass


def test_failure_midway_through_installation_leaves_the_model_untouched():
    model = tiny_llama()
    # A layer that refuses its new checkpoint function: the installation has patched the
    # layers before it when this raises.
    hostile = model.model.layers[2]
    base = type(hostile)

    def refuse(self, name, value):
        ours = type(value).__module__.startswith("ckpt_offload")
        if name == "_gradient_checkpointing_func" and ours:
            raise InstallFailure("this layer refuses new checkpoint functions")
        base.__setattr__(self, name, value)

    hostile.__class__ = type("HostileLayer", (base,), {"__setattr__": refuse})
    before = snapshot(model)
    with pytest.raises(InstallFailure):
        enable_activation_offload(model, **fresh_host_config())
    assert_untouched(model, before)
    # And the model still trains as it did (plain checkpointing).
    hostile.__class__ = base
    reference = one_step_loss(tiny_llama())
    loss, got = one_step_loss(model)
    assert torch.equal(loss, reference[0])


def test_checkpointing_off_is_turned_on_and_disable_turns_it_off_again():
    # Documented: installing on a model without checkpointing turns it on (non-reentrant)
    # and disable() puts every flag and function back.
    model = tiny_llama(checkpointing=False)
    before = snapshot(model)
    handle = enable_activation_offload(model, **fresh_host_config(keep_last=0))
    model.zero_grad(set_to_none=True)
    model(**batch()).loss.backward()
    assert handle.stats()["offloaded_tensors"] == 4
    handle.disable()
    assert_untouched(model, (before[0], snapshot(model)[1]))
