"""The benchmarks' real-shape workloads: model shapes, LoRA models sharing one copy of the
base weights, and the losses users train them with.

Shapes are the public configurations of Llama-3.1-8B, Llama-3.2-1B (tied embeddings) and
Qwen3-8B, with their real vocabularies (128256, 151936), at random init in bf16 (the
figures measured here depend on shapes, not on weight values).

Losses:
- hf: the model's own loss (transformers' ForCausalLMLoss: full logits, upcast to float32);
- liger: Liger-Kernel's fused linear cross-entropy, patched onto the model instance the way
  `apply_liger_kernel_to_<family>(model=...)` does (only that patch, so the layers are the
  same as hf's);
- liger_full: Liger-Kernel's model patch with its defaults (rotary embedding, RMSNorm,
  SwiGLU and the fused loss), what Axolotl's Liger plugin turns on; it also patches
  transformers' module for every model built after it in the process;
- cce: Cut Cross-Entropy's `linear_cross_entropy` on the decoder's last hidden state and
  the LM head's weight, in the causal LM's forward (the PyPI package has no model patch:
  this is the forward its users write).
"""

from __future__ import annotations

import types
from typing import Dict

import torch

SHAPES: Dict[str, Dict] = {
    "llama3-8b": dict(family="llama", hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
    "llama3-1b": dict(family="llama", hidden_size=2048, intermediate_size=8192,
                      num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "qwen3-8b": dict(family="qwen3", hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                     rope_theta=1000000.0),
    # For smoke runs of the harnesses and the GPU tests.
    "tiny": dict(family="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
                 tie_word_embeddings=True),
    "tiny-qwen3": dict(family="qwen3", hidden_size=256, intermediate_size=512,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, vocab_size=4096, tie_word_embeddings=False),
}

LOSSES = ("hf", "liger", "liger_full", "cce")

# Long enough for every benchmark here; rotary tables are computed per step, not stored.
MAX_POSITIONS = 1 << 20


def config_of(shape: str, attn_implementation: str = "sdpa"):
    import transformers

    fields = dict(SHAPES[shape])
    family = fields.pop("family")
    config_class = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[family]
    return config_class(**fields, max_position_embeddings=MAX_POSITIONS,
                        attn_implementation=attn_implementation, use_cache=False)


def _causal_lm_class(config):
    import transformers

    return {"llama": transformers.LlamaForCausalLM,
            "qwen3": transformers.Qwen3ForCausalLM}[config.model_type]


def base_model(shape: str, attn_implementation: str = "sdpa", device: str = "cuda"):
    """The frozen bf16 base model (one copy, shared by every mode's LoRA model)."""
    config = config_of(shape, attn_implementation)
    torch.manual_seed(0)
    with torch.device(device):
        model = _causal_lm_class(config)(config).to(torch.bfloat16)
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def lora_model(base, loss: str = "hf"):
    """A model sharing `base`'s weights (no copy), with `loss` patched in and its own LoRA
    adapters (r=16 on all linear layers, the same seed for every call), checkpointing on."""
    from peft import LoraConfig, get_peft_model

    if loss not in LOSSES:
        raise SystemExit(f"loss: unknown {loss!r}; known: {', '.join(LOSSES)}")
    with torch.device("meta"):
        model = _causal_lm_class(base.config)(base.config)
    model.load_state_dict(base.state_dict(), assign=True)
    buffers = dict(base.named_buffers())
    for name, _ in list(model.named_buffers()):  # non-persistent ones (rotary frequencies)
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        owner._buffers[leaf] = buffers[name]
    model.tie_weights()
    patch_loss(model, loss)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                             lora_dropout=0.0, task_type="CAUSAL_LM"))
    model.train()
    return model


# The losses patched in this process: liger_full changes transformers' module for every model
# (built before or after it: layers look the module's functions up as they run).
_PATCHED_LOSSES: set = set()


def patch_loss(model, loss: str) -> None:
    """Makes `model` (a causal LM, before peft wraps it) compute its loss with `loss`."""
    losses = _PATCHED_LOSSES | {loss}
    if "liger_full" in losses and len(losses) > 1:
        raise SystemExit(f"loss: liger_full patches transformers for the whole process; run "
                         f"{', '.join(sorted(losses - {'liger_full'}))} in another one")
    _PATCHED_LOSSES.add(loss)
    if loss in ("liger", "liger_full"):
        from liger_kernel.transformers import monkey_patch

        apply = getattr(monkey_patch, f"apply_liger_kernel_to_{model.config.model_type}")
        if loss == "liger_full":
            apply(model=model)
        else:
            apply(rope=False, cross_entropy=False, fused_linear_cross_entropy=True,
                  rms_norm=False, swiglu=False, model=model)
    elif loss == "cce":
        model.forward = types.MethodType(_cce_forward, model)


def _cce_forward(self, input_ids=None, labels=None, **kwargs):
    """The causal LM's forward with Cut Cross-Entropy: the loss straight from the decoder's
    last hidden state and the LM head's weight; no logits are made."""
    from cut_cross_entropy import linear_cross_entropy
    from transformers.modeling_outputs import CausalLMOutputWithPast

    kwargs.pop("num_items_in_batch", None)
    hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
    loss = None
    if labels is not None:
        loss = linear_cross_entropy(hidden, self.lm_head.weight, labels, shift=1)
    return CausalLMOutputWithPast(loss=loss)
