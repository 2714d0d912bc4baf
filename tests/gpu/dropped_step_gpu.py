"""GPU check (tag gpu): steps whose graph is dropped without a full backward return GPU and
host memory to their baseline, on a Llama-3.2-1B-shaped LoRA model (vocab 128256, tied
embeddings, bf16, seq 4096) with ckpt_offload installed the HF way, against the same model
without offload. Prints one row per step and exits non-zero when a step leaves memory behind.

    python3 tests/gpu/dropped_step_gpu.py
"""

import sys

import torch

SEQ = 4096
VOCAB = 128256
TOLERANCE = 64 << 20  # allocator rounding; a leaked step holds gigabytes


def build_model():
    import transformers
    from peft import LoraConfig, get_peft_model

    config = transformers.LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=VOCAB, tie_word_embeddings=True,
        max_position_embeddings=SEQ, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                             lora_dropout=0.0, task_type="CAUSAL_LM"))
    model.train()
    return model


def lora_params_of_first_layer(model):
    return [p for name, p in model.named_parameters()
            if p.requires_grad and ".layers.0." in name]


# Each gets the step's loss and ends its graph in its own way.
def full_backward(model, loss):
    loss.backward()


def no_backward(model, loss):
    pass


def logged_only(model, loss):
    loss.item()


def nan_guard_skips(model, loss):
    if loss.item() > 0:  # a guard that decides to skip this step
        return
    loss.backward()


def partial_grad(model, loss):
    torch.autograd.grad(loss, lora_params_of_first_layer(model))


def retained_then_dropped(model, loss):
    loss.backward(retain_graph=True)


PATTERNS = [full_backward, no_backward, no_backward, no_backward, logged_only,
            nan_guard_skips, partial_grad, retained_then_dropped, full_backward]


def main() -> int:
    from ckpt_offload.hf import enable_activation_offload

    gib = float(1 << 30)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, seq {SEQ}, "
          f"vocab {VOCAB}")
    model = build_model()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=generator).cuda()
    failures = 0
    for mode in ("ckpt", "ckpt_offload"):
        handle = enable_activation_offload(model, backend="cuda") if mode == "ckpt_offload" \
            else None
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        print(f"\n{mode}: baseline allocated {baseline / gib:.3f} GiB")
        print("step  pattern                 peak GiB  after GiB  delta MiB  host live MiB")
        for step, pattern in enumerate(PATTERNS):
            torch.cuda.reset_peak_memory_stats()
            loss = model(input_ids=ids, labels=ids).loss
            pattern(model, loss)
            del loss
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            host_live = 0
            if handle is not None:
                handle.engine.synchronize()
                host_live = handle.engine.stats()["host_live_bytes"]
            after = torch.cuda.memory_allocated()
            delta = after - baseline
            ok = delta <= TOLERANCE and host_live == 0
            failures += not ok
            peak = torch.cuda.max_memory_allocated() / gib
            print(f"{step:4d}  {pattern.__name__:22s}  {peak:8.3f}"
                  f"  {after / gib:9.3f}  {delta / 2**20:9.1f}  {host_live / 2**20:13.1f}"
                  f"{'' if ok else '  LEAK'}")
        if handle is not None:
            print(f"totals: {handle.totals()['offloaded_bytes'] / gib:.2f} GiB offloaded over "
                  f"{handle.totals()['micro_steps']} steps")
            handle.disable()
    print(f"\n{'PASS' if failures == 0 else 'FAIL'}: {failures} step(s) left memory behind")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
