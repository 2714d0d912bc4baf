"""Activation peak of a LoRA training step on CPU, measured from the allocator's events.

The host backend runs the same engine on CPU tensors, so torch's CPU allocator sees what a
GPU's would: the profiler's memory events give the step's peak of live bytes. The model is
a Llama with the proportions of a 1B one (hidden : FFN : vocabulary = 1 : 4 : 15.6) at a
small width, so that figures in units of one hidden state carry over to the real size.

torch's save_on_cpu is the reference that keeps the least on the device (it moves every
saved tensor); it is emulated with host copies outside torch's allocator (numpy), which is
where its pinned copies live on a GPU machine.
"""

import torch
import transformers
from peft import LoraConfig, get_peft_model
from torch.profiler import ProfilerActivity, profile

from ckpt_offload.hf import enable_activation_offload

LAYERS = 16
HIDDEN = 256
SEQ = 512
HIDDEN_STATE_BYTES = SEQ * HIDDEN * 2  # one bfloat16 hidden state


def lora_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=1, vocab_size=4000,
        max_position_embeddings=SEQ, attn_implementation="sdpa", use_cache=False)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                             lora_dropout=0.0, task_type="CAUSAL_LM"))
    model.train()
    return model


class EmulatedSaveOnCpu:
    """torch.autograd.graph.save_on_cpu with its host copies outside torch's allocator."""

    @staticmethod
    def pack(tensor):
        data = tensor.detach().contiguous()
        if data.dtype == torch.bfloat16:
            data = data.view(torch.int16)
        return tensor.dtype, data.numpy().copy()

    @staticmethod
    def unpack(packed):
        dtype, array = packed
        tensor = torch.from_numpy(array).clone()
        return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor

    def __call__(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def step_peak(model, ids, context=None):
    """(peak live bytes over forward and backward, loss)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if context is None:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        else:
            with context():
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
    deltas = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live, peak = 0, 0
    for _, delta in deltas:
        live += delta
        peak = max(peak, live)
    model.zero_grad(set_to_none=True)
    return peak, loss.detach()


def test_activation_peak_below_save_on_cpu_and_every_layer_input_off_the_device():
    model = lora_llama()
    ids = torch.randint(0, 4000, (1, SEQ), generator=torch.Generator().manual_seed(1))
    step_peak(model, ids)  # warm-up: lazily created state stays out of the figures
    ckpt, ckpt_loss = step_peak(model, ids)
    save_on_cpu, soc_loss = step_peak(model, ids, EmulatedSaveOnCpu())
    handle = enable_activation_offload(model, backend="host",
                                       min_offload_bytes=HIDDEN_STATE_BYTES // 4)
    step_peak(model, ids)
    offload, offload_loss = step_peak(model, ids)
    stats = handle.stats()
    handle.disable()
    assert torch.equal(ckpt_loss, offload_loss) and torch.equal(ckpt_loss, soc_loss)
    saved_units = (ckpt - offload) / HIDDEN_STATE_BYTES
    print(f"peak in hidden states: ckpt {ckpt / HIDDEN_STATE_BYTES:.2f}, save_on_cpu "
          f"{save_on_cpu / HIDDEN_STATE_BYTES:.2f}, ckpt_offload "
          f"{offload / HIDDEN_STATE_BYTES:.2f} (saves {saved_units:.2f}); {stats}")
    # Every layer's input (the first one's too, under enable_input_require_grads) and the
    # final norm's float32 input (two hidden states) are off the device at the peak, which
    # is the loss's backward.
    assert stats["offloaded_tensors"] == LAYERS and stats["kept_resident_tensors"] == 0
    assert stats["head_offloaded_tensors"] == 1
    assert saved_units >= LAYERS + 2 - 0.05
    assert offload <= save_on_cpu
