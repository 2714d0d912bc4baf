"""Bad input and misuse of ckpt_offload's Python API: every bad OffloadConfig value is a
ValueError naming the field and what it accepts, raised before anything is installed; misuse
(nested contexts, checkpoint without tensors, reentrant checkpointing) gives the documented
error or the documented no-op."""

import pytest
import torch
import torch.utils.checkpoint

import ckpt_offload
from ckpt_offload import _C

import fault_injector
from models import make_mlp_stack
from reliability_util import (fresh_host_config, grads, host_live_bytes, identical,
                              reference_step, saved_tensor_hooks_active)

INT_RANGE = "accepted: an int from"
LIMIT_FORMS = "accepted: an int of bytes, a size string"
BACKENDS = "('auto', 'cuda', 'host')"
SCOPES = "('checkpoint_inputs', 'all')"

# (field, bad value, what the message must say is accepted)
BAD_VALUES = [
    ("keep_last", -1, INT_RANGE + " 0 to"),
    ("keep_last", 1.5, INT_RANGE + " 0 to"),
    ("keep_last", True, INT_RANGE + " 0 to"),  # bool where an int is expected
    ("keep_last", "1", INT_RANGE + " 0 to"),
    ("keep_last", None, INT_RANGE + " 0 to"),
    ("keep_last", 2**31, INT_RANGE + " 0 to 2147483647"),  # beyond the engine's C++ int
    ("prefetch_depth", -2, INT_RANGE + " 0 to"),
    ("prefetch_depth", False, INT_RANGE + " 0 to"),
    ("prefetch_depth", 2**40, INT_RANGE + " 0 to 2147483647"),
    ("min_offload_bytes", -1, INT_RANGE + " 0 to"),
    ("min_offload_bytes", 1024.0, INT_RANGE + " 0 to"),
    ("min_offload_bytes", 2**63, INT_RANGE + " 0 to 9223372036854775807"),
    ("max_inflight_d2h_groups", 0, INT_RANGE + " 1 to"),
    ("max_inflight_d2h_groups", -3, INT_RANGE + " 1 to"),
    ("max_inflight_d2h_groups", True, INT_RANGE + " 1 to"),
    ("max_inflight_d2h_groups", 2**31, INT_RANGE + " 1 to 2147483647"),
    ("host_memory_limit", "12XB", LIMIT_FORMS),
    ("host_memory_limit", "", LIMIT_FORMS),
    ("host_memory_limit", "-1GB", LIMIT_FORMS),
    ("host_memory_limit", "0.0", LIMIT_FORMS),
    ("host_memory_limit", "0GiB", LIMIT_FORMS),
    ("host_memory_limit", "nan", LIMIT_FORMS),
    ("host_memory_limit", 1.5, LIMIT_FORMS),  # a fraction > 1
    ("host_memory_limit", -0.5, LIMIT_FORMS),
    ("host_memory_limit", float("nan"), LIMIT_FORMS),
    ("host_memory_limit", 1e-30, LIMIT_FORMS),  # a fraction of RAM that is 0 bytes
    ("host_memory_limit", 0, LIMIT_FORMS),
    ("host_memory_limit", -4096, LIMIT_FORMS),
    ("host_memory_limit", True, LIMIT_FORMS),
    ("host_memory_limit", [1], LIMIT_FORMS),
    ("host_memory_limit", 2**64, LIMIT_FORMS),  # beyond the engine's uint64_t
    ("host_memory_limit", "20000000000TB", LIMIT_FORMS),
    ("backend", "tpu", BACKENDS),
    ("backend", "CUDA", BACKENDS),
    ("backend", "", BACKENDS),
    ("backend", None, BACKENDS),
    ("backend", 1, BACKENDS),
    ("scope", "everything", SCOPES),
    ("scope", "ALL", SCOPES),
    ("scope", None, SCOPES),
    ("offload_head", 1, "True or False"),
    ("offload_head", "yes", "True or False"),
    ("offload_head", None, "True or False"),
]


def _ids(case):
    field, value, _ = case
    return f"{field}={value!r}"


def assert_nothing_installed():
    assert not saved_tensor_hooks_active()
    assert ckpt_offload.current_engine() is None


@pytest.mark.parametrize("field, value, accepted", BAD_VALUES, ids=[_ids(c) for c in BAD_VALUES])
def test_bad_value_names_field_and_accepted_values_everywhere(field, value, accepted):
    entry_points = [
        lambda: ckpt_offload.OffloadConfig(**{field: value}),
        lambda: ckpt_offload.OffloadConfig().replace(**{field: value}),
        lambda: ckpt_offload.offload_activations(**{field: value}),
        lambda: ckpt_offload.offload_activations(ckpt_offload.OffloadConfig(backend="host"),
                                                 **{field: value}),
    ]
    for make in entry_points:
        with pytest.raises(ValueError) as caught:
            make()
        message = str(caught.value)
        assert message.startswith(f"{field}:"), message
        assert accepted in message, message
        assert repr(value) in message or str(value) in message, message
        assert_nothing_installed()


def test_bad_value_inside_with_statement_installs_no_hooks():
    with pytest.raises(ValueError, match="^keep_last:"):
        with ckpt_offload.offload_activations(backend="host", keep_last=-1):
            pytest.fail("the block must not run")
    assert_nothing_installed()


@pytest.mark.parametrize("overrides", [
    dict(keep_last=0, prefetch_depth=0, max_inflight_d2h_groups=1, min_offload_bytes=0),
    dict(keep_last=2**31 - 1, prefetch_depth=2**31 - 1, max_inflight_d2h_groups=2**31 - 1),
    dict(min_offload_bytes=2**63 - 1),
    dict(host_memory_limit=2**64 - 1),
    dict(host_memory_limit=1),
    dict(host_memory_limit="1b"),
    dict(host_memory_limit=" 2 GiB "),
    dict(host_memory_limit="0.5"),
    dict(host_memory_limit=1.0),
])
def test_boundary_values_are_accepted_down_to_the_native_engine(overrides):
    # offload_activations builds the native offloader: the values must fit its C++ types.
    engine = ckpt_offload.offload_activations(backend="host", **overrides)
    with engine:
        assert ckpt_offload.current_engine() is engine
    assert_nothing_installed()


def test_unknown_field_lists_the_fields():
    with pytest.raises(ValueError) as caught:
        ckpt_offload.offload_activations(keep_lats=1)
    message = str(caught.value)
    assert "keep_lats" in message and "keep_last" in message and "prefetch_depth" in message


def test_config_argument_of_wrong_type():
    with pytest.raises(ValueError, match="^config: must be an OffloadConfig or None"):
        ckpt_offload.offload_activations({"keep_last": 1})


@pytest.mark.parametrize("kwargs, message", [
    (dict(keep_last=-1), "keep_last must be >= 0"),
    (dict(prefetch_depth=-1), "prefetch_depth must be >= 0"),
    (dict(max_inflight_d2h_groups=0), "max_inflight_d2h_groups must be >= 1"),
    (dict(min_offload_bytes=-5), "min_offload_bytes must be >= 0"),
    (dict(backend="tpu"), "backend must be 'cuda' or 'host'"),
    (dict(scope="some"), "scope must be 'checkpoint_inputs' or 'all'"),
])
def test_native_offloader_rejects_bad_values_by_field(kwargs, message):
    settings = dict(keep_last=1, prefetch_depth=1, min_offload_bytes=0,
                    host_memory_limit=1 << 20, backend="host", scope="all")
    settings.update(kwargs)
    with pytest.raises(ValueError, match=message):
        _C.Offloader(**settings)


def test_fault_hook_rejects_unknown_fault_kind():
    with pytest.raises(ValueError, match="'host_allocation', 'copy' or 'event'"):
        fault_injector.fail_next("disk", 1)


# Misuse.


def test_nested_context_is_refused_and_outer_context_keeps_working():
    model = make_mlp_stack(layers=4, hidden=32)
    x = torch.randn(4, 16, 32)
    reference = reference_step(model, x)
    settings = fresh_host_config(keep_last=1)
    model.zero_grad(set_to_none=True)
    with ckpt_offload.offload_activations(**settings) as outer:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        for inner in (ckpt_offload.offload_activations(**settings), outer):
            with pytest.raises(RuntimeError, match="already active.*cannot be nested"):
                with inner:
                    pytest.fail("the nested block must not run")
            # The refused entry changed nothing: same engine, same hooks.
            assert ckpt_offload.current_engine() is outer
            assert torch._C._autograd._top_saved_tensors_default_hooks(False) == hooks
        loss = model(x, ckpt_offload.checkpoint)
        loss.backward()
    assert_nothing_installed()
    assert identical(reference, (loss.detach(), grads(model)))
    # 4 layers: the head's trigger releases the kept one too.
    assert outer.stats()["offloaded_tensors"] == 4


def test_checkpoint_without_tensor_inputs_is_an_error_inside_and_outside_a_context():
    model = make_mlp_stack(layers=3, hidden=32)
    x = torch.randn(4, 16, 32)
    with pytest.raises(ValueError, match="no tensor arguments"):
        ckpt_offload.checkpoint(lambda: torch.ones(1))
    with pytest.raises(ValueError, match="no tensor arguments"):
        ckpt_offload.checkpoint(lambda n: torch.ones(n), 3)
    reference = reference_step(model, x)
    settings = fresh_host_config(keep_last=0)
    model.zero_grad(set_to_none=True)
    with ckpt_offload.offload_activations(**settings) as engine:
        with pytest.raises(ValueError, match="no tensor arguments"):
            ckpt_offload.checkpoint(lambda: torch.ones(1))
        # The refused call opened no group: the step that follows offloads as usual.
        loss = model(x, ckpt_offload.checkpoint)
        loss.backward()
    got = (loss.detach(), grads(model))
    assert identical(reference, got)
    assert engine.stats()["offloaded_tensors"] == 3
    assert engine.stats()["groups"] == 3


def test_checkpoint_with_tensors_only_as_keywords_runs_and_offloads_nothing():
    # Documented: keyword arguments reach the function unchanged and are not offloaded.
    x = torch.randn(8, 64, requires_grad=True)
    weight = torch.randn(64, 64, requires_grad=True)

    def fn(*, h):
        return (h @ weight).tanh()

    expected = torch.autograd.grad(fn(h=x * 2).sum(), (x, weight))
    settings = fresh_host_config(keep_last=0, scope="checkpoint_inputs")
    with ckpt_offload.offload_activations(**settings) as engine:
        out = ckpt_offload.checkpoint(fn, h=x * 2)
        got = torch.autograd.grad(out.sum(), (x, weight))
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert engine.stats()["offloaded_tensors"] == 0


def test_checkpoint_asked_to_be_reentrant_is_an_error():
    with pytest.raises(ValueError,
                       match="^use_reentrant: ckpt_offload.checkpoint is always non-reentrant"):
        ckpt_offload.checkpoint(lambda t: t, torch.ones(1), use_reentrant=True)


@pytest.mark.parametrize("scope", ["checkpoint_inputs", "all"])
def test_reentrant_torch_checkpoint_inside_the_context_trains_identically(scope):
    model = make_mlp_stack(layers=3, hidden=32)
    x = torch.randn(4, 16, 32, requires_grad=True)

    def reentrant(layer, h):
        return torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=True)

    model.zero_grad(set_to_none=True)
    loss = model(x, reentrant)
    loss.backward()
    reference = (loss.detach(), grads(model))
    model.zero_grad(set_to_none=True)
    with ckpt_offload.offload_activations(**fresh_host_config(keep_last=0, scope=scope)) as engine:
        loss = model(x, reentrant)
        loss.backward()
    assert identical(reference, (loss.detach(), grads(model)))
    stats = engine.stats()
    if scope == "checkpoint_inputs":
        # Nothing is tagged (the layers' recompute runs inside backward, where the plugin
        # packs nothing: TensorOffloader::Pack), so nothing moves.
        assert stats["offloaded_tensors"] == 0
    else:
        # Scope "all" moves what forward saved (the head's tensors, the reentrant
        # function's saved inputs) and gets every byte back.
        assert stats["offloaded_tensors"] > 0
        assert stats["restored_tensors"] == stats["offloaded_tensors"]
    assert host_live_bytes(engine) == 0


def test_mark_checkpoint_inputs_outside_a_context_is_a_no_op():
    t = torch.randn(4, 4)
    with ckpt_offload.mark_checkpoint_inputs(t):
        assert not saved_tensor_hooks_active()
    assert_nothing_installed()


def test_engine_object_reentered_after_exit_trains_identically():
    model = make_mlp_stack(layers=4, hidden=32)
    x = torch.randn(4, 16, 32)
    reference = reference_step(model, x)
    engine = ckpt_offload.offload_activations(**fresh_host_config(keep_last=1))
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with engine:
            loss = model(x, ckpt_offload.checkpoint)
            loss.backward()
        assert identical(reference, (loss.detach(), grads(model)))
        assert engine.stats()["offloaded_tensors"] == 4
    assert_nothing_installed()
