"""ckpt_offload on a real GPU (tag gpu): bit-exact bf16 training, the memory it saves, a
non-default compute stream, and no pinned allocations after warm-up.

Run on the GPU machine after `pip install --no-build-isolation .`:
    python -m pytest tests/gpu/torch_gpu_test.py
"""

import contextlib
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "torch_plugin"))

import ckpt_offload  # noqa: E402
from models import grads, make_llama_stack, make_mlp_stack  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = dict(backend="cuda", min_offload_bytes=0)


def plain_ckpt(layer, x):
    return torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)


def step(model, x, call, engine_kwargs=None):
    model.zero_grad(set_to_none=True)
    if engine_kwargs is None:
        loss = model(x, call)
        loss.backward()
        torch.cuda.synchronize()
        return loss.detach(), grads(model), None
    with ckpt_offload.offload_activations(**engine_kwargs) as engine:
        loss = model(x, call)
        loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), grads(model), engine


def assert_same(reference, got):
    assert torch.equal(reference[0], got[0])
    for name, value in reference[1].items():
        assert torch.equal(value, got[1][name]), name


@pytest.mark.parametrize("keep_last,prefetch_depth,offload_head", [
    (0, 0, True), (1, 1, True), (2, 2, True), (1, 0, True), (1, 1, False), (2, 1, False)])
def test_llama_like_bf16_bit_identical(keep_last, prefetch_depth, offload_head):
    model = make_llama_stack(layers=6, hidden=256, heads=4, ffn=512, dtype=torch.bfloat16).cuda()
    x = torch.randn(2, 512, 256, device="cuda", dtype=torch.bfloat16)
    reference = step(model, x, plain_ckpt)
    got = step(model, x, ckpt_offload.checkpoint,
               dict(keep_last=keep_last, prefetch_depth=prefetch_depth,
                    offload_head=offload_head, **CUDA))
    assert_same(reference, got)
    stats = got[2].stats()
    # The head (its Linear's input, triggered by the loss's input) releases the kept layers.
    kept = 0 if offload_head else keep_last
    assert stats["offloaded_tensors"] == 6 - kept
    assert stats["restored_tensors"] == 6 - kept
    assert stats["kept_resident_tensors"] == kept
    assert (stats["head_offloaded_tensors"] > 0) == offload_head
    assert stats["head_restored_tensors"] == stats["head_offloaded_tensors"]


def test_mlp_bf16_bit_identical_under_a_non_default_stream():
    model = make_mlp_stack(layers=8, hidden=512).to(torch.bfloat16).cuda()
    x = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16)
    reference = step(model, x, plain_ckpt)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = step(model, x, ckpt_offload.checkpoint, dict(keep_last=1, **CUDA))
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert_same(reference, got)
    assert got[2].stats()["offloaded_tensors"] == 8  # the kept one released by the head
    assert got[2].stats()["head_restored_tensors"] == got[2].stats()["head_offloaded_tensors"] > 0


class Wide(nn.Module):
    """An MLP layer whose only state kept across layers is its input. Its compute (a 4x FFN
    on 4096 features) outlasts the copy of its input, as in real transformer layers."""

    def __init__(self, hidden):
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class WideStack(nn.Module):
    def __init__(self, layers, hidden):
        super().__init__()
        self.layers = nn.ModuleList(Wide(hidden) for _ in range(layers))

    def forward(self, x, call):
        x = x * 1.0  # the first layer's input belongs to the step, not to the caller
        for layer in self.layers:
            x = call(layer, x)
        return x.float().pow(2).mean()


def peak_step_bytes(model, x, call, engine_kwargs=None):
    """Peak memory of one forward+backward above what was allocated before it (the model
    is frozen, so the step allocates activations and their gradients only)."""
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    context = (ckpt_offload.offload_activations(**engine_kwargs) if engine_kwargs
               else contextlib.nullcontext())
    with context:
        model(x, call).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    x.grad = None
    return peak


@pytest.mark.parametrize("prefetch_depth", [0, 1])
def test_peak_memory_saving_of_a_16_layer_model(prefetch_depth):
    """Saving >= 95 % of the hidden states that leave the device. Each prefetched group is
    back on the device while the group before it runs backward (that is what hides the copy),
    so it does not count as saved."""
    layers, keep_last = 16, 1
    torch.manual_seed(0)
    model = WideStack(layers, 4096).to(torch.bfloat16).cuda().requires_grad_(False)
    x = torch.randn(2, 8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    hidden_bytes = x.numel() * x.element_size()
    kwargs = dict(keep_last=keep_last, prefetch_depth=prefetch_depth, **CUDA)
    for _ in range(2):  # warm the allocator and the host pool
        peak_step_bytes(model, x, plain_ckpt)
        peak_step_bytes(model, x, ckpt_offload.checkpoint, kwargs)
    plain = peak_step_bytes(model, x, plain_ckpt)
    offload = peak_step_bytes(model, x, ckpt_offload.checkpoint, kwargs)
    ideal = (layers - keep_last) * hidden_bytes
    away = (layers - keep_last - prefetch_depth) * hidden_bytes
    print(f"prefetch_depth={prefetch_depth}: peak plain {plain / 2**30:.3f} GiB, offload "
          f"{offload / 2**30:.3f} GiB, saved {(plain - offload) / 2**30:.3f} GiB = "
          f"{(plain - offload) / ideal:.3f} of (layers - keep_last) hidden states, "
          f"{(plain - offload) / away:.3f} of those not prefetched")
    assert plain - offload >= 0.95 * away


def test_no_pinned_allocations_after_warm_up_with_changing_lengths():
    model = make_mlp_stack(layers=8, hidden=512).to(torch.bfloat16).cuda()
    kwargs = dict(keep_last=1, **CUDA)
    engine = ckpt_offload.offload_activations(**kwargs)
    step(model, torch.randn(2, 2048, 512, device="cuda", dtype=torch.bfloat16),
         ckpt_offload.checkpoint, kwargs)
    baseline = engine.stats()["pinned_allocations"]
    allocations = []
    for seq in (1024, 2048, 1536, 1100, 2000, 1800):
        x = torch.randn(2, seq, 512, device="cuda", dtype=torch.bfloat16)
        model.zero_grad(set_to_none=True)
        with engine:
            loss = model(x, ckpt_offload.checkpoint)
            loss.backward()
        torch.cuda.synchronize()
        engine.synchronize()
        stats = engine.stats()
        allocations.append(stats["pinned_allocations"])
        assert stats["host_live_bytes"] == 0
    print(f"pinned allocations (cumulative) per step: {allocations}, after warm-up {baseline}")
    assert all(a == baseline for a in allocations)


def test_gpu_memory_returns_to_baseline_after_each_step():
    model = make_mlp_stack(layers=6, hidden=512).to(torch.bfloat16).cuda()
    kwargs = dict(keep_last=1, **CUDA)
    x = torch.randn(2, 1024, 512, device="cuda", dtype=torch.bfloat16)
    step(model, x, ckpt_offload.checkpoint, kwargs)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    for _ in range(3):
        step(model, x, ckpt_offload.checkpoint, kwargs)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == baseline


def test_exception_mid_forward_on_gpu_cleans_up():
    model = make_mlp_stack(layers=6, hidden=512).to(torch.bfloat16).cuda()
    x = torch.randn(2, 1024, 512, device="cuda", dtype=torch.bfloat16)
    count = []

    def failing(layer, h):
        count.append(1)
        if len(count) == 4:
            raise RuntimeError("boom")
        return ckpt_offload.checkpoint(layer, h)

    with pytest.raises(RuntimeError, match="boom"):
        with ckpt_offload.offload_activations(keep_last=1, **CUDA) as engine:
            model(x, failing)
    engine.synchronize()
    assert engine.stats()["host_live_bytes"] == 0
    assert_same(step(model, x, plain_ckpt),
                step(model, x, ckpt_offload.checkpoint, dict(keep_last=1, **CUDA)))


def test_language_model_head_bf16_bit_identical_and_restored_ahead():
    """The final norm's float32 input leaves the device and is back, restored when backward
    reached the LM head's weight, before the norm's backward; the kept layer goes too."""
    from models import LanguageModel, batch

    torch.manual_seed(0)
    model = LanguageModel(layers=6).cuda()
    x, labels = batch(seq=1024)
    x, labels = x.cuda(), labels.cuda()

    def run(engine_kwargs):
        model.zero_grad(set_to_none=True)
        log = {}
        if engine_kwargs is None:
            loss = model(x, labels, plain_ckpt)
            loss.backward()
            engine = None
        else:
            with ckpt_offload.offload_activations(**engine_kwargs) as engine:
                loss = model(x, labels, ckpt_offload.checkpoint, engine, log)
                loss.backward()
        torch.cuda.synchronize()
        return loss.detach(), grads(model), engine, log

    reference = run(None)
    for _ in range(2):
        # 64 KiB: the layer inputs (256 KiB) and the norm's input (512 KiB) move; the
        # norm's reciprocal roots (8 KiB) are neither head tensors nor triggers.
        got = run(dict(keep_last=1, prefetch_depth=1, backend="cuda", min_offload_bytes=65536))
        assert_same(reference, got)
    stats, log = got[2].stats(), got[3]
    assert stats["head_offloaded_tensors"] == stats["head_restored_tensors"] == 1
    assert stats["offloaded_tensors"] == 6 and stats["kept_resident_tensors"] == 0
    assert log["backward_start"]["head_restored_tensors"] == 0
    assert log["backward_start"]["device_held_bytes"] == 0  # EndForward drained the copies
    assert log["before_norm_backward"]["head_restored_tensors"] == 1
    print("head step stats:", {k: stats[k] for k in (
        "offloaded_tensors", "head_offloaded_bytes", "prefetched_tensors", "exposed_wait_ms")})


def test_doctor_reports_the_engines_own_pinning_and_the_copies():
    """The doctor's pinning figure is the engine's pool growing (its own slabs), next to
    torch's; its copy rates and the CUDA round trip are there too."""
    import json
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    result = subprocess.run([sys.executable, "-m", "ckpt_offload.doctor", "--json"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["round_trip_cuda"] is True
    for key in ("pinned_alloc_gbps", "torch_pinned_alloc_gbps", "d2h_gbps", "h2d_gbps"):
        assert isinstance(report[key], float) and report[key] > 0, (key, report.get(key))
    print(f"doctor: engine pinning {report['pinned_alloc_gbps']} GB/s, torch's "
          f"{report['torch_pinned_alloc_gbps']} GB/s, advice {report['advice']}")
