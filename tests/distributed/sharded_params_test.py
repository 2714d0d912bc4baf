"""Sharded and managed parameters are never offloaded, even with scope="all" and
min_offload_bytes=0: FSDP2's DTensor, nn.Parameter (frozen or not) and DeepSpeed ZeRO-3
partitioned parameters pass through the pack hook untouched (one process, CPU, gloo)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ckpt_offload

# Every saved tensor that may move does: each is its own group, none is kept resident.
EVERYTHING = dict(backend="host", scope="all", min_offload_bytes=0, keep_last=0)


@pytest.fixture(scope="module")
def gloo_group(tmp_path_factory):
    """A 1-process gloo group through a file, so no socket is opened."""
    init_file = tmp_path_factory.mktemp("process_group") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def saved_types(function):
    """Python types of the tensors autograd saves while `function()` runs."""
    types = []

    def pack(tensor):
        types.append(type(tensor))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function()
    return types


def grads_of(function, tensors):
    """Gradients of `function()` for `tensors`, left with no gradient afterwards."""
    function().backward()
    grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return grads


def storage_of(tensor) -> int:
    from torch.distributed.tensor import DTensor

    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).data_ptr()


def test_dtensor_is_never_offloaded(gloo_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    weight = distribute_tensor(torch.randn(64, 64), mesh, [Shard(0)]).requires_grad_()
    x = distribute_tensor(torch.randn(8, 64), mesh, [Replicate()]).requires_grad_()

    def step():
        return (x @ weight).sin().sum()

    saved = saved_types(step)
    assert saved and all(t is DTensor for t in saved), saved
    expected_grads = grads_of(step, [x, weight])

    with ckpt_offload.offload_activations(**EVERYTHING) as engine:
        # The hooks themselves: the same object back, not a copy.
        assert engine._offloader.unpack(engine._offloader.pack(weight)) is weight
        loss = step()
    stats = engine.stats()
    assert stats["offloaded_tensors"] == 0 and stats["offloaded_bytes"] == 0
    assert stats["skipped_tensors"] == len(saved) + 1  # autograd's saves and the call above
    assert stats["host_live_bytes"] == 0
    mm = loss.grad_fn.next_functions[0][0].next_functions[0][0]
    assert isinstance(mm._saved_mat2, DTensor)
    assert storage_of(mm._saved_mat2) == storage_of(weight)  # the shard itself, not a copy
    loss.backward()
    assert torch.equal(x.grad.full_tensor(), expected_grads[0].full_tensor())
    assert torch.equal(weight.grad.full_tensor(), expected_grads[1].full_tensor())


def test_dtensor_settings_do_offload_plain_tensors(gloo_group):
    """The control for the test above: the same settings move plain saved tensors."""
    torch.manual_seed(0)
    weight = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(8, 64, requires_grad=True)
    with ckpt_offload.offload_activations(**EVERYTHING) as engine:
        loss = ((x * 1.0) @ (weight * 1.0)).sin().sum()  # saves both operands and mm's output
    assert engine.stats()["offloaded_tensors"] == 3
    assert engine.stats()["skipped_tensors"] == 0
    loss.backward()
    assert engine.stats()["host_live_bytes"] == 0


@pytest.mark.parametrize("requires_grad", [False, True], ids=["frozen", "trainable"])
def test_parameter_is_never_offloaded(requires_grad):
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64, 64), requires_grad=requires_grad)
    x = torch.randn(8, 64, requires_grad=True)

    def step():
        return ((x * 1.0) @ weight).sin().sum()  # mm saves the Parameter object itself

    saved = saved_types(step)
    params_saved = saved.count(torch.nn.Parameter)
    assert params_saved == 1, saved
    expected = grads_of(step, [x])

    with ckpt_offload.offload_activations(**EVERYTHING) as engine:
        assert engine._offloader.unpack(engine._offloader.pack(weight)) is weight
        loss = step()
    stats = engine.stats()
    assert stats["skipped_tensors"] == params_saved + 1  # autograd's save and the call above
    # Only the plain tensors moved: mm's output saved by sin (and mm's input, when the
    # weight needs a gradient).
    assert stats["offloaded_tensors"] == len(saved) - params_saved
    mm = loss.grad_fn.next_functions[0][0].next_functions[0][0]
    assert storage_of(mm._saved_mat2) == storage_of(weight)  # the weight itself, not a copy
    loss.backward()
    assert torch.equal(x.grad, expected[0])
    assert engine.stats()["host_live_bytes"] == 0


@pytest.mark.xfail(strict=True, reason=(
    "F.linear saves weight.t(), a view of the Parameter whose Python type is torch.Tensor: "
    "the pack binding's type check does not see it, so scope='all' offloads weight views"))
def test_parameter_views_are_never_offloaded():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64, bias=False)
    x = torch.randn(8, 64, requires_grad=True)
    with ckpt_offload.offload_activations(**EVERYTHING) as engine:
        loss = F.linear(x * 1.0, layer.weight).sin().sum()
    loss.backward()
    # Saved: x * 1.0, weight.t() and the linear output; only the two activations may move.
    assert engine.stats()["offloaded_tensors"] == 2


def test_deepspeed_zero3_partitioned_parameter_is_never_offloaded(gloo_group, monkeypatch):
    """Runs where deepspeed is installed (not a project requirement), on its CPU accelerator."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)  # what a launcher would set; deepspeed reads them
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    deepspeed.init_distributed(dist_backend="gloo")
    # Persistence threshold 0: even these small weights stay partitioned between uses.
    config = {"train_micro_batch_size_per_gpu": 8,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 64))
    engine, *_ = deepspeed.initialize(model=model, config=config)
    weight = model[0].weight
    assert hasattr(weight, "ds_tensor") and weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
    x = torch.randn(8, 64, requires_grad=True)

    def step():
        return engine(x * 1.0).sin().sum()

    # What ZeRO-3 saves: its gathered parameters (nn.Parameter with a ds_id) and plain
    # activations, one of them twice (tanh's output is the second linear's input).
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: (saved.append((type(t), hasattr(t, "ds_id"), t.data_ptr())), t)[1],
            lambda t: t):
        loss = step()
    engine.backward(loss)
    engine.step()
    zero_params = [s for s in saved if s[0] is torch.nn.Parameter and s[1]]
    activations = {s[2] for s in saved if s[0] is torch.Tensor}
    assert len(zero_params) == 4 and len(zero_params) + len(activations) < len(saved), saved

    with ckpt_offload.offload_activations(**EVERYTHING) as offload:
        assert offload._offloader.pack(weight) is weight  # partitioned: an empty placeholder
        loss = step()
    stats = offload.stats()
    assert stats["skipped_tensors"] == len(zero_params) + 1  # and the call above
    assert stats["offloaded_tensors"] == len(activations)
    engine.backward(loss)
    engine.step()
    assert offload.stats()["host_live_bytes"] == 0
    assert weight.ds_status == ZeroParamStatus.NOT_AVAILABLE  # still partitioned after
