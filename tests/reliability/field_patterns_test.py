"""What real training code does that a plain training loop does not, on CPU (host backend):
graphs dropped without backward, saved tensors modified in place, training in threads,
torch's own checkpoint inside an offload context, and C++ warnings. Each case frees what it
saved, keeps autograd's own checks and stays bit-identical to the same run without offload.
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import ckpt_offload
from models import LanguageModel, batch, make_llama_stack
from reliability_util import (FALLBACK_WARNING, fresh_host_config, grads, host_live_bytes,
                              identical, plain_checkpoint, reference_step, rss_bytes)

SETTINGS = dict(backend="host", min_offload_bytes=0, keep_last=1, prefetch_depth=1)


class Probed(nn.Module):
    """A stack of checkpointed layers and a head whose loss node saves its own output (the
    log-probabilities), as cross-entropy does: the case where a pack hook that returns its
    input makes a cycle through autograd's node. `saved_probe` is a weak reference to that
    output; it dies with the graph."""

    def __init__(self, layers=3, hidden=32, vocab=512, seed=0):
        super().__init__()
        self.stack = make_llama_stack(layers=layers, hidden=hidden, heads=2, ffn=2 * hidden,
                                      seed=seed)
        torch.manual_seed(seed + 1)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.saved_probe = None

    def forward(self, x, labels, layer_call):
        for layer in self.stack.layers:
            x = layer_call(layer, x)
        log_probs = F.log_softmax(self.head(x).float(), dim=-1)  # saves its output
        self.saved_probe = weakref.ref(log_probs)
        return F.nll_loss(log_probs.flatten(0, 1), labels.flatten())


def probed_batch(seed=0, seq=64, hidden=32, vocab=512):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, seq, hidden, generator=generator)
    labels = torch.randint(0, vocab, (2, seq), generator=generator)
    return x, labels


# Ways a step's graph ends without a full backward: each gets the loss and gives it up.
def no_backward(model, loss):
    pass


def logged_only(model, loss):
    loss.item()


def skipped_when_not_finite(model, loss):
    if not torch.isfinite(loss) or loss.item() > -1.0:  # a NaN guard that skips the step
        return
    loss.backward()


def partial_grad(model, loss):
    torch.autograd.grad(loss, [model.head.weight])


def retained_then_dropped(model, loss):
    loss.backward(retain_graph=True)
    model.zero_grad(set_to_none=True)


DROPS = [no_backward, logged_only, skipped_when_not_finite, partial_grad, retained_then_dropped]


@pytest.mark.parametrize("drop", DROPS, ids=lambda f: f.__name__)
def test_dropped_graph_frees_everything_it_saved(drop):
    model = Probed()
    x, labels = probed_batch()
    # The control: without offload the log-probabilities die with the graph.
    loss = model(x, labels, plain_checkpoint)
    drop(model, loss)
    del loss
    assert model.saved_probe() is None
    with ckpt_offload.offload_activations(**SETTINGS) as engine:
        loss = model(x, labels, ckpt_offload.checkpoint)
    assert engine.stats()["offloaded_tensors"] > 0
    drop(model, loss)
    del loss
    # No gc.collect(): nothing may depend on the cycle collector.
    assert model.saved_probe() is None
    assert host_live_bytes(engine) == 0
    # The next step is exactly a step without offload.
    reference = reference_step_probed(model, x, labels, plain_checkpoint)
    model.zero_grad(set_to_none=True)
    with ckpt_offload.offload_activations(**SETTINGS) as engine:
        loss = model(x, labels, ckpt_offload.checkpoint)
        loss.backward()
    assert identical(reference, (loss.detach(), grads(model)))
    assert host_live_bytes(engine) == 0


def reference_step_probed(model, x, labels, layer_call):
    model.zero_grad(set_to_none=True)
    loss = model(x, labels, layer_call)
    loss.backward()
    return loss.detach(), grads(model)


def test_rss_stays_flat_over_many_dropped_steps():
    # 2 x 512 x 8192 float32 log-probabilities per step: 32 MiB that a leaked graph keeps.
    torch.manual_seed(0)
    model = Probed(layers=2, hidden=64, vocab=8192)
    x, labels = probed_batch(seq=512, hidden=64, vocab=8192)
    settings = fresh_host_config(keep_last=1, prefetch_depth=1)
    per_step_leak = 2 * 512 * 8192 * 4

    def dropped_step(index):
        with ckpt_offload.offload_activations(**settings) as engine:
            loss = model(x, labels, ckpt_offload.checkpoint)
        (no_backward, logged_only, partial_grad)[index % 3](model, loss)
        del loss
        return engine

    for index in range(3):  # warm-up: the host pool, allocator caches
        dropped_step(index)
    start = rss_bytes()
    for index in range(24):
        engine = dropped_step(index)
        assert model.saved_probe() is None
        assert host_live_bytes(engine) == 0, index
    growth = rss_bytes() - start
    print(f"RSS growth over 24 dropped steps: {growth / 2**20:.2f} MiB "
          f"(one leaked step: {per_step_leak / 2**20:.0f} MiB)")
    assert growth < 2 * per_step_leak


def inplace_error(run) -> str:
    with pytest.raises(RuntimeError) as raised:
        run()
    message = str(raised.value)
    # The traceback's frames hold the step's graph in a reference cycle of Python's own.
    del raised
    gc.collect()
    return message


# Where the in-place change happens: the model's input (layer 0's saved input), a middle
# layer's input (offloaded), the last layer's input (kept resident with keep_last=1).
@pytest.mark.parametrize("where", [0, 2, 3], ids=["input", "offloaded", "resident"])
def test_inplace_change_of_a_checkpoint_input_raises_autograd_s_error(where):
    model = make_llama_stack(layers=4, hidden=32, heads=2, ffn=64)
    x = torch.randn(2, 16, 32)

    def step(layer_call):
        inputs = []

        def record(layer, h):
            inputs.append(h)
            return layer_call(layer, h)

        loss = model(x.clone(), record)
        with torch.no_grad():
            inputs[where].mul_(2.0)  # after the layer saved it
        loss.backward()

    expected = inplace_error(lambda: step(plain_checkpoint))
    assert "modified by an inplace operation" in expected
    with ckpt_offload.offload_activations(**SETTINGS) as engine:
        got = inplace_error(lambda: step(ckpt_offload.checkpoint))
    assert engine.stats()["offloaded_tensors"] > 0
    assert got == expected
    assert host_live_bytes(engine) == 0


def head_step(model, x, labels, layer_call, captured):
    """LanguageModel's layers, then a head whose RMSNorm saves its float32 input (a head
    tensor: offloaded once the LM head's weight is saved after it)."""
    for layer in model.stack.layers:
        x = layer_call(layer, x)
    h32 = x.float()
    captured["h32"] = h32
    normed = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    logits = model.lm_head(normed).float()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_inplace_change_of_a_head_and_a_kept_tensor_raises_autograd_s_error():
    """Tensors saved outside the checkpointed layers: the final norm's float32 input (a
    head tensor) and a kept one (a leaf input)."""
    model = LanguageModel()
    x, labels = batch()

    def modified_head(layer_call):
        captured = {}
        loss = head_step(model, x, labels, layer_call, captured)
        with torch.no_grad():
            captured["h32"].add_(1.0)
        loss.backward()

    expected = inplace_error(lambda: modified_head(plain_checkpoint))
    with ckpt_offload.offload_activations(**SETTINGS) as engine:
        got = inplace_error(lambda: modified_head(ckpt_offload.checkpoint))
    assert engine.stats()["head_offloaded_tensors"] > 0
    assert got == expected

    weight = torch.randn(8, 8, requires_grad=True)

    def kept_leaf_step():
        leaf = torch.ones(4, 8)
        loss = (leaf @ weight).sum()  # mm saves the leaf input to compute weight's grad
        leaf.add_(1.0)
        loss.backward()

    expected = inplace_error(kept_leaf_step)
    with ckpt_offload.offload_activations(**SETTINGS):
        got = inplace_error(kept_leaf_step)
    assert got == expected
    assert "modified by an inplace operation" in got
    assert host_live_bytes(engine) == 0


def test_saved_output_modified_in_place_names_its_node():
    """autograd names the node whose output was modified; so does the offload."""
    x = torch.randn(16, requires_grad=True)

    def step():
        y = x.exp()  # ExpBackward0 saves its output
        total = y.sum()
        y.add_(1)
        total.backward()

    expected = inplace_error(step)
    assert "output 0 of ExpBackward0" in expected
    with ckpt_offload.offload_activations(backend="host", min_offload_bytes=0, scope="all"):
        got = inplace_error(step)
    assert got == expected


def run_steps(model, batches, settings):
    """Per step: loss, gradients and offloaded bytes."""
    results = []
    for x in batches:
        model.zero_grad(set_to_none=True)
        with ckpt_offload.offload_activations(**settings) as engine:
            loss = model(x, ckpt_offload.checkpoint)
            loss.backward()
        results.append((loss.detach(), grads(model), engine.stats()["offloaded_bytes"]))
    return results


def test_two_threads_train_their_own_models_independently():
    torch.manual_seed(0)
    batches = [[torch.randn(2, 8 + 8 * (step % 3), 32) for step in range(6)] for _ in range(2)]

    def make(seed):
        return make_llama_stack(layers=4, hidden=32, heads=2, ffn=64, seed=seed)

    alone = [run_steps(make(seed), batches[seed], SETTINGS) for seed in range(2)]
    models = [make(seed) for seed in range(2)]  # here: torch's global RNG is not per thread
    together = [None, None]
    errors = []
    barrier = threading.Barrier(2)

    def train(seed):
        try:
            model = models[seed]
            barrier.wait()
            results = []
            for x in batches[seed]:
                # Interleave the two threads' forwards and backwards as much as possible.
                barrier.wait()
                results.extend(run_steps(model, [x], SETTINGS))
            together[seed] = results
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=train, args=(seed,)) for seed in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for seed in range(2):
        for step, (ref, got) in enumerate(zip(alone[seed], together[seed])):
            assert got[2] == ref[2] > 0, (seed, step)  # the same bytes offloaded per step
            assert identical(ref[:2], got[:2]), (seed, step)


def test_context_is_per_thread():
    with ckpt_offload.offload_activations(**SETTINGS) as engine:
        seen = []
        thread = threading.Thread(target=lambda: seen.append(ckpt_offload.current_engine()))
        thread.start()
        thread.join()
        assert seen == [None]
        assert ckpt_offload.current_engine() is engine


def test_nested_context_error_says_where_the_first_was_entered():
    with ckpt_offload.offload_activations(**SETTINGS):
        with pytest.raises(RuntimeError, match="already active in this thread") as raised:
            with ckpt_offload.offload_activations(**SETTINGS):
                pass
    assert f"{__file__}:" in str(raised.value)
    # The failed entry changed nothing: the outer context closed cleanly.
    assert ckpt_offload.current_engine() is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def torch_checkpoint(layer, h):
    return torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)


def nested_checkpoint(layer, h):
    """A checkpoint whose function checkpoints again (only the outer inputs are ours)."""
    return torch.utils.checkpoint.checkpoint(
        lambda t: torch.utils.checkpoint.checkpoint(layer, t, use_reentrant=False), h,
        use_reentrant=False)


def wrapped_calls(model):
    wrapped = {id(layer): checkpoint_wrapper(layer) for layer in model.layers}
    return lambda layer, h: wrapped[id(layer)](h)


@pytest.mark.parametrize("how", ["torch_checkpoint", "checkpoint_wrapper", "nested"])
def test_torch_s_own_checkpoint_inside_the_context_is_offloaded(how):
    model = make_llama_stack(layers=4, hidden=32, heads=2, ffn=64)
    x = torch.randn(2, 16, 32)
    reference = reference_step(model, x)
    layer_call = {"torch_checkpoint": torch_checkpoint, "nested": nested_checkpoint,
                  "checkpoint_wrapper": wrapped_calls(model)}[how]
    with ckpt_offload.offload_activations(**SETTINGS) as ours:
        model.zero_grad(set_to_none=True)
        loss = model(x, ckpt_offload.checkpoint)
        loss.backward()
    expected = ours.stats()
    model.zero_grad(set_to_none=True)
    with ckpt_offload.offload_activations(**SETTINGS) as engine:
        loss = model(x, layer_call)
        loss.backward()
    assert identical(reference, (loss.detach(), grads(model)))
    stats = engine.stats()
    for key in ("groups", "offloaded_tensors", "offloaded_bytes", "kept_resident_tensors",
                "head_offloaded_tensors"):
        assert stats[key] == expected[key], key
    assert stats["groups"] == 4 and stats["offloaded_tensors"] > 0
    assert host_live_bytes(engine) == 0


def test_reentrant_checkpoint_inside_the_context_is_left_alone():
    model = make_llama_stack(layers=3, hidden=32, heads=2, ffn=64)
    x = torch.randn(2, 16, 32, requires_grad=True)

    def reentrant(layer, h):
        return torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=True)

    reference = reference_step(model, x, reentrant)
    model.zero_grad(set_to_none=True)
    with ckpt_offload.offload_activations(**SETTINGS) as engine:
        loss = model(x, reentrant)
        loss.backward()
    assert identical(reference, (loss.detach(), grads(model)))
    assert engine.stats()["groups"] == 0 and engine.stats()["offloaded_tensors"] == 0


def test_cap_warning_is_a_python_warning_that_filters_control(capfd):
    model = make_llama_stack(layers=4, hidden=32, heads=2, ffn=64)
    x = torch.randn(2, 16, 32)
    # A 1-byte cap: every block is refused, every tensor stays (and the warning fires from
    # begin_group, a direct call into the extension).
    settings = fresh_host_config(keep_last=1, host_memory_limit=1)
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always")
        loss, got, engine = run_offload(model, x, settings)
    texts = [str(w.message) for w in recorded if issubclass(w.category, UserWarning)]
    assert sum(FALLBACK_WARNING in t for t in texts) == 1, texts
    assert FALLBACK_WARNING not in capfd.readouterr().err
    assert engine.stats()["cap_fallbacks"] > 0
    # An "error" filter makes it an exception at the point it is raised.
    settings = fresh_host_config(keep_last=1, host_memory_limit=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match=FALLBACK_WARNING):
            run_offload(model, x, settings)
    assert ckpt_offload.current_engine() is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def run_offload(model, x, settings):
    model.zero_grad(set_to_none=True)
    with ckpt_offload.offload_activations(**settings) as engine:
        loss = model(x, ckpt_offload.checkpoint)
        loss.backward()
    return loss, grads(model), engine


def test_pack_never_returns_the_autograd_tensor_itself():
    """The hooks' own contract: what pack returns holds no reference to a non-leaf input
    (its grad_fn); a leaf comes back as the same object."""
    offloader = ckpt_offload.offload_activations(**SETTINGS)._offloader
    leaf = torch.randn(4)
    produced = leaf.requires_grad_().exp()
    for tensor in (leaf, produced):
        packed = offloader.pack(tensor)
        back = offloader.unpack(packed)
        assert torch.equal(back, tensor)
        assert back.data_ptr() == tensor.data_ptr()  # kept, not copied
    assert offloader.unpack(offloader.pack(leaf)) is leaf
    assert offloader.unpack(offloader.pack(produced)).grad_fn is None
    gc.collect()


def test_exception_inside_a_torch_checkpoint_leaves_no_hook_of_ours_active():
    """The failing checkpoint's own hooks stay pushed until its generator is collected; the
    context's exit still takes exactly its own hooks off, and theirs go with the generator."""
    layer = nn.Linear(32, 32)

    def failing(h):
        raise ValueError("layer failed")

    with pytest.raises(ValueError, match="layer failed") as raised:
        with ckpt_offload.offload_activations(**SETTINGS) as engine:
            h = layer(torch.randn(4, 32))
            torch.utils.checkpoint.checkpoint(failing, h, use_reentrant=False)
    offloader = engine._offloader
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    assert top is not None  # the failed checkpoint's, as without offload
    assert getattr(top[0], "__self__", None) is not offloader
    del raised, top
    gc.collect()
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    assert ckpt_offload.current_engine() is None
    packed = offloader.stats()["packed_tensors"]
    (layer(torch.randn(4, 32)).sin().sum()).backward()  # no hook of ours sees this
    assert offloader.stats()["packed_tensors"] == packed
