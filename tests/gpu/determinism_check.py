"""Is the soak's workload deterministic on this GPU without offload, and with which offload
settings does it stay bit-identical? Runs the soak loop (tests/gpu/soak_gpu_test.py) for
STEPS steps per variant and prints the first step whose loss or gradients differ.

    python tests/gpu/determinism_check.py [STEPS]
"""

import copy
import contextlib
import os
import sys

import torch
import torch.utils.checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "torch_plugin"))

import ckpt_offload  # noqa: E402
from models import make_llama_stack  # noqa: E402

MAX_SEQ = 4096


def plain_ckpt(layer, x):
    return torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)


def run(variant, steps):
    torch.manual_seed(0)
    a = make_llama_stack(layers=8, hidden=1024, heads=16, ffn=4096, dtype=torch.bfloat16).cuda()
    b = copy.deepcopy(a)
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (a, b)]
    engine = None if variant is None else ckpt_offload.offload_activations(**variant)
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        seq = MAX_SEQ if step == 0 else int(torch.randint(MAX_SEQ // 2, MAX_SEQ + 1, (1,),
                                                           generator=generator))
        for micro in range(2):
            x = torch.randn(1, seq, 1024, generator=generator).to("cuda", torch.bfloat16)
            loss_a = a(x, plain_ckpt) / 2
            loss_a.backward()
            with engine if engine is not None else contextlib.nullcontext():
                loss_b = b(x, ckpt_offload.checkpoint if engine else plain_ckpt) / 2
                loss_b.backward()
            if not torch.equal(loss_a, loss_b):
                return f"loss differs at step {step} micro {micro} (seq {seq})"
        for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
            if not torch.equal(pa.grad, pb.grad):
                return f"gradient {name} differs at step {step} (seq {seq})"
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=False)
    return f"identical for {steps} steps"


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 30
    if "--math" in sys.argv:  # deterministic attention (the fused kernels' backward is not)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa_kernel(SDPBackend.MATH).__enter__()
        print("SDPA: math")
    variants = [
        ("no offload (control)", None),
        ("offload, offload_head=False", dict(keep_last=1, backend="cuda", offload_head=False)),
        ("offload, defaults", dict(keep_last=1, backend="cuda")),
    ]
    for label, variant in variants:
        print(f"{label}: {run(variant, steps)}", flush=True)


if __name__ == "__main__":
    main()
