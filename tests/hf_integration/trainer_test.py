"""ActivationOffloadCallback with transformers.Trainer on a tiny Llama (CPU, host backend):
training is bit-identical to plain non-reentrant checkpointing, figures reach the logs, and
the model is exactly as before once training ends."""

import logging

import pytest
import torch
from transformers import TrainerCallback

from ckpt_offload.hf import ActivationOffloadCallback
from tiny import (HOST, Probe, TokenDataset, assert_same_weights, checkpoint_funcs, tiny_llama,
                  tiny_lora, train)

OFFLOAD_KEYS = (
    "offload/offloaded_gib", "offload/offloaded_tensors", "offload/kept_resident_tensors",
    "offload/prefetched_tensors", "offload/exposed_wait_ms", "offload/cap_fallbacks",
    "offload/host_pool_gib", "offload/host_peak_gib", "offload/pinned_allocations",
)
LAYERS = 4


def train_pair(make_model, tmp_path, keep_last=1, **arg_overrides):
    """The same run without and with the callback: (plain, offloaded) results."""
    plain_model = make_model()
    _, plain_losses = train(plain_model, tmp_path / "plain", **arg_overrides)
    model = make_model()
    callback = ActivationOffloadCallback(keep_last=keep_last, **HOST)
    probe = Probe(callback)
    trainer, losses = train(model, tmp_path / "offload", callbacks=[callback], probe=probe,
                            **arg_overrides)
    return (plain_model, plain_losses), (model, losses, trainer, callback, probe)


def assert_restored(model, probe):
    """forward and every module's checkpoint function are the objects from before."""
    assert model.__dict__.get("forward") is probe.begin_forward_attr
    assert model.forward == probe.begin_forward
    after = checkpoint_funcs(model)
    assert after.keys() == probe.begin_funcs.keys()
    for name, func in probe.begin_funcs.items():
        assert after[name] is func, name


def train_logs(trainer):
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_trainer_bit_identical_with_offload_figures_and_restored_model(tmp_path, attn):
    (plain_model, plain_losses), (model, losses, trainer, callback, probe) = train_pair(
        lambda: tiny_llama(attn=attn), tmp_path)

    assert losses == plain_losses and len(losses) == 4
    assert_same_weights(plain_model, model)
    for entry in train_logs(trainer):
        assert all(key in entry for key in OFFLOAD_KEYS), entry
        # 4 layers, the last one kept resident: 3 hidden states offloaded per step.
        assert entry["offload/offloaded_tensors"] == LAYERS
        assert entry["offload/kept_resident_tensors"] == 0
        assert entry["offload/offloaded_gib"] > 0
        assert entry["offload/cap_fallbacks"] == 0
    offloaded = [totals["offloaded_tensors"] for totals in probe.step_totals]
    assert offloaded == [4, 8, 12, 16]
    assert callback.final_totals["restored_tensors"] == 4 * LAYERS
    assert callback.final_totals["host_live_bytes"] == 0
    assert callback.handle is None
    assert_restored(model, probe)


def test_lora_with_tied_embeddings(tmp_path):
    def make_model():
        return tiny_lora(tiny_llama(tied=True))

    (plain_model, plain_losses), (model, losses, trainer, callback, probe) = train_pair(
        make_model, tmp_path)

    assert losses == plain_losses
    assert_same_weights(plain_model, model)
    assert model.base_model.model.lm_head.weight is model.base_model.model.model.embed_tokens.weight
    for entry in train_logs(trainer):
        # With frozen embeddings, peft and the Trainer call enable_input_require_grads, whose
        # hook would make the first layer's input a leaf held by autograd until backward;
        # the installation swaps that hook, so every layer but the kept one is offloaded.
        assert entry["offload/offloaded_tensors"] == LAYERS
        assert entry["offload/kept_resident_tensors"] == 0
    assert_restored(model, probe)


def test_gradient_accumulation_counts_each_micro_batch(tmp_path):
    (plain_model, plain_losses), (model, losses, trainer, callback, probe) = train_pair(
        tiny_llama, tmp_path, gradient_accumulation_steps=2)

    assert losses == plain_losses
    assert_same_weights(plain_model, model)
    # Two micro-batches, each its own engine step, per optimizer step.
    assert [t["micro_steps"] for t in probe.step_totals] == [2, 4, 6, 8]
    assert [t["offloaded_tensors"] for t in probe.step_totals] == [8, 16, 24, 32]
    for entry in train_logs(trainer):
        assert entry["offload/offloaded_tensors"] == 2 * LAYERS
        assert entry["offload/kept_resident_tensors"] == 0
    assert_restored(model, probe)


class EvalWatcher(TrainerCallback):
    """Offload totals just before and after each evaluation."""

    def __init__(self, offload_callback):
        self.offload_callback = offload_callback
        self.before = []
        self.after = []

    def on_step_end(self, args, state, control, **kwargs):
        self.before.append(self.offload_callback.handle.totals())

    def on_evaluate(self, args, state, control, **kwargs):
        self.after.append((len(self.before), self.offload_callback.handle.totals()))


def test_evaluation_during_training_offloads_nothing(tmp_path):
    common = dict(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2)
    plain_model = tiny_llama()
    plain_trainer, plain_losses = train(plain_model, tmp_path / "plain",
                                        eval_dataset=TokenDataset(count=4, seed=7), **common)
    model = tiny_llama()
    callback = ActivationOffloadCallback(keep_last=1, **HOST)
    watcher = EvalWatcher(callback)
    probe = Probe(callback)
    trainer, losses = train(model, tmp_path / "offload", callbacks=[callback, watcher],
                            probe=probe,
                            eval_dataset=TokenDataset(count=4, seed=7), **common)

    assert losses == plain_losses
    assert_same_weights(plain_model, model)
    plain_evals = [e["eval_loss"] for e in plain_trainer.state.log_history if "eval_loss" in e]
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert [e["eval_loss"] for e in evals] == plain_evals and len(evals) == 2
    assert all(not any(k.startswith("offload/") for k in e) for e in evals)
    assert len(watcher.after) == 2
    for steps_done, totals in watcher.after:
        # The evaluation after step k left the totals as step k left them.
        assert totals == watcher.before[steps_done - 1]
    assert_restored(model, probe)


def test_reentrant_request_is_changed_with_a_warning(tmp_path):
    model = tiny_llama()
    callback = ActivationOffloadCallback(keep_last=1, **HOST)
    probe = Probe(callback)
    with pytest.warns(UserWarning, match="use_reentrant=False"):
        trainer, losses = train(model, tmp_path, callbacks=[callback], probe=probe,
                                gradient_checkpointing_kwargs={"use_reentrant": True})
    assert callback.final_totals["offloaded_tensors"] == 4 * LAYERS
    # Afterwards the Trainer's own (reentrant) checkpoint functions are back.
    assert_restored(model, probe)
    assert all(f.keywords == {"use_reentrant": True} for f in probe.begin_funcs.values())


def test_checkpointing_turned_on_when_off_and_off_again_after(tmp_path, caplog):
    plain_model = tiny_llama()
    _, plain_losses = train(plain_model, tmp_path / "plain", gradient_checkpointing=False)
    model = tiny_llama()
    flags_before = checkpointing_flags(model)
    callback = ActivationOffloadCallback(keep_last=1, **HOST)
    probe = Probe(callback)
    with caplog.at_level(logging.WARNING, logger="ckpt_offload.hf"):
        trainer, losses = train(model, tmp_path / "offload", callbacks=[callback], probe=probe,
                                gradient_checkpointing=False)
    assert "turned it on" in caplog.text
    assert losses == plain_losses
    assert_same_weights(plain_model, model)
    assert callback.final_totals["offloaded_tensors"] == 4 * LAYERS
    assert probe.begin_funcs == {}
    assert checkpoint_funcs(model) == {}
    assert not model.is_gradient_checkpointing
    assert checkpointing_flags(model) == flags_before
    assert "_require_grads_hooks" not in model.__dict__
    assert not model.get_input_embeddings()._forward_hooks
    assert "forward" not in model.__dict__


def checkpointing_flags(model):
    return {name: module.__dict__.get("gradient_checkpointing", "absent")
            for name, module in model.named_modules()}


class LogRecorder(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_attach_puts_figures_in_front_of_earlier_callbacks(tmp_path):
    from transformers import Trainer

    from tiny import training_args

    reporter = LogRecorder()  # stands in for a report_to integration, registered first
    trainer = Trainer(model=tiny_llama(), args=training_args(tmp_path, max_steps=2),
                      train_dataset=TokenDataset(), callbacks=[reporter])
    callback = ActivationOffloadCallback(keep_last=1, **HOST).attach(trainer)
    assert trainer.callback_handler.callbacks[0] is callback
    trainer.train()
    step_logs = [log for log in reporter.logs if "loss" in log]
    assert len(step_logs) == 2
    assert all(log["offload/offloaded_tensors"] == LAYERS for log in step_logs)


class TrackerStandIn(LogRecorder):
    """Registered as a report_to integration (made by the Trainer from its name, like
    wandb or tensorboard): records every log it is given."""

    made = []

    def __init__(self):
        super().__init__()
        TrackerStandIn.made.append(self)


@pytest.mark.parametrize("registration", ["callbacks", "add_callback", "attach"])
def test_figures_reach_report_to_integrations_and_earlier_callbacks(tmp_path, monkeypatch,
                                                                    registration):
    from transformers import Trainer
    from transformers.integrations import integration_utils

    from tiny import training_args

    monkeypatch.setitem(integration_utils.INTEGRATION_TO_CALLBACK, "stand_in", TrackerStandIn)
    TrackerStandIn.made.clear()
    user_logger = LogRecorder()  # a user's callback, listed before the offload callback
    callback = ActivationOffloadCallback(keep_last=1, **HOST)
    trainer = Trainer(
        model=tiny_llama(), args=training_args(tmp_path, max_steps=2, report_to=["stand_in"]),
        train_dataset=TokenDataset(),
        callbacks=[user_logger] + ([callback] if registration == "callbacks" else []))
    if registration == "add_callback":
        trainer.add_callback(callback)
    elif registration == "attach":
        callback.attach(trainer)
    (tracker,) = TrackerStandIn.made
    callbacks = trainer.callback_handler.callbacks
    assert callbacks.index(tracker) < callbacks.index(user_logger)  # the Trainer's order
    trainer.train()

    assert callbacks[0] is callback
    for recorder in (tracker, user_logger):
        step_logs = [log for log in recorder.logs if "loss" in log]
        assert len(step_logs) == 2
        assert all(log["offload/offloaded_tensors"] == LAYERS for log in step_logs), step_logs
    # Once per Trainer: a second train() neither reorders nor wraps train() again.
    guarded = trainer.train
    trainer.train()
    assert trainer.train is guarded and callbacks.count(callback) == 1


def test_bad_override_fails_before_training():
    with pytest.raises(ValueError, match="keep_last"):
        ActivationOffloadCallback(keep_last=-1)
    with pytest.raises(ValueError, match="host_memory_limit"):
        ActivationOffloadCallback(host_memory_limit="lots")
    with pytest.raises(ValueError, match="unknown OffloadConfig field"):
        ActivationOffloadCallback(keep_lats=1)


def test_second_offload_callback_is_a_clear_error_and_leaves_the_model_as_before(tmp_path):
    model = tiny_llama()
    first = ActivationOffloadCallback(**HOST)
    second = ActivationOffloadCallback(**HOST)
    probe = Probe()
    with pytest.raises(RuntimeError, match="already installed.*register one per Trainer"):
        train(model, tmp_path, callbacks=[first, second], probe=probe)
    # train() raised, so each callback uninstalled what it had installed.
    assert first.handle is None and second.handle is None
    assert "forward" not in model.__dict__
    assert checkpoint_funcs(model) == probe.begin_funcs


def test_train_twice_with_one_callback(tmp_path):
    from transformers import Trainer

    from tiny import training_args

    model = tiny_llama()
    callback = ActivationOffloadCallback(keep_last=1, **HOST)
    trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=2),
                      train_dataset=TokenDataset(), callbacks=[callback])
    trainer.train()
    first = callback.final_totals
    trainer.train()
    assert first["offloaded_tensors"] == callback.final_totals["offloaded_tensors"] == 2 * LAYERS
    assert "forward" not in model.__dict__
    assert torch.is_grad_enabled()
