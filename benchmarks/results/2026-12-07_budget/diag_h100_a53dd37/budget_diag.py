"""Which part of a resident + offloading plan changes gradients on CUDA (diagnostic)."""
import dataclasses, gc, re, sys
import torch
sys.path.insert(0, "tests/gpu")
import budget_gpu_test as t
from ckpt_offload.budget import CHECKPOINT, RESIDENT, OutputOffload, plan_layers
from ckpt_offload.config import OffloadConfig
from ckpt_offload.copy_rate import host_copy_bytes_per_second
from ckpt_offload.hf import enable_activation_offload, install, layer_budget

GIB = 2**30
vocab = 128256


def diff(expected, got):
    (el, eg), (gl, gg) = expected, got
    out = []
    for step in range(t.STEPS):
        names = [n for n, g in eg[step].items() if not torch.equal(gg[step][n], g)]
        layers = sorted({int(m.group(1)) for n in names
                         for m in [re.search(r"layers\.(\d+)\.", n)] if m})
        out.append((bool(torch.equal(el[step], gl[step])), len(names), layers[:8],
                    [n.split("layers.")[-1] for n in names[:3]]))
    return out


def clean():
    gc.collect(); torch.cuda.empty_cache()


e1 = t.run(t.lora_llama(vocab))[:2]; clean()
e2 = t.run(t.lora_llama(vocab))[:2]; clean()
print("determinism", diff(e1, e2), flush=True)

model = t.lora_llama(vocab)
handle = enable_activation_offload(model)
t.run(model, handle, empty_cache=True)
measured = handle._budget.measurement
handle.disable(); del model, handle; clean()
rate = host_copy_bytes_per_second()
config = OffloadConfig()
offload = OutputOffload.for_engine(rate, config.keep_last, config.prefetch_depth,
                                   config.max_inflight_d2h_groups, config.min_offload_bytes)
budget = measured.peak_bytes
while plan_layers(measured, measured.tokens, budget, 0, offload).offloading_layers == 0:
    budget += GIB // 8
budget += GIB // 4
original_plan = layer_budget.plan_layers


def variant(name, transform=None, no_gradient_prefetch=False):
    saved_prefetch = install._prefetch_at_gradient
    if transform is not None:
        layer_budget.plan_layers = lambda *a, **k: transform(original_plan(*a, **k))
    if no_gradient_prefetch:
        install._prefetch_at_gradient = lambda engine, output: None
    try:
        model = t.lora_llama(vocab)
        handle = enable_activation_offload(model, memory_budget=budget)
        losses, grads, reserved, plans = t.run(model, handle, empty_cache=True)
        modes = "".join(m[0].upper() for m in handle.layer_modes())
        p = handle._budget.latest_plan
        off = [len(k) for k in p.offloaded_outputs]
        stats = handle.stats()
        handle.disable(); del model, handle; clean()
    finally:
        layer_budget.plan_layers = original_plan
        install._prefetch_at_gradient = saved_prefetch
    print(name, modes, "offloaded keys per layer", off, "restored", stats.get("restored_tensors"),
          "prefetched", stats.get("prefetched_tensors"), flush=True)
    for step, d in enumerate(diff(e1, (losses, grads))):
        print("   step", step, d, flush=True)


def no_resident(plan):
    return dataclasses.replace(
        plan, modes=tuple(CHECKPOINT if m == RESIDENT else m for m in plan.modes))


def no_offload(plan):
    return dataclasses.replace(plan, offloaded_outputs=tuple(frozenset() for _ in plan.modes))


variant("as planned")
variant("no gradient prefetch", no_gradient_prefetch=True)
variant("resident -> checkpoint", no_resident)
variant("no offloaded outputs", no_offload)
