"""ckpt_offload's Python API on CPU (host backend): bit-exact training and every rule of
what moves, how it comes back and what happens on errors."""

import gc
import warnings

import pytest
import torch
import torch.utils.checkpoint
from hypothesis import given, settings, strategies as st

import ckpt_offload
from ckpt_offload import _C
from models import grads, make_llama_stack, make_mlp_stack

HOST = dict(backend="host", min_offload_bytes=0)


def plain_ckpt(layer, x):
    return torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)


def run_step(model, x, layer_call, engine_kwargs=None, backward=True):
    model.zero_grad(set_to_none=True)
    if engine_kwargs is None:
        loss = model(x, layer_call)
        if backward:
            loss.backward()
        return loss.detach(), grads(model), None
    with ckpt_offload.offload_activations(**engine_kwargs) as engine:
        loss = model(x, layer_call)
        if backward:
            loss.backward()
    return loss.detach(), grads(model), engine


def assert_same(reference, candidate):
    ref_loss, ref_grads, _ = reference
    loss, got_grads, _ = candidate
    assert torch.equal(ref_loss, loss)
    assert ref_grads.keys() == got_grads.keys()
    for name in ref_grads:
        assert torch.equal(ref_grads[name], got_grads[name]), name


def host_live_bytes(engine):
    engine.synchronize()
    return engine.stats()["host_live_bytes"]


@pytest.mark.parametrize("keep_last", [0, 1, 2])
@pytest.mark.parametrize("prefetch_depth", [0, 1, 2])
@pytest.mark.parametrize("offload_head", [True, False])
def test_mlp_stack_gradients_bit_identical_to_plain_checkpointing(keep_last, prefetch_depth,
                                                                  offload_head):
    model = make_mlp_stack(layers=6, hidden=32)
    x = torch.randn(4, 16, 32, requires_grad=True)
    reference = run_step(model, x, plain_ckpt)
    got = run_step(model, x, ckpt_offload.checkpoint,
                   dict(keep_last=keep_last, prefetch_depth=prefetch_depth,
                        offload_head=offload_head, **HOST))
    assert_same(reference, got)
    stats = got[2].stats()
    # Layer 0's input is a leaf that requires grad: its AccumulateGrad node holds it until
    # backward anyway, so it stays. With the head offloaded (the head Linear's input, whose
    # trigger is the loss's float32 input), the kept layers are copied out too: the
    # trigger's restore prefetches them.
    kept = 0 if offload_head else keep_last
    assert (stats["head_offloaded_tensors"] > 0) == offload_head
    assert stats["head_restored_tensors"] == stats["head_offloaded_tensors"]
    assert stats["offloaded_tensors"] == 5 - kept
    assert stats["kept_resident_tensors"] == kept
    assert stats["restored_tensors"] + stats["reclaimed_tensors"] == stats["offloaded_tensors"]
    if prefetch_depth > 0:
        assert stats["prefetched_tensors"] >= stats["offloaded_tensors"] - 1
    else:
        assert stats["prefetched_tensors"] == 0
    assert host_live_bytes(got[2]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_like_stack_bit_identical_with_kwargs(dtype):
    model = make_llama_stack(layers=4, hidden=64, heads=4, ffn=128, dtype=dtype)
    x = torch.randn(2, 32, 64, dtype=dtype)

    def offload_call(layer, h):
        return ckpt_offload.checkpoint(layer, h, scale=0.5)

    def plain_call(layer, h):
        return torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False, scale=0.5)

    reference = run_step(model, x, plain_call)
    got = run_step(model, x, offload_call, dict(keep_last=1, offload_head=False, **HOST))
    assert_same(reference, got)
    stats = got[2].stats()
    assert stats["offloaded_tensors"] == 3
    assert stats["kept_resident_tensors"] == 1
    assert stats["offloaded_bytes"] == 3 * x.numel() * x.element_size()
    # With the head: every layer (the kept one too) and the head Linear's input.
    got = run_step(model, x, offload_call, dict(keep_last=1, **HOST))
    assert_same(reference, got)
    stats = got[2].stats()
    assert (stats["offloaded_tensors"], stats["kept_resident_tensors"]) == (4, 0)
    assert stats["head_offloaded_tensors"] == stats["head_restored_tensors"] > 0


def test_only_tagged_inputs_move_in_checkpoint_inputs_scope():
    model = make_mlp_stack(layers=3, hidden=32)
    x = torch.randn(4, 16, 32)
    with ckpt_offload.offload_activations(keep_last=0, offload_head=False, **HOST) as engine:
        # Saved tensors outside checkpoint groups (the head's input) stay put.
        loss = model(x, ckpt_offload.checkpoint)
        loss.backward()
    stats = engine.stats()
    assert stats["offloaded_tensors"] == 3  # one per layer, nothing else
    assert stats["skipped_tensors"] > 0


def test_parameters_expanded_and_small_tensors_are_never_offloaded():
    offloader = _C.Offloader(keep_last=0, prefetch_depth=0, min_offload_bytes=64,
                             host_memory_limit=1 << 30, backend="host", scope="all")
    param = torch.nn.Parameter(torch.randn(64, 64))
    expanded = torch.randn(64, 1).expand(64, 64)
    small = torch.randn(4)
    quantized = torch.quantize_per_tensor(torch.randn(64, 64), 0.1, 0, torch.qint8)
    sparse = torch.randn(64, 64).to_sparse()
    frozen = torch.nn.Parameter(torch.randn(64, 64), requires_grad=False)  # LoRA base weight

    class Subclass(torch.Tensor):
        pass

    subclass = torch.randn(64, 64).as_subclass(Subclass)
    for t in (param, small, quantized, sparse, frozen):
        assert offloader.unpack(offloader.pack(t)) is t  # the leaf itself, not a copy
    # Views (as_subclass makes one) come back as aliases of the same memory, of the same
    # type (no grad_fn or base is held).
    for t in (expanded, subclass):
        back = offloader.unpack(offloader.pack(t))
        assert type(back) is type(t) and back.data_ptr() == t.data_ptr()
        assert back.stride() == t.stride() and torch.equal(back, t)
    assert "Parameter" in offloader.ineligible_reason(param)
    leaf = torch.randn(64, 64, requires_grad=True)
    assert "leaf that requires grad" in offloader.ineligible_reason(leaf)
    assert "stride 0" in offloader.ineligible_reason(expanded)
    assert "min_offload_bytes" in offloader.ineligible_reason(small)
    assert offloader.stats()["offloaded_tensors"] == 0


def test_view_with_offset_and_strides_round_trips_exactly():
    offloader = _C.Offloader(keep_last=0, prefetch_depth=0, min_offload_bytes=0,
                             host_memory_limit=1 << 30, backend="host", scope="all")
    base = torch.randn(8, 10, 12)
    view = base[2:, 3:9, ::2].transpose(0, 2)
    assert view.storage_offset() > 0 and not view.is_contiguous()
    packed = offloader.pack(view)
    assert isinstance(packed, _C.PackedTensor)
    restored = offloader.unpack(packed)
    assert restored.shape == view.shape
    assert restored.stride() == view.stride()
    assert torch.equal(restored, view)
    assert restored.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()


def test_views_of_one_storage_are_copied_once_and_restored_as_one_storage():
    offloader = _C.Offloader(keep_last=0, prefetch_depth=0, min_offload_bytes=0,
                             host_memory_limit=1 << 30, backend="host", scope="checkpoint_inputs")
    base = torch.randn(16, 32)
    first, second = base[:8], base[4:]
    whole = base.view(-1)
    offloader.begin_group([whole, first, second])
    packs = [offloader.pack(t) for t in (whole, first, second)]
    offloader.end_group()
    stats = offloader.stats()
    assert stats["offloaded_tensors"] == 1
    assert stats["shared_storage_hits"] == 2
    restored = [offloader.unpack(p) for p in packs]
    for original, back in zip((whole, first, second), restored):
        assert torch.equal(original, back)
    ptrs = {t.untyped_storage().data_ptr() for t in restored}
    assert len(ptrs) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16,
                                   torch.float64, torch.int64, torch.bool,
                                   getattr(torch, "float8_e4m3fn", torch.int8)])
def test_dtypes_preserved(dtype):
    offloader = _C.Offloader(keep_last=0, prefetch_depth=0, min_offload_bytes=0,
                             host_memory_limit=1 << 30, backend="host", scope="all")
    t = (torch.randn(33, 17) * 4).to(dtype)
    restored = offloader.unpack(offloader.pack(t))
    assert restored.dtype == dtype
    assert torch.equal(restored.view(torch.uint8), t.view(torch.uint8))


def test_retain_graph_second_backward_gives_identical_gradients():
    model = make_mlp_stack(layers=4, hidden=32)
    x = torch.randn(4, 16, 32)

    def twice(engine_kwargs):
        model.zero_grad(set_to_none=True)
        ctx = (ckpt_offload.offload_activations(**engine_kwargs) if engine_kwargs
               else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
        call = ckpt_offload.checkpoint if engine_kwargs else plain_ckpt
        with ctx:
            loss = model(x, call)
            loss.backward(retain_graph=True)
            first = grads(model)
            loss.backward()
        return first, grads(model)

    ref_first, ref_second = twice(None)
    first, second = twice(dict(keep_last=1, **HOST))
    for name in ref_first:
        assert torch.equal(ref_first[name], first[name])
        assert torch.equal(ref_second[name], second[name])


def test_freeing_the_graph_returns_host_blocks():
    model = make_mlp_stack(layers=4, hidden=32)
    x = torch.randn(4, 16, 32)
    with ckpt_offload.offload_activations(keep_last=1, **HOST) as engine:
        loss = model(x, ckpt_offload.checkpoint)
    assert engine.stats()["host_live_bytes"] > 0  # offloaded, waiting for backward
    del loss
    gc.collect()
    assert host_live_bytes(engine) == 0


def test_backward_after_the_block_exits_still_restores():
    model = make_mlp_stack(layers=4, hidden=32)
    x = torch.randn(4, 16, 32)
    reference = run_step(model, x, plain_ckpt)
    model.zero_grad(set_to_none=True)
    with ckpt_offload.offload_activations(keep_last=1, **HOST) as engine:
        loss = model(x, ckpt_offload.checkpoint)
    loss.backward()
    assert_same(reference, (loss.detach(), grads(model), engine))
    # Every layer (the head's trigger copied the kept one out too) and the head's input.
    assert engine.stats()["restored_tensors"] == 4
    assert engine.stats()["head_restored_tensors"] == engine.stats()["head_offloaded_tensors"]


class Boom(RuntimeError):
    pass


def test_exception_in_forward_pops_hooks_and_frees_host_memory():
    model = make_mlp_stack(layers=4, hidden=32)
    x = torch.randn(4, 16, 32)
    calls = []

    def failing(layer, h):
        calls.append(1)
        if len(calls) == 3:
            raise Boom("layer 3 failed")
        return ckpt_offload.checkpoint(layer, h)

    with pytest.raises(Boom):
        with ckpt_offload.offload_activations(keep_last=0, **HOST) as engine:
            model(x, failing)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert ckpt_offload.current_engine() is None
    assert host_live_bytes(engine) == 0
    # The next step trains normally and bit-exactly.
    assert_same(run_step(model, x, plain_ckpt),
                run_step(model, x, ckpt_offload.checkpoint, dict(keep_last=0, **HOST)))


def test_exception_in_backward_leaves_nothing_behind():
    model = make_mlp_stack(layers=4, hidden=32)
    x = torch.randn(4, 16, 32)

    class FailInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            raise Boom("backward failed")

    with pytest.raises(Boom):
        with ckpt_offload.offload_activations(keep_last=1, **HOST) as engine:
            loss = model(
                x, lambda layer, h: ckpt_offload.checkpoint(layer, FailInBackward.apply(h)))
            loss.backward()
    del loss
    gc.collect()
    assert host_live_bytes(engine) == 0
    assert_same(run_step(model, x, plain_ckpt),
                run_step(model, x, ckpt_offload.checkpoint, dict(keep_last=1, **HOST)))


def test_nested_contexts_raise():
    with ckpt_offload.offload_activations(**HOST):
        with pytest.raises(RuntimeError, match="nested"):
            with ckpt_offload.offload_activations(**HOST):
                pass
    assert ckpt_offload.current_engine() is None


def test_reentrant_checkpoint_inside_the_context_works_untouched():
    model = make_mlp_stack(layers=3, hidden=32)
    x = torch.randn(4, 16, 32, requires_grad=True)

    def reentrant(layer, h):
        return torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=True)

    reference = run_step(model, x, reentrant)
    got = run_step(model, x, reentrant, dict(keep_last=0, **HOST))
    assert_same(reference, got)
    assert got[2].stats()["offloaded_tensors"] == 0


def test_checkpoint_outside_a_context_is_plain_checkpointing():
    model = make_mlp_stack(layers=3, hidden=32)
    x = torch.randn(4, 16, 32)
    assert_same(run_step(model, x, plain_ckpt), run_step(model, x, ckpt_offload.checkpoint))


def test_checkpoint_without_tensor_inputs_is_an_error():
    with pytest.raises(ValueError, match="no tensor arguments"):
        ckpt_offload.checkpoint(lambda: torch.ones(1))
    with pytest.raises(ValueError, match="use_reentrant"):
        ckpt_offload.checkpoint(lambda t: t, torch.ones(1), use_reentrant=True)


def test_autocast_training_is_bit_identical():
    model = make_mlp_stack(layers=4, hidden=32)
    x = torch.randn(4, 16, 32)

    def under_autocast(call, kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return run_step(model, x, call, kwargs)

    reference = under_autocast(plain_ckpt, None)
    got = under_autocast(ckpt_offload.checkpoint, dict(keep_last=1, offload_head=False, **HOST))
    assert_same(reference, got)
    assert got[2].stats()["offloaded_tensors"] == 3


def test_host_cap_keeps_tensors_on_device_with_identical_results():
    model = make_mlp_stack(layers=5, hidden=32)
    x = torch.randn(4, 16, 32)
    per_layer = x.numel() * x.element_size()
    reference = run_step(model, x, plain_ckpt)
    # Room for about one layer's input: the rest falls back to staying resident.
    got = run_step(model, x, ckpt_offload.checkpoint,
                   dict(keep_last=0, prefetch_depth=0, host_memory_limit=per_layer + 4096,
                        max_inflight_d2h_groups=1, **HOST))
    assert_same(reference, got)
    stats = got[2].stats()
    assert stats["cap_fallbacks"] > 0
    assert stats["offloaded_tensors"] + stats["cap_fallbacks"] == 5


@pytest.mark.parametrize("field, value, match", [
    ("keep_last", -1, "keep_last"),
    ("keep_last", 1.5, "keep_last"),
    ("prefetch_depth", -2, "prefetch_depth"),
    ("min_offload_bytes", -1, "min_offload_bytes"),
    ("host_memory_limit", "12XB", "host_memory_limit"),
    ("host_memory_limit", 1.5, "host_memory_limit"),
    ("host_memory_limit", 0, "host_memory_limit"),
    ("host_memory_limit", True, "host_memory_limit"),
    ("backend", "tpu", "backend"),
    ("scope", "everything", "scope"),
    ("max_inflight_d2h_groups", 0, "max_inflight_d2h_groups"),
])
def test_bad_config_values_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        ckpt_offload.OffloadConfig(**{field: value})


def test_unknown_override_names_the_field():
    with pytest.raises(ValueError, match="keep_lats"):
        ckpt_offload.offload_activations(keep_lats=1)


def test_host_memory_limit_forms():
    parse = ckpt_offload.parse_host_memory_limit
    assert parse("24GiB") == 24 * 2**30
    assert parse("512MB") == 512 * 10**6
    assert parse(4096) == 4096
    assert 0 < parse(0.25) < parse(0.5)
    assert parse(None) > 0


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.uint8]


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    dtype=st.sampled_from(_DTYPES),
    offset=st.integers(0, 7),
    permute_seed=st.integers(0, 1000),
    step=st.integers(1, 3),
)
def test_round_trip_over_shapes_strides_offsets_dtypes(shape, dtype, offset, permute_seed, step):
    offloader = _C.Offloader(keep_last=0, prefetch_depth=1, min_offload_bytes=0,
                             host_memory_limit=1 << 30, backend="host", scope="all")
    numel = 1
    for s in shape:
        numel *= s * step
    flat = (torch.arange(numel + offset) % 251).to(dtype)
    base = flat[offset:].view([s * step for s in shape])
    view = base[tuple(slice(None, None, step) for _ in shape)]
    order = torch.randperm(len(shape), generator=torch.Generator().manual_seed(permute_seed))
    view = view.permute(*order.tolist())
    restored = offloader.unpack(offloader.pack(view))
    assert restored.shape == view.shape
    assert restored.stride() == view.stride()
    assert restored.dtype == view.dtype
    assert torch.equal(restored, view)


def test_torch_checkpoint_called_directly_inside_the_context_is_offloaded():
    """torch.utils.checkpoint's own non-reentrant checkpoint saves its inputs through a
    private hook point that moved in torch 2.12; on every tested torch they are tagged."""
    model = make_mlp_stack(layers=3, hidden=32)
    x = torch.randn(4, 16, 32)
    reference = run_step(model, x, plain_ckpt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run_step(model, x, plain_ckpt, dict(keep_last=0, offload_head=False, **HOST))
    assert not [w for w in caught if "not offloaded" in str(w.message)], caught
    assert_same(reference, got)
    stats = got[2].stats()
    assert stats["offloaded_tensors"] == stats["restored_tensors"] == 3
