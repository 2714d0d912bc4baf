"""Where a step's peak is (CPU, host backend): the breakdown of the profiled micro-step,
measured by the live-tensor meter, against tensor sizes worked out by hand, on a toy model
of known allocations and on tiny Llamas; and the Trainer callback's report of it."""

import logging

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import _get_current_dispatch_mode
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback
from transformers.integrations import integration_utils
from transformers.modeling_layers import GradientCheckpointingLayer

from ckpt_offload.hf import ActivationOffloadCallback, enable_activation_offload
from ckpt_offload.hf.peak import LiveTensorMeter
from tiny import HOST, TokenDataset, tiny_llama, training_args

FLOAT = 4
# Scalars (a loss, autograd's seed gradient) the meter counts beside the sized tensors.
SCALARS = 64
REPORT = "where the device-memory peak is"
PEAK_KEYS = ("offload/peak_step_gib", "offload/peak_head_loss_gib",
             "offload/peak_layer_recompute_gib", "offload/peak_hidden_states_kept_gib",
             "offload/peak_offload_removed_gib")
STAT_KEYS = ("peak_step_bytes", "peak_head_loss_bytes", "peak_layer_recompute_bytes",
             "peak_hidden_states_kept_bytes", "peak_offload_removed_bytes")


# The meter.


def test_meter_counts_new_storages_until_freed_in_forward_and_backward():
    floats = 1 << 16
    size = floats * FLOAT
    x = torch.randn(floats, requires_grad=True)  # made before the meter: not counted
    meter = LiveTensorMeter().start()
    try:
        a = torch.ones(floats)                           # + size
        view = a.view(256, -1)                           # a view: nothing new
        a.mul_(2)                                        # in place: nothing new
        b = torch.zeros(floats, dtype=torch.float64)     # + 2 size
        assert meter.now() == 3 * size
        del b
        assert meter.now() == size and meter.peak() == 3 * size
        meter.mark()
        assert meter.peak() == size
        # x * a (+ size, freed once exp has run), exp (+ size, saved for backward), sum.
        y = (x * a).exp()
        loss = y.sum()
        assert 3 * size <= meter.peak() < 3 * size + SCALARS
        assert 2 * size <= meter.now() < 2 * size + SCALARS
        meter.mark()
        # Backward: exp's gradient (+ size), then mul's (+ size, becomes x.grad) while the
        # first is alive, beside a and y.
        loss.backward()
        assert 4 * size <= meter.peak() < 4 * size + SCALARS
        assert 3 * size <= meter.now() < 3 * size + SCALARS  # a, y, x.grad
        del view, a, y, loss
        x.grad = None
        assert meter.now() < SCALARS
    finally:
        meter.stop()
        assert meter.remove()
    assert _get_current_dispatch_mode() is None


# A toy model whose allocations are known.

TOKENS, WIDTH = 256, 64
STATE = TOKENS * WIDTH * FLOAT  # one hidden state


class Scale(GradientCheckpointingLayer):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH))

    def forward(self, hidden):
        return hidden * self.weight


class KnownHead(torch.autograd.Function):
    """Saves a buffer of `floats` in forward; its backward holds two more at once."""

    @staticmethod
    def forward(ctx, hidden, floats):
        buffer = hidden.new_zeros(floats)
        ctx.save_for_backward(buffer)
        ctx.shape = hidden.shape
        return hidden.sum() + buffer.sum()

    @staticmethod
    def backward(ctx, grad):
        (buffer,) = ctx.saved_tensors
        scratch = torch.empty(2 * buffer.numel())
        del scratch
        return grad.expand(ctx.shape), None


class Toy(nn.Module):
    def __init__(self, layers, head_floats):
        super().__init__()
        self.layers = nn.ModuleList(Scale() for _ in range(layers))
        self.head_floats = head_floats

    def forward(self, hidden):
        for layer in self.layers:
            hidden = layer(hidden)
        return KnownHead.apply(hidden, self.head_floats)


def toy_breakdown(layers, head_floats, keep_last):
    model = Toy(layers, head_floats).train()
    handle = enable_activation_offload(model, keep_last=keep_last, offload_head=False, **HOST)
    hidden = torch.randn(TOKENS, WIDTH)
    for _ in range(2):
        model(hidden).backward()
    breakdown, stats = handle.peak_breakdown(), handle.stats()
    handle.disable()
    return breakdown, stats


def test_toy_model_figures_match_its_known_sizes():
    head_floats = 16 * TOKENS * WIDTH
    result, stats = toy_breakdown(layers=4, head_floats=head_floats, keep_last=1)
    # The head's stretch starts with the last layer's output, which the head does not keep;
    # then its buffer, and two more in its backward (and scalars).
    head = 3 * head_floats * FLOAT - STATE
    assert head <= result["head_loss_bytes"] < head + SCALARS
    # keep_last=1: the last layer's input stays, the other three moved to the host; the
    # first layer's is the model's input, which the caller holds, so its copy freed nothing.
    assert result["hidden_states_kept_bytes"] == 2 * STATE
    assert result["offload_removed_bytes"] == 3 * STATE == stats["offloaded_bytes"]
    # A layer's recompute + backward (its input is back before the recompute starts): mul's
    # gradients, for the input (a hidden state) and for the weight (the product of a hidden
    # state, then its sum over tokens).
    layer = 2 * STATE + WIDTH * FLOAT
    assert layer <= result["layer_recompute_bytes"] < layer + SCALARS
    # The head's stretch began with the last layer's input and output on the device.
    assert abs(result["step_peak_bytes"] - result["head_loss_bytes"] - 2 * STATE) < SCALARS
    assert result["dominant"] == "head_loss" and result["meter"] == "cpu"


def test_toy_model_with_every_layer_kept_says_lower_keep_last():
    result, stats = toy_breakdown(layers=12, head_floats=1, keep_last=12)
    assert result["hidden_states_kept_bytes"] == 12 * STATE
    assert result["offload_removed_bytes"] == 0 == stats["offloaded_bytes"]
    assert result["dominant"] == "hidden_states_kept"
    assert "lower keep_last (now 12" in result["advice"]


# Tiny Llamas.

BATCH, SEQ, HIDDEN, LAYERS = 2, 128, 64, 4
HIDDEN_STATE = BATCH * SEQ * HIDDEN * FLOAT


def llama(vocab):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=SEQ, attn_implementation="sdpa", use_cache=False))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


class ModeProbe:
    """Records the dispatch mode active in each training forward (a forward pre-hook)."""

    def __init__(self, model):
        self.modes = []
        model.model.layers[0].register_forward_pre_hook(self._record)

    def _record(self, module, args):
        if torch._C._current_graph_task_id() == -1:  # not a recompute
            self.modes.append(_get_current_dispatch_mode())


def steps(model, vocab, count, handle=None, seen=None):
    """`count` training micro-steps; the breakdown after each when `seen` is a list."""
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(count):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        if seen is not None:
            seen.append(handle.peak_breakdown())
    return losses


@pytest.mark.parametrize("vocab", [8192, 128])
def test_dominant_part_follows_the_vocabulary(vocab):
    model = llama(vocab)
    handle = enable_activation_offload(model, keep_last=1, **HOST)
    steps(model, vocab, 2)
    result, stats = handle.peak_breakdown(), handle.stats()
    handle.disable()

    # Every layer's input and the final norm's input left the device (the head's restore
    # brought the kept layer's input back late): exactly the engine's figures.
    assert result["offload_removed_bytes"] == (
        stats["offloaded_bytes"] + stats["head_offloaded_bytes"])
    assert stats["offloaded_bytes"] == LAYERS * HIDDEN_STATE
    assert result["hidden_states_kept_bytes"] == 0
    logits = BATCH * SEQ * vocab * FLOAT
    # The loss's backward holds log_softmax's output and its gradient (logits-sized) at once.
    assert result["head_loss_bytes"] >= 2 * logits
    assert result["step_peak_bytes"] >= max(result["head_loss_bytes"],
                                            result["layer_recompute_bytes"])
    for name, key in zip(("step_peak", "head_loss", "layer_recompute", "hidden_states_kept",
                          "offload_removed"), STAT_KEYS):
        assert stats[key] == result[name + "_bytes"]
    # The phases' peaks (above the step's start): the forward and the head's, then the
    # layers' backward's; the step's peak is the higher.
    assert result["head_phase_peak_bytes"] >= result["head_loss_bytes"]
    assert result["step_peak_bytes"] == max(result["head_phase_peak_bytes"],
                                            result["layer_phase_peak_bytes"])
    # The forward's and the head's apart: the head's stretch holds its whole rise.
    assert result["head_phase_peak_bytes"] == max(result["forward_peak_bytes"],
                                                  result["head_peak_bytes"])
    assert result["head_peak_bytes"] >= result["head_loss_bytes"] > 0
    if vocab == 8192:  # logits: 8 MiB, 32 hidden states
        assert result["head_phase_peak_bytes"] > result["layer_phase_peak_bytes"]
        assert result["head_peak_bytes"] > result["forward_peak_bytes"]
        assert result["dominant"] == "head_loss"
        assert "Liger's fused linear cross-entropy" in result["advice"]
        assert "Cut Cross-Entropy" in result["advice"]
        share = result["head_loss_bytes"] / result["step_peak_bytes"]
        assert f"{share:.0%} of the step's peak" in result["advice"] and share > 0.9
    else:  # logits: half a hidden state
        assert result["head_phase_peak_bytes"] < result["layer_phase_peak_bytes"]
        assert 0 < result["forward_peak_bytes"] < result["layer_phase_peak_bytes"]
        assert result["dominant"] == "layer_recompute"
        assert "offload cannot reduce it further" in result["advice"]
        assert result["layer_recompute_bytes"] > result["head_loss_bytes"]


def allocator_peak(step):
    """The peak of live bytes in torch's CPU allocator during `step()`, from the profiler's
    memory events (as memory_test.py measures): a meter independent of the dispatch mode."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    live = peak = 0
    for _, delta in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                           if e.name() == "[memory]"):
        live += delta
        peak = max(peak, live)
    return peak


def test_step_peak_agrees_with_the_allocator_and_profiling_changes_no_peak():
    model = llama(8192)
    handle = enable_activation_offload(model, keep_last=1, **HOST)
    ids = torch.randint(3, 8192, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()

    step()
    profiled = allocator_peak(step)
    unprofiled = allocator_peak(step)
    result = handle.peak_breakdown()
    handle.disable()
    assert profiled == unprofiled  # the meter allocates nothing the step would see
    # The allocator also sees scratch memory inside kernels, which the meter does not.
    assert 0 <= profiled - result["step_peak_bytes"] < 64 << 10, (profiled, result)


def test_kept_layer_inputs_are_counted_exactly():
    model = llama(128)
    handle = enable_activation_offload(model, keep_last=LAYERS, offload_head=False, **HOST)
    steps(model, 128, 2)
    result, stats = handle.peak_breakdown(), handle.stats()
    handle.disable()
    assert result["hidden_states_kept_bytes"] == LAYERS * HIDDEN_STATE
    assert result["offload_removed_bytes"] == 0 == stats["offloaded_bytes"]


def test_one_profiled_step_unless_asked_and_nothing_left_running():
    model = llama(128)
    probe = ModeProbe(model)
    handle = enable_activation_offload(model, keep_last=1, **HOST)
    seen = []
    assert handle.peak_breakdown() is None
    assert not any(key in handle.stats() for key in STAT_KEYS)
    losses = steps(model, 128, 4, handle, seen)

    # Only the second step ran under the meter; none is left on the mode stack.
    assert [mode is not None for mode in probe.modes] == [False, True, False, False]
    assert _get_current_dispatch_mode() is None
    assert seen[0] is None and all(result == seen[1] for result in seen[1:])
    assert seen[1]["micro_step"] == 2
    assert all(key in handle.stats() for key in STAT_KEYS)
    assert all(key not in handle.totals() for key in STAT_KEYS)

    handle.profile_next_step()
    losses += steps(model, 128, 1, handle, seen)
    assert probe.modes[-1] is not None and seen[-1]["micro_step"] == 5
    assert {k: v for k, v in seen[-1].items() if k != "micro_step"} == {
        k: v for k, v in seen[1].items() if k != "micro_step"}  # the same step, measured again
    losses += steps(model, 128, 1, handle, seen)
    assert probe.modes[-1] is None and seen[-1]["micro_step"] == 5
    handle.disable()
    # Profiling changes no result: the same batch gives the same loss at every step... of
    # unchanged weights (no optimizer here).
    assert all(torch.equal(loss, losses[0]) for loss in losses)


def test_a_run_of_one_step_reports_nothing():
    model = llama(128)
    handle = enable_activation_offload(model, **HOST)
    steps(model, 128, 1)
    handle.disable()
    assert handle.peak_breakdown() is None
    assert _get_current_dispatch_mode() is None


def test_a_profiled_forward_without_backward_profiles_the_next_step():
    model = llama(128)
    handle = enable_activation_offload(model, **HOST)
    ids = torch.randint(3, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    steps(model, 128, 1)
    model(input_ids=ids, labels=ids)  # the profiled step, dropped without backward
    assert handle.peak_breakdown() is None
    steps(model, 128, 1)
    result = handle.peak_breakdown()
    handle.disable()
    assert result["micro_step"] == 3
    assert _get_current_dispatch_mode() is None


def test_a_failing_profiled_forward_leaves_no_meter():
    model = llama(128)
    handle = enable_activation_offload(model, **HOST)
    steps(model, 128, 1)
    with pytest.raises(IndexError):
        model(input_ids=torch.full((BATCH, SEQ), 1000))  # beyond the vocabulary
    assert _get_current_dispatch_mode() is None
    steps(model, 128, 1)
    assert handle.peak_breakdown()["micro_step"] == 3
    handle.disable()


# The Trainer callback.


class Recorder(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


class TrackerStandIn(Recorder):
    """Made by the Trainer from report_to, like wandb: registered before our callback."""

    made = []

    def __init__(self):
        super().__init__()
        TrackerStandIn.made.append(self)


def reports(caplog, logger="ckpt_offload.hf"):
    return [r for r in caplog.records if r.name == logger and REPORT in r.getMessage()]


def test_trainer_logs_the_breakdown_once_and_trackers_get_its_figures(tmp_path, monkeypatch,
                                                                      caplog):
    monkeypatch.setitem(integration_utils.INTEGRATION_TO_CALLBACK, "stand_in", TrackerStandIn)
    TrackerStandIn.made.clear()
    callback = ActivationOffloadCallback(keep_last=1, **HOST)
    trainer = Trainer(model=tiny_llama(), args=training_args(tmp_path, report_to=["stand_in"]),
                      train_dataset=TokenDataset(), callbacks=[callback])
    (tracker,) = TrackerStandIn.made
    callbacks = trainer.callback_handler.callbacks
    with caplog.at_level(logging.INFO, logger="ckpt_offload.hf"):
        trainer.train()

    assert callbacks[0] is callback and callbacks.index(tracker) > 0
    (record,) = reports(caplog)
    message = record.getMessage()
    for label in ("step peak", "LM head + loss", "one layer's recompute + backward",
                  "layer inputs kept on the device", "moved off the device by offload",
                  "dominant: "):
        assert label in message
    # Four steps logged, the second one's log with the breakdown, in GiB.
    step_logs = [log for log in tracker.logs if "loss" in log]
    assert len(step_logs) == 4
    with_peak = [log for log in step_logs if PEAK_KEYS[0] in log]
    assert with_peak == [step_logs[1]]
    result = callback.peak_breakdown
    assert with_peak[0]["offload/peak_step_gib"] == result["step_peak_bytes"] / (1 << 30)
    assert with_peak[0]["offload/peak_offload_removed_gib"] > 0
    assert all(key in with_peak[0] for key in PEAK_KEYS)
    history = [e for e in trainer.state.log_history if "loss" in e]
    assert [PEAK_KEYS[0] in e for e in history] == [False, True, False, False]


def test_trainer_with_gradient_accumulation_reports_the_second_micro_step(tmp_path, caplog):
    callback = ActivationOffloadCallback(**HOST)
    recorder = Recorder()
    trainer = Trainer(model=tiny_llama(),
                      args=training_args(tmp_path, max_steps=2, gradient_accumulation_steps=2),
                      train_dataset=TokenDataset(), callbacks=[recorder, callback])
    with caplog.at_level(logging.INFO, logger="ckpt_offload.hf"):
        trainer.train()
    assert len(reports(caplog)) == 1 and callback.peak_breakdown["micro_step"] == 2
    step_logs = [log for log in recorder.logs if "loss" in log]
    assert [PEAK_KEYS[0] in log for log in step_logs] == [True, False]


def test_trainer_memory_metrics_turn_profiling_off(tmp_path, caplog):
    callback = ActivationOffloadCallback(**HOST)
    recorder = Recorder()
    trainer = Trainer(model=tiny_llama(), args=training_args(tmp_path, max_steps=3,
                                                             skip_memory_metrics=False),
                      train_dataset=TokenDataset(), callbacks=[recorder, callback])
    with caplog.at_level(logging.INFO, logger="ckpt_offload.hf"):
        trainer.train()
    assert not reports(caplog) and callback.peak_breakdown is None
    assert sum("skip_memory_metrics=False" in r.getMessage() for r in caplog.records) == 1
    assert not any(key in log for log in recorder.logs for key in PEAK_KEYS)


def test_report_goes_to_the_logger_given(tmp_path, caplog):
    # As the Axolotl plugin passes its own: Axolotl shows only axolotl.* loggers' info.
    name = "axolotl.integrations.ckpt_offload"
    callback = ActivationOffloadCallback(logger=logging.getLogger(name), **HOST)
    trainer = Trainer(model=tiny_llama(), args=training_args(tmp_path, max_steps=2),
                      train_dataset=TokenDataset(), callbacks=[callback])
    with caplog.at_level(logging.INFO):
        trainer.train()
    assert len(reports(caplog, name)) == 1 and not reports(caplog)


@pytest.mark.parametrize("logger", ["ckpt_offload", print, 1])
def test_bad_logger_names_the_field(logger):
    with pytest.raises(ValueError, match="^logger: expected a logging.Logger"):
        ActivationOffloadCallback(logger=logger, **HOST)
