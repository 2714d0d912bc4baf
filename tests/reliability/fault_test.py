"""Injected faults and interrupted steps (CPU, host backend), and the fault matrix.

Each scenario runs one faulted training step of a 4-layer MLP stack (or an HF Trainer run of
a tiny Llama), then one normal step, and records what happened: the exception and whether
its text carries the device's error, cap fallbacks, warnings, whether the faulted step's
results are bit-identical to no offload (when it completes), whether the saved-tensor hooks
were popped, the host arena's live bytes once the step's graph is gone, the change in live
threads, and whether the next step is bit-identical to no offload. Each scenario has a test
that asserts its expected outcome; test_fault_matrix_matches_the_document renders every
outcome as a table, prints it, and checks it against tests/reliability/FAULT_MATRIX.md
(FAULT_MATRIX_UPDATE=/path/to/FAULT_MATRIX.md rewrites that file instead).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import tempfile
from typing import Callable, Dict, Optional

import pytest
import torch
import torch.utils.checkpoint

import ckpt_offload
from models import make_mlp_stack
from reliability_util import (armed_fault, captured_warnings, count_fallback_warnings,
                              fresh_host_config, grads, host_live_bytes, identical,
                              offload_step, plain_checkpoint, reference_step,
                              saved_tensor_hooks_active, thread_count)

LAYERS = 4
HIDDEN = 32
PER_LAYER_BYTES = 4 * 16 * HIDDEN * 4  # one layer's input: 4 x 16 x 32 float32

# The device's own error texts (offload_core/host_device.cc): the plugin's exception must
# carry them.
DEVICE_TEXT = {
    ("copy", "forward"): "host device: injected device->host copy failure",
    ("copy", "backward"): "host device: injected host->device copy failure",
    ("event", "forward"): "host device: injected event record failure",
    ("event", "backward"): "host device: injected event",
}

MATRIX_DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "FAULT_MATRIX.md")
BEGIN, END = "<!-- fault-matrix:begin -->", "<!-- fault-matrix:end -->"


@dataclasses.dataclass(frozen=True)
class Outcome:
    fault: str
    injected_at: str
    config: str
    raised: str              # exception type, or "-" when the step completed
    device_text: str         # "yes" / "no": the error carries the device's text; "-": n/a
    cap_fallbacks: int       # tensors kept on the device in the faulted step
    warnings: int            # fallback warnings over the faulted and the next step
    step_identical: str      # the faulted step's loss/grads vs no offload ("-": it raised)
    hooks_popped: bool
    host_live_after: int     # arena live bytes once the faulted step's graph is gone
    threads_delta: int
    next_step_identical: bool

    def row(self) -> str:
        cells = [self.fault, self.injected_at, self.config, self.raised, self.device_text,
                 str(self.cap_fallbacks), str(self.warnings), self.step_identical,
                 "yes" if self.hooks_popped else "NO", str(self.host_live_after),
                 f"{self.threads_delta:+d}", "yes" if self.next_step_identical else "NO"]
        return "| " + " | ".join(cells) + " |"


HEADER = ("| fault | injected at | config | raised | error has device text | cap_fallbacks "
          "| fallback warnings | faulted step identical | hooks popped | host live bytes after "
          "| threads | next step identical |")
RULE = "|" + "---|" * 12


# ---------------------------------------------------------------------------------------
# Plain training-loop scenarios (ckpt_offload.offload_activations + ckpt_offload.checkpoint)


class LayerError(RuntimeError):
    pass


class BackwardError(RuntimeError):
    pass


def _raising_backward(error_type):
    class RaiseInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            raise error_type("backward failed on purpose")

    return RaiseInBackward.apply


def plain_scenario(fault: str, injected_at: str, *, keep_last: int = 1, prefetch_depth: int = 1,
                   count: int = 1, host_memory_limit=None, offload_head: bool = True,
                   layer_call: Optional[Callable] = None, two_inputs: bool = False):
    """One faulted step, then a normal one, with the same (fresh) offloader: (Outcome,
    details the matrix does not show).

    fault: a _C fault kind ('host_allocation' | 'copy' | 'event') armed at `injected_at`
    ('forward' | 'backward' | 'backward after the context'), or None when `layer_call`
    (a layer call that raises) or `host_memory_limit` is the fault.
    """
    model = make_mlp_stack(layers=LAYERS, hidden=HIDDEN)
    x = torch.randn(4, 16, HIDDEN, generator=torch.Generator().manual_seed(7))
    reference_call, normal_call = plain_checkpoint, ckpt_offload.checkpoint
    if two_inputs:
        reference_call, normal_call = two_input_plain, two_input_offload
    reference = reference_step(model, x, reference_call)
    settings = fresh_host_config(keep_last=keep_last, prefetch_depth=prefetch_depth,
                                 offload_head=offload_head)
    if host_memory_limit is not None:
        settings["host_memory_limit"] = host_memory_limit
    call = layer_call or normal_call
    threads = thread_count()
    error: Optional[BaseException] = None
    loss = None
    live_at_error = None
    arm = functools.partial(armed_fault, fault, count) if fault else None
    with captured_warnings() as texts:
        model.zero_grad(set_to_none=True)
        engine = ckpt_offload.offload_activations(**settings)
        try:
            through_cleanup = arm and injected_at == "forward, through the clean-up"
            with (arm() if through_cleanup else contextlib.nullcontext()):
                with engine:
                    if arm and injected_at == "forward":
                        with arm():
                            loss = model(x, call)
                    else:
                        loss = model(x, call)
                    if arm and injected_at == "backward":
                        with arm():
                            loss.backward()
                    elif injected_at != "backward after the context":
                        loss.backward()
            if injected_at == "backward after the context":
                # The HF integration's shape: forward inside the context, backward after it.
                with (arm() if arm else contextlib.nullcontext()):
                    loss.backward()
        except BaseException as caught:  # KeyboardInterrupt included
            error = caught
            live_at_error = host_live_bytes(engine)
        hooks_popped = not saved_tensor_hooks_active() and ckpt_offload.current_engine() is None
        faulted_step = (loss.detach(), grads(model)) if error is None else None
        stats = engine.stats()
        # Drop the faulted step's graph (the exception's traceback holds it too).
        del loss
        error_text = None if error is None else f"{type(error).__name__}: {error}"
        error_type = None if error is None else type(error).__name__
        error = None
        gc.collect()
        host_live_after = host_live_bytes(engine)
        try:
            next_step = offload_step(model, x, settings, normal_call)
            next_stats = next_step[2].stats()
        except Exception as caught:  # the next step failed as well
            next_step, next_stats = None, {"error": f"{type(caught).__name__}: {caught}"}
    device_text = "-"
    if fault in ("copy", "event") and error_text is not None:
        phase = "forward" if injected_at.startswith("forward") else "backward"
        device_text = "yes" if DEVICE_TEXT[(fault, phase)] in error_text else "no"
    result = Outcome(
        fault=_fault_label(fault, count, host_memory_limit, layer_call, two_inputs),
        injected_at=injected_at,
        config=f"keep_last={keep_last} prefetch={prefetch_depth}"
               + ("" if offload_head else " offload_head=False"),
        raised=error_type or "-",
        device_text=device_text,
        cap_fallbacks=stats["cap_fallbacks"],
        warnings=count_fallback_warnings(texts),
        step_identical="-" if faulted_step is None else
        ("yes" if identical(reference, faulted_step) else "NO"),
        hooks_popped=hooks_popped,
        host_live_after=host_live_after,
        threads_delta=thread_count() - threads,
        next_step_identical=next_step is not None and identical(reference, next_step),
    )
    # Details the matrix does not show, for the per-scenario tests.
    return result, dict(error_text=error_text, stats=stats, next_stats=next_stats,
                         live_at_error=live_at_error)


def _fault_label(fault, count, host_memory_limit, layer_call, two_inputs):
    if layer_call is not None:
        return layer_call.label
    if host_memory_limit is not None:
        label = f"host cap ({host_memory_limit} B)"
    else:
        label = fault if count == 1 else f"{fault} x{count}"
    return label + (", layers with 2 inputs" if two_inputs else "")


def _two_inputs(layer, a, b):
    return layer(a) + b


def two_input_offload(layer, h):
    """A checkpointed layer whose group has two offloadable inputs."""
    return ckpt_offload.checkpoint(_two_inputs, layer, h, h * 0.5)


def two_input_plain(layer, h):
    return torch.utils.checkpoint.checkpoint(_two_inputs, layer, h, h * 0.5, use_reentrant=False)


def failing_layer(label: str, make_error: Callable[[], BaseException], at_layer: int = 2):
    """A layer call that raises `make_error()` in forward of layer `at_layer`."""
    calls = []

    def call(layer, h):
        calls.append(layer)
        if len(calls) == at_layer + 1:
            raise make_error()
        return ckpt_offload.checkpoint(layer, h)

    call.label = label
    return call


def failing_backward(label: str, error_type):
    apply = _raising_backward(error_type)

    def call(layer, h):
        return ckpt_offload.checkpoint(layer, apply(h))

    call.label = label
    return call


SCENARIOS: Dict[str, Callable[[], Outcome]] = {
    # Host memory refused: the tensor stays on the device, training goes on identically.
    "alloc_fwd_k0": lambda: plain_scenario("host_allocation", "forward", keep_last=0),
    "alloc_fwd_k1": lambda: plain_scenario("host_allocation", "forward", keep_last=1),
    "alloc_all_fwd_k0": lambda: plain_scenario("host_allocation", "forward", keep_last=0,
                                               count=1000),
    "cap_fwd_k0": lambda: plain_scenario(None, "forward", keep_last=0,
                                         host_memory_limit=2 * PER_LAYER_BYTES + 4096),
    "cap_fwd_k1": lambda: plain_scenario(None, "forward", keep_last=1,
                                         host_memory_limit=PER_LAYER_BYTES + 4096),
    "cap_fwd_k1_two_inputs": lambda: plain_scenario(None, "forward", keep_last=1,
                                                    host_memory_limit=1, two_inputs=True),
    # KNOWN BUG (see test_fallback_of_a_group_s_first_input_with_keep_last_0): with
    # keep_last=0 a refused first input of a group makes the engine forget the group.
    "cap_fwd_k0_two_inputs": lambda: plain_scenario(None, "forward", keep_last=0,
                                                    host_memory_limit=1, two_inputs=True),
    "alloc_fwd_k0_two_inputs": lambda: plain_scenario("host_allocation", "forward", keep_last=0,
                                                      two_inputs=True),
    # Device errors: the step raises with the device's text, the next step is normal.
    "copy_fwd_k0": lambda: plain_scenario("copy", "forward", keep_last=0),
    "copy_fwd_k1": lambda: plain_scenario("copy", "forward", keep_last=1),
    "copy_bwd_k1": lambda: plain_scenario("copy", "backward", keep_last=1),
    "copy_bwd_k0_p0": lambda: plain_scenario("copy", "backward", keep_last=0, prefetch_depth=0),
    "copy_bwd_after_ctx": lambda: plain_scenario("copy", "backward after the context"),
    "copy_bwd_k0_p0_no_head": lambda: plain_scenario("copy", "backward", keep_last=0,
                                                     prefetch_depth=0, offload_head=False),
    "event_fwd_k0": lambda: plain_scenario("event", "forward", keep_last=0),
    "event_fwd_k1": lambda: plain_scenario("event", "forward", keep_last=1),
    "event_bwd_k1": lambda: plain_scenario("event", "backward", keep_last=1),
    "event_bwd_after_ctx": lambda: plain_scenario("event", "backward after the context"),
    # Every event call fails, including those of the clean-up drain.
    "event_all_fwd_k1": lambda: plain_scenario("event", "forward, through the clean-up",
                                               keep_last=1, count=1000),
    # Errors of the model itself.
    "layer_error_fwd": lambda: plain_scenario(None, "forward", layer_call=failing_layer(
        "exception in layer forward", lambda: LayerError("layer 3 failed"))),
    "layer_error_bwd": lambda: plain_scenario(None, "backward", layer_call=failing_backward(
        "exception in backward", BackwardError)),
    "interrupt_fwd": lambda: plain_scenario(None, "forward", layer_call=failing_layer(
        "KeyboardInterrupt in layer forward", KeyboardInterrupt)),
    "interrupt_bwd": lambda: plain_scenario(None, "backward", layer_call=failing_backward(
        "KeyboardInterrupt in backward", KeyboardInterrupt)),
}


@functools.lru_cache(maxsize=None)
def _run(name: str):
    return SCENARIOS[name]()


def outcome(name: str) -> Outcome:
    """The scenario's outcome; each scenario runs once per process."""
    return _run(name)[0]


def details(name: str) -> Dict:
    return _run(name)[1]


def assert_clean_abort(result: Outcome):
    assert result.hooks_popped
    assert result.host_live_after == 0
    assert result.threads_delta == 0
    assert result.next_step_identical


# ---------------------------------------------------------------------------------------
# Host memory refused


@pytest.mark.parametrize("name, offloaded, fallbacks", [
    ("alloc_fwd_k0", 3, 1),      # the first slab allocation fails; the next one succeeds
    ("alloc_fwd_k1", 3, 1),      # keep_last=1: the head's trigger releases the kept layer
    ("alloc_all_fwd_k0", 0, 4),  # every slab allocation fails: nothing moves
    ("cap_fwd_k0", 2, 2),        # the cap holds two layers' inputs
    ("cap_fwd_k1", 1, 2),        # ... one layer's input
])
def test_refused_host_memory_keeps_tensors_on_device_with_one_warning(name, offloaded, fallbacks):
    result = outcome(name)
    stats = details(name)["stats"]
    assert result.raised == "-"
    assert result.step_identical == "yes"
    assert stats["offloaded_tensors"] == offloaded
    assert result.cap_fallbacks == fallbacks == stats["cap_fallbacks"]
    if name.startswith("alloc"):
        assert stats["host_backend_failures"] >= 1
    else:
        # A refused head tensor (the loss's saved input) is counted apart.
        assert stats["host_cap_rejections"] == fallbacks + stats["head_cap_fallbacks"]
        assert stats["host_reserved_bytes"] <= 2 * PER_LAYER_BYTES + 4096
    # One warning over both steps, although the cap keeps refusing in the next one.
    assert result.warnings == 1
    assert_clean_abort(result)


def test_fallback_of_every_input_of_two_input_layers():
    result = outcome("cap_fwd_k1_two_inputs")
    assert result.raised == "-" and result.step_identical == "yes"
    assert result.cap_fallbacks == 6  # both inputs of the 3 offloaded layers
    assert result.warnings == 1
    assert_clean_abort(result)


# Regression: with keep_last=0 each input is copied as it is offered; a refused first input
# used to take its (still open) group with it, failing the layer's next input.
@pytest.mark.parametrize("name", ["cap_fwd_k0_two_inputs", "alloc_fwd_k0_two_inputs"])
def test_fallback_of_a_group_s_first_input_with_keep_last_0(name):
    result = outcome(name)
    assert result.raised == "-", details(name)["error_text"]
    assert result.step_identical == "yes"
    assert_clean_abort(result)


# ---------------------------------------------------------------------------------------
# Device errors


@pytest.mark.parametrize("name, where", [
    ("copy_fwd_k0", "offloading a saved tensor"),
    ("copy_fwd_k1", "starting a checkpoint group"),
    # Backward's first copy restores the head Linear's input ahead, at the unpack of its
    # trigger, the loss's saved input (the weight's transpose, saved and unpacked by the
    # Linear's own node, is no trigger); backward's first event call is the end of
    # forward's wait.
    ("copy_bwd_k1", "restoring head tensors ahead"),
    ("copy_bwd_k0_p0", "restoring head tensors ahead"),
    ("copy_bwd_after_ctx", "restoring head tensors ahead"),
    # Without the head, the last layer's input is backward's first copy, made when its
    # recompute asks for it.
    ("copy_bwd_k0_p0_no_head", "restoring a saved tensor"),
    ("event_fwd_k0", "offloading a saved tensor"),
    ("event_fwd_k1", "starting a checkpoint group"),
    ("event_bwd_k1", "ending the forward"),
    ("event_bwd_after_ctx", "ending the forward"),
])
def test_device_error_aborts_the_step_with_the_device_text(name, where):
    result = outcome(name)
    text = details(name)["error_text"]
    assert result.raised == "RuntimeError"
    assert result.device_text == "yes", text
    assert f"ckpt_offload: {where} failed" in text
    assert result.cap_fallbacks == 0 and result.warnings == 0
    if "after" not in name:
        # The context's exit reset the engine: nothing was left even while the exception
        # (and the graph it references) was alive.
        assert details(name)["live_at_error"] == 0
    assert_clean_abort(result)
    assert details(name)["next_stats"]["offloaded_tensors"] > 0


def test_failing_drain_reports_the_device_text_and_still_frees_everything():
    result = outcome("event_all_fwd_k1")
    text = details("event_all_fwd_k1")["error_text"]
    # The clean-up drain failed too: its error is the one raised (the original is its
    # __context__), and it still carries the device's text.
    assert result.raised == "RuntimeError"
    assert "draining the offload engine failed" in text
    assert result.device_text == "yes"
    assert_clean_abort(result)


# ---------------------------------------------------------------------------------------
# Errors of the model and interrupts


@pytest.mark.parametrize("name, raised", [
    ("layer_error_fwd", "LayerError"),
    ("layer_error_bwd", "BackwardError"),
    ("interrupt_fwd", "KeyboardInterrupt"),
    ("interrupt_bwd", "KeyboardInterrupt"),
])
def test_model_errors_and_interrupts_propagate_unchanged_and_clean_up(name, raised):
    result = outcome(name)
    assert result.raised == raised
    assert details(name)["error_text"].startswith(f"{raised}:")
    assert details(name)["live_at_error"] == 0
    assert_clean_abort(result)


# ---------------------------------------------------------------------------------------
# HF Trainer interrupted by KeyboardInterrupt


def hf_interrupt_scenario(where: str):
    """Trainer.train() interrupted at step 3 of 4 (from a layer's forward, or from a
    callback's on_step_end), then train() again; the same with and without
    ActivationOffloadCallback. Next step identical: the second train()'s losses and the
    final weights are bit-identical to the run without offload."""
    from transformers import Trainer, TrainerCallback

    from ckpt_offload.hf import ActivationOffloadCallback
    from hf_tiny import TokenDataset, tiny_llama, training_args

    class Interrupter(TrainerCallback):
        """Interrupts the first train() once, in its third step."""

        def __init__(self):
            self.armed = False
            self.fired = False

        def on_step_begin(self, args, state, control, **kwargs):
            if where == "layer forward" and state.global_step == 2 and not self.fired:
                self.armed = True

        def on_step_end(self, args, state, control, **kwargs):
            if where == "on_step_end" and state.global_step == 3 and not self.fired:
                self.fired = True
                raise KeyboardInterrupt

    def run(offload: bool):
        model = tiny_llama()
        interrupter = Interrupter()

        def interrupt_forward(module, inputs):
            if interrupter.armed:
                interrupter.armed = False
                interrupter.fired = True
                raise KeyboardInterrupt

        model.model.layers[2].mlp.register_forward_pre_hook(interrupt_forward)
        callbacks = [interrupter]
        offload_callback = None
        settings = fresh_host_config(keep_last=1)
        if offload:
            offload_callback = ActivationOffloadCallback(**settings)
            callbacks.append(offload_callback)
        output_dir = tempfile.mkdtemp(prefix="ckpt_offload_rel_")
        trainer = Trainer(model=model, args=training_args(output_dir, max_steps=4),
                          train_dataset=TokenDataset(), callbacks=callbacks)
        threads = thread_count()
        raised = "-"
        try:
            trainer.train()
        except KeyboardInterrupt:
            raised = "KeyboardInterrupt"
        hooks_popped = not saved_tensor_hooks_active() and ckpt_offload.current_engine() is None
        gc.collect()
        live = 0
        if offload:
            # The pool of this thread's offloader for these settings, whatever the callback
            # did with its handle (a failed train() uninstalls it).
            live = ckpt_offload.offload_activations(**settings).stats()["host_live_bytes"]
        first_losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        trainer.train()  # the next steps: a fresh train() on the interrupted model
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        totals = offload_callback.final_totals if offload_callback else {}
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        return dict(raised=raised, hooks=hooks_popped, live=live, first=first_losses,
                    losses=losses, weights=weights, threads=thread_count() - threads,
                    offloaded=totals.get("offloaded_tensors", 0),
                    fallbacks=totals.get("cap_fallbacks", 0))

    plain = run(False)
    with captured_warnings() as texts:
        got = run(True)
    same = (got["first"] == plain["first"] and got["losses"] == plain["losses"]
            and len(got["losses"]) == 4 and got["offloaded"] > 0
            and all(torch.equal(plain["weights"][n], got["weights"][n]) for n in plain["weights"]))
    result = Outcome(
        fault="KeyboardInterrupt in HF Trainer", injected_at=where, config="keep_last=1 prefetch=1",
        raised=got["raised"], device_text="-", cap_fallbacks=got["fallbacks"],
        warnings=count_fallback_warnings(texts),
        step_identical="-", hooks_popped=got["hooks"], host_live_after=got["live"],
        threads_delta=got["threads"], next_step_identical=same)
    return result, dict(plain=plain, offload=got)


SCENARIOS["hf_interrupt_layer"] = lambda: hf_interrupt_scenario("layer forward")
SCENARIOS["hf_interrupt_step_end"] = lambda: hf_interrupt_scenario("on_step_end")


@pytest.mark.parametrize("name", ["hf_interrupt_layer", "hf_interrupt_step_end"])
def test_keyboard_interrupt_in_trainer_step_leaves_nothing_behind(name):
    result = outcome(name)
    assert result.raised == "KeyboardInterrupt"
    assert_clean_abort(result)


# ---------------------------------------------------------------------------------------
# The matrix


def render_matrix() -> str:
    return "\n".join([HEADER, RULE] + [outcome(name).row() for name in SCENARIOS])


def test_fault_matrix_matches_the_document(capsys):
    table = render_matrix()
    with capsys.disabled():
        print("\nFault matrix (tests/reliability/FAULT_MATRIX.md):\n" + table + "\n")
    update = os.environ.get("FAULT_MATRIX_UPDATE")
    if update:
        with open(update) as f:
            text = f.read()
        head, rest = text.split(BEGIN)
        _, tail = rest.split(END)
        with open(update, "w") as f:
            f.write(f"{head}{BEGIN}\n{table}\n{END}{tail}")
    with open(MATRIX_DOC) as f:
        documented = f.read().split(BEGIN)[1].split(END)[0].strip()
    assert documented == table, "FAULT_MATRIX.md is out of date; see the printed matrix"
