"""One small offloaded training step on the GPU, for compute-sanitizer (memcheck, racecheck):
    compute-sanitizer --tool memcheck python tests/gpu/sanitizer_step.py
Exits non-zero when the offloaded step differs from plain checkpointing."""

import os
import sys

import torch
import torch.utils.checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "torch_plugin"))

import ckpt_offload  # noqa: E402
from models import grads, make_llama_stack  # noqa: E402


def main():
    # Math attention: cuDNN's fused SDPA kernels report shared-memory hazards of their own
    # under racecheck, which would hide anything of ours.
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    model = make_llama_stack(layers=3, hidden=128, heads=4, ffn=256, dtype=torch.bfloat16).cuda()
    x = torch.randn(1, 128, 128, device="cuda", dtype=torch.bfloat16)
    loss = model(x, lambda f, h: torch.utils.checkpoint.checkpoint(f, h, use_reentrant=False))
    loss.backward()
    reference = (loss.detach(), grads(model))
    model.zero_grad(set_to_none=True)
    with ckpt_offload.offload_activations(keep_last=1, backend="cuda", min_offload_bytes=0) as e:
        loss = model(x, ckpt_offload.checkpoint)
        loss.backward()
    torch.cuda.synchronize()
    same = torch.equal(reference[0], loss.detach()) and all(
        torch.equal(v, grads(model)[k]) for k, v in reference[1].items())
    # The head's path runs too: the head Linear's input is offloaded, triggered by the
    # loss's float32 input, and releases the kept layer.
    print("offloaded step identical:", same, "stats:", {k: e.stats()[k] for k in
          ("offloaded_tensors", "restored_tensors", "kept_resident_tensors",
           "head_offloaded_tensors", "head_restored_tensors")})
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
