"""GPU soak (tag gpu): many steps of a Llama-like stack with changing sequence lengths,
gradient accumulation and periodic evals. Every micro-batch's loss equals a no-offload twin
stepped in lockstep, GPU allocated memory returns to its baseline after every step, and the
host pool stops growing after the first full-length step.

    CKPT_SOAK_STEPS=200 python -m pytest -s tests/gpu/soak_gpu_test.py
"""

import copy
import os
import sys

import pytest
import torch
import torch.utils.checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "torch_plugin"))

import ckpt_offload  # noqa: E402
from models import make_llama_stack  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = int(os.environ.get("CKPT_SOAK_STEPS", "200"))
MAX_SEQ = 4096


def plain_ckpt(layer, x):
    return torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)


@pytest.fixture(autouse=True)
def deterministic_attention():
    """Math attention. The fused SDPA kernels' backward accumulates with atomics, so two
    identical runs without any offload already differ in their gradients' last bits
    (tests/gpu/determinism_check.py: the no-offload control differs at step 0), and the
    soak's lockstep twins would part for a reason that is not ckpt_offload's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


def test_soak_losses_identical_and_memory_flat():
    torch.manual_seed(0)
    plain = make_llama_stack(layers=8, hidden=1024, heads=16, ffn=4096,
                             dtype=torch.bfloat16).cuda()
    offloaded = copy.deepcopy(plain)
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (plain, offloaded)]
    engine = ckpt_offload.offload_activations(keep_last=1, backend="cuda")
    generator = torch.Generator().manual_seed(1)
    baseline = None
    pool_after_warmup = None
    for step in range(STEPS):
        seq = MAX_SEQ if step == 0 else int(torch.randint(MAX_SEQ // 2, MAX_SEQ + 1, (1,),
                                                           generator=generator))
        for micro in range(2):
            x = torch.randn(1, seq, 1024, generator=generator).to("cuda", torch.bfloat16)
            loss_plain = plain(x, plain_ckpt) / 2
            loss_plain.backward()
            with engine:
                loss_offload = offloaded(x, ckpt_offload.checkpoint) / 2
                loss_offload.backward()
            assert torch.equal(loss_plain.detach(), loss_offload.detach()), (step, micro)
            del loss_plain, loss_offload, x
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        if step % 50 == 49:
            with torch.no_grad():
                x = torch.randn(1, MAX_SEQ // 2, 1024, device="cuda", dtype=torch.bfloat16)
                assert torch.equal(plain(x, lambda l, h: l(h)), offloaded(x, lambda l, h: l(h)))
        torch.cuda.synchronize()
        engine.synchronize()
        allocated = torch.cuda.memory_allocated()
        stats = engine.stats()
        if baseline is None:
            baseline = allocated
            pool_after_warmup = (stats["host_reserved_bytes"], stats["pinned_allocations"])
        assert allocated == baseline, f"step {step}: {allocated} != {baseline}"
        assert stats["host_live_bytes"] == 0
        assert (stats["host_reserved_bytes"], stats["pinned_allocations"]) == pool_after_warmup
        if step % 50 == 0 or step == STEPS - 1:
            print(f"step {step}: seq {seq}, GPU allocated {allocated / 2**30:.3f} GiB, host pool "
                  f"{stats['host_reserved_bytes'] / 2**30:.3f} GiB, pinned allocations "
                  f"{stats['pinned_allocations']}, exposed wait {stats['exposed_wait_ms']:.2f} ms")
    for a, b in zip(plain.parameters(), offloaded.parameters()):
        assert torch.equal(a, b)
