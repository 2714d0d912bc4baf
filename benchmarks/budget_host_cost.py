"""Host-side costs of memory_budget, on CPU (no GPU needed): the figures that
ckpt_offload.budget and ckpt_offload.hf.layer_budget quote.

1. The dispatch modes of a plan's layers: one Llama decoder layer with LoRA (r=16, every
   linear) built on the meta device, so that only host work runs; its forward's ops, and its
   forward's host time plain, under a pass-through mode, under the offloading mode
   (_OutputSaver) and under the replaying mode (_OutputReplay), for the 1B and 8B shapes.
2. Planning: plan_layers for the 8B figures with kept outputs and offloaded outputs, at
   many token counts: milliseconds and KiB per plan.

    PYTHONPATH=torch_plugin:hf_integration python benchmarks/budget_host_cost.py
"""

import contextlib
import time
import tracemalloc

import peft
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from ckpt_offload.budget import KeptOutput, OutputOffload, plan_layers, uniform_measurement
from ckpt_offload.hf.layer_budget import _OutputReplay, _OutputSaver

GIB, MIB = 1 << 30, 1 << 20
SHAPES = {"1b": (2048, 8192), "8b": (4096, 14336)}  # hidden, intermediate; 32 heads, 8 kv
SEQ = 2048
REPEATS = 200


class _Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class _NoEngine:
    """What the modes call on an engine, doing nothing (their own host work is measured)."""

    def save_into_group(self, tensor):
        return tensor

    def keep_here(self, tensor):
        return tensor

    def restore(self, tensor):
        return tensor


def lora_layer_forward(hidden: int, intermediate: int):
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate,
                         num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=1,
                         vocab_size=128256)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        holder = torch.nn.Module()
        holder.layer = LlamaDecoderLayer(config, 0)
        holder = holder.to(torch.bfloat16)
        rope = LlamaRotaryEmbedding(config)
    model = peft.get_peft_model(holder, peft.LoraConfig(
        r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                              "down_proj"]))
    layer = model.base_model.model.layer
    x = torch.empty(1, SEQ, hidden, device="meta", dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(SEQ, device="meta")[None]
    embeddings = rope(x, positions)
    return lambda: layer(x, position_embeddings=embeddings, attention_mask=None,
                         position_ids=positions)


def host_ms(forward, context) -> float:
    for _ in range(10):
        with context():
            forward()
    start = time.perf_counter()
    for _ in range(REPEATS):
        with context():
            forward()
    return (time.perf_counter() - start) / REPEATS * 1e3


def dispatch_modes() -> None:
    for name, (hidden, intermediate) in SHAPES.items():
        forward = lora_layer_forward(hidden, intermediate)
        with _Counting() as counting:
            forward()
        plain = host_ms(forward, contextlib.nullcontext)
        passing = host_ms(forward, _Counting)
        saver = host_ms(forward, lambda: _OutputSaver(_NoEngine(), frozenset(), frozenset(), {}))
        replay = host_ms(forward, lambda: _OutputReplay(_NoEngine(), {}))
        print(f"{name}: {counting.ops} ops per layer forward; host ms per forward: plain "
              f"{plain:.2f}, pass-through mode {passing:.2f}, offloading mode {saver:.2f} "
              f"(+{(saver - plain) / counting.ops * 1e3:.1f} us/op), replaying mode "
              f"{replay:.2f} (+{(replay - plain) / counting.ops * 1e3:.1f} us/op)")


# The 8B layer's measured ops at s8k: (op key, output MiB, ms), as budget_policy_test has them.
LLAMA_8B_OPS = (
    (("aten.mm.default", 0), 64, 0.85), (("aten.mm.default", 1), 16, 0.36),
    (("aten.mm.default", 2), 16, 0.37),
    (("aten._scaled_dot_product_flash_attention.default", 0), 64, 1.5),
    (("aten.mm.default", 3), 64, 0.85), (("aten.mm.default", 4), 224, 2.49),
    (("aten.mm.default", 5), 224, 2.49), (("aten.mm.default", 6), 64, 2.12),
    (("aten.mul.Tensor", 0), 64, 0.01),
)


def planning() -> None:
    tokens = 8192
    outputs = tuple(KeptOutput(key, mib * MIB / tokens, ms * 1e-3 / tokens)
                    for key, mib, ms in LLAMA_8B_OPS)
    measured = uniform_measurement(32, tokens, 2.25 * GIB / tokens, 12.1e-3 / tokens,
                                   int(27.5 * GIB), int(11.7 * GIB), outputs)
    offload = OutputOffload.for_engine(50e9, 1, 1, 2, 1 << 20, 64 * GIB)
    counts = range(4096, 8192, 16)
    start = time.perf_counter()
    for count in counts:
        plan_layers(measured, count, 40 * GIB, 0, offload)
    seconds = (time.perf_counter() - start) / len(counts)
    tracemalloc.start()
    plans = [plan_layers(measured, count, 40 * GIB, 0, offload) for count in counts]
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    last = plans[-1]
    print(f"planning, 8B with kept and offloaded outputs, 40 GiB: {len(plans)} token counts, "
          f"{seconds * 1e3:.1f} ms and {held / len(plans) / 1024:.1f} KiB per plan "
          f"({last.count('selective')} selective layers, {last.offloading_layers} offloading)")


def main() -> None:
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"peft {peft.__version__}")
    dispatch_modes()
    planning()


if __name__ == "__main__":
    main()
