"""Bad input and misuse of ckpt_offload.hf (enable_activation_offload,
ActivationOffloadCallback), through the public API only: every failure is a clear error and
leaves the model exactly as it was (nothing half-installed)."""

import gc
import warnings

import pytest
import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

import ckpt_offload
from ckpt_offload.hf import (ActivationOffloadCallback, disable_activation_offload,
                             enable_activation_offload)
from hf_tiny import TokenDataset, batch, tiny_llama, training_args
from reliability_util import ckpt_offload_objects, fresh_host_config, saved_tensor_hooks_active

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


# ---------------------------------------------------------------------------------------
# A train() that raises, and the retry after it


class Boom(Exception):
    pass


class Fault(TrainerCallback):
    """Raises Boom once, in the second step: from a layer's forward, from the LM head's
    backward, from on_step_end; or from on_train_begin (after the offload callback
    installed). Its hooks are registered on the model before any snapshot is taken."""

    def __init__(self, model, where, offload_callback=None):
        self.where = where
        self.armed = False
        self.raised = None
        self.offload_callback = offload_callback
        self.handles = []  # the offload callback's handle at each step
        model.model.layers[2].mlp.register_forward_pre_hook(self._hook)
        model.lm_head.register_full_backward_pre_hook(self._backward_hook)

    def _raise(self):
        self.armed = False
        self.raised = Boom(f"injected in {self.where}")
        raise self.raised

    def _hook(self, module, inputs):
        if self.armed and self.where == "layer forward":
            self._raise()

    def _backward_hook(self, module, grad_output):
        if self.armed and self.where == "backward":
            self._raise()

    def on_train_begin(self, args, state, control, **kwargs):
        if self.where == "on_train_begin":
            self._raise()

    def on_step_begin(self, args, state, control, **kwargs):
        self.armed = state.global_step == 1 and self.raised is None
        if self.offload_callback is not None:
            self.handles.append(self.offload_callback.handle)

    def on_step_end(self, args, state, control, **kwargs):
        if self.armed and self.where == "on_step_end":
            self._raise()


class Snapshot(TrainerCallback):
    """Put first: snapshot() of the model as the Trainer prepared it, before any install."""

    def __init__(self):
        self.before = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.before is None:
            self.before = snapshot(model)


def make_trainer(model, tmp_path, callbacks=(), registration="callbacks", first=(),
                 **arg_overrides):
    """A Trainer on `model`; the offload callbacks among `callbacks` are registered as
    `registration` says (Trainer(callbacks=...), attach, or add_callback); `first` go in
    front of every callback."""
    offload = [c for c in callbacks if isinstance(c, ActivationOffloadCallback)]
    others = [c for c in callbacks if c not in offload]
    trainer = Trainer(model=model, args=training_args(tmp_path, **arg_overrides),
                      train_dataset=TokenDataset(),
                      callbacks=others + (offload if registration == "callbacks" else []))
    for callback in offload:
        if registration == "attach":
            callback.attach(trainer)
        elif registration == "add_callback":
            trainer.add_callback(callback)
    for callback in reversed(first):
        trainer.callback_handler.callbacks.insert(0, callback)
    return trainer


# Where train() raises, and how the offload callback was registered.
FAILURES = [("layer forward", "callbacks"), ("layer forward", "attach"), ("backward", "attach"),
            ("on_step_end", "callbacks"), ("on_train_begin", "callbacks")]


@pytest.mark.parametrize("where, registration", FAILURES)
def test_failed_train_uninstalls_and_leaves_the_model_as_before(tmp_path, where, registration):
    model = tiny_llama()
    callback = ActivationOffloadCallback(**fresh_host_config(keep_last=0))
    fault = Fault(model, where, callback)
    first = Snapshot()
    trainer = make_trainer(model, tmp_path, [callback, fault], registration, first=[first],
                           max_steps=2)

    with pytest.raises(Boom) as caught:
        trainer.train()

    assert caught.value is fault.raised  # the exception itself, unchanged
    assert callback.handle is None and ckpt_offload_objects(model) == []
    # An exception inside a non-reentrant checkpoint leaves torch's checkpoint generator
    # (and its saved-tensor hooks) open until the traceback goes, with or without offload.
    del caught
    fault.raised = None
    gc.collect()
    assert_untouched(model, (first.before[0], snapshot(model)[1]))
    if where != "on_train_begin":
        handle = fault.handles[0]
        assert handle is not None and not handle.installed
        # Every offloaded block is back in the pool once the failed step's graph is gone.
        assert handle.stats()["host_live_bytes"] == 0


def train_losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def fail_then_retry(tmp_path, registration=None, checkpointing_by_trainer=True):
    """train() raising in its second step (layer forward), then train() of a new Trainer
    with a new offload callback on the same model (no offload when registration is None).
    Returns the model, the retry's losses and what the failure left on the model."""
    model = tiny_llama()
    fault = Fault(model, "layer forward")
    before = Snapshot()
    settings = dict(gradient_checkpointing=checkpointing_by_trainer)
    first = [ActivationOffloadCallback(**fresh_host_config())] if registration else []
    failing = make_trainer(model, tmp_path / "failed", first + [fault], registration or "callbacks",
                           first=[before], **settings)
    with pytest.raises(Boom):
        failing.train()
    fault.raised = None  # the traceback holds torch's open checkpoint (see above)
    gc.collect()
    left = ckpt_offload_objects(model)
    retry = [ActivationOffloadCallback(**fresh_host_config())] if registration else []
    trainer = make_trainer(model, tmp_path / "retry", retry, **settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    replaced = [str(w.message) for w in caught if "failed train() left" in str(w.message)]
    return model, before.before, train_losses(trainer), left, replaced, retry


@pytest.mark.parametrize("checkpointing_by_trainer", [True, False])
@pytest.mark.parametrize("registration", ["add_callback", "callbacks"])
def test_retry_with_a_new_callback_after_a_failed_train(tmp_path, registration,
                                                        checkpointing_by_trainer):
    plain_model, _, plain_losses, _, _, _ = fail_then_retry(
        tmp_path / "plain", None, checkpointing_by_trainer)
    model, before, losses, left, replaced, retry = fail_then_retry(
        tmp_path / "offload", registration, checkpointing_by_trainer)

    if registration == "add_callback":
        # Added after the Trainer was made, the callback is first called inside train(),
        # too late to guard it: the failure leaves the installation, and the next install
        # replaces it (with a warning).
        assert left and len(replaced) == 1
    else:
        assert left == [] and replaced == []
    assert losses == plain_losses and len(losses) == 4
    for name, param in model.named_parameters():
        assert torch.equal(param, dict(plain_model.named_parameters())[name]), name
    assert retry[0].final_totals["offloaded_tensors"] == 4 * 4
    assert ckpt_offload_objects(model) == []
    if not checkpointing_by_trainer:
        # The Trainer left checkpointing alone (the model has it on): exactly as before.
        assert_untouched(model, (before[0], snapshot(model)[1]))
    else:
        # The Trainer enabled checkpointing anew for each train(): its objects, not ours,
        # and the same hooks as the run without offload.
        assert "forward" not in model.__dict__
        embeddings, plain_embeddings = (m.get_input_embeddings() for m in (model, plain_model))
        assert ([h.__qualname__ for h in embeddings._forward_hooks.values()]
                == [h.__qualname__ for h in plain_embeddings._forward_hooks.values()])


def test_lost_handle_is_uninstalled_from_the_model():
    model = tiny_llama()
    before = snapshot(model)
    enable_activation_offload(model, **fresh_host_config())  # the handle is dropped
    assert len(ckpt_offload_objects(model)) > 0
    assert disable_activation_offload(model) == 1
    assert disable_activation_offload(model) == 0
    assert_untouched(model, before)
