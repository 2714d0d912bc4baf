"""Fused losses with activation offload on the GPU: Liger-Kernel (its model patch with the
defaults users turn on: fused linear cross-entropy, RMSNorm, SwiGLU, RoPE) and Cut
Cross-Entropy (`linear_cross_entropy` in the causal LM's forward, and in a custom loop on
the decoder's output). Each against the same model without offload: losses and LoRA
gradients identical, every layer input but the kept one offloaded, the activation peak
lower, allocated memory back at its baseline after each step.

Needs liger_kernel and cut_cross_entropy (skipped without them: tools/gpu_peers.sh brings
their wheels to the GPU machine).

    python -m pytest -s tests/gpu/fused_loss_gpu_test.py
"""

import gc
import types

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SEQ, LAYERS, VOCAB, STEPS = 2048, 4, 32000, 3


def build(loss: str):
    import transformers
    from peft import LoraConfig, get_peft_model

    # Eager attention: its kernels are deterministic, so runs compare bit for bit.
    config = transformers.LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=LAYERS,
        num_attention_heads=16, num_key_value_heads=4, vocab_size=VOCAB,
        max_position_embeddings=SEQ, attn_implementation="eager", use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    if loss == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)  # the defaults: FLCE, RMSNorm, SwiGLU, RoPE
    elif loss == "cce_forward":
        model.forward = types.MethodType(_cce_forward, model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                            lora_dropout=0.0, task_type="CAUSAL_LM"))


def _cce_forward(self, input_ids=None, labels=None, **kwargs):
    from cut_cross_entropy import linear_cross_entropy
    from transformers.modeling_outputs import CausalLMOutputWithPast

    kwargs.pop("num_items_in_batch", None)
    hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
    return CausalLMOutputWithPast(
        loss=linear_cross_entropy(hidden, self.lm_head.weight, labels, shift=True))


def loss_of(model, loss: str, ids):
    if loss == "cce_loop":  # a custom loop: the decoder's output into the fused loss
        from cut_cross_entropy import linear_cross_entropy

        causal_lm = model.get_base_model()
        hidden = causal_lm.model(input_ids=ids).last_hidden_state
        return linear_cross_entropy(hidden, causal_lm.lm_head.weight, ids, shift=True)
    return model(input_ids=ids, labels=ids).loss


def run(loss: str, offload: bool):
    from ckpt_offload.hf import enable_activation_offload

    model = build(loss)
    handle = enable_activation_offload(model, keep_last=1) if offload else None
    generator = torch.Generator().manual_seed(2)
    losses, grads, peaks, leftovers, offloaded = [], [], [], [], []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (1, SEQ), generator=generator).cuda()
        # Garbage in reference cycles (an earlier run's model) would otherwise be freed by
        # whichever step the collector runs in, and read as that step's leftovers.
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        value = loss_of(model, loss, ids)
        value.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
        losses.append(value.detach().float().item())
        grads.append({n: p.grad.detach().cpu() for n, p in model.named_parameters()
                      if p.requires_grad})
        model.zero_grad(set_to_none=True)
        del value
        torch.cuda.synchronize()
        leftovers.append(torch.cuda.memory_allocated() - before)
        if handle is not None:
            offloaded.append(handle.stats()["offloaded_tensors"])
    if handle is not None:
        handle.disable()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return dict(losses=losses, grads=grads, peaks=peaks, leftovers=leftovers,
                offloaded=offloaded)


def largest_difference(a, b) -> float:
    return max((x - y).abs().max().item() for ga, gb in zip(a["grads"], b["grads"])
               for x, y in ((ga[k].float(), gb[k].float()) for k in ga))


@pytest.mark.parametrize("loss", ["liger", "cce_forward", "cce_loop"])
def test_fused_loss_with_offload(loss, llama_module_restored):
    """(Liger's patch is undone after its case: the Cut Cross-Entropy cases run
    transformers' own layers.)"""
    pytest.importorskip("liger_kernel" if loss == "liger" else "cut_cross_entropy")
    reference = run(loss, offload=False)
    again = run(loss, offload=False)
    offloaded = run(loss, offload=True)
    # Whether the loss's own kernels repeat bit for bit decides what "the same" can mean.
    spread = largest_difference(reference, again)
    print(f"{loss}: losses {offloaded['losses']}, peaks without/with offload "
          f"{[p >> 20 for p in reference['peaks']]} / {[p >> 20 for p in offloaded['peaks']]} "
          f"MiB, offloaded tensors {offloaded['offloaded']}, reference run-to-run grad "
          f"difference {spread}")
    if spread == 0 and reference["losses"] == again["losses"]:
        assert offloaded["losses"] == reference["losses"]
        for expected, got in zip(reference["grads"], offloaded["grads"]):
            assert expected.keys() == got.keys()
            for name in expected:
                assert torch.equal(expected[name], got[name]), name
    else:  # the library's kernels are not deterministic: offload must stay within that
        assert largest_difference(reference, offloaded) <= 2 * spread
    assert all(count >= LAYERS - 1 for count in offloaded["offloaded"]), offloaded["offloaded"]
    # After the first step, whose peak includes the loss kernels' first-use buffers.
    assert max(offloaded["peaks"][1:]) < min(reference["peaks"][1:])
    # The first step's leftovers are the GPU's own first-use buffers (cuBLAS workspaces).
    assert offloaded["leftovers"][1:] == [0] * (STEPS - 1), offloaded["leftovers"]
