"""Where a planned step's memory goes, layer by layer, against the plan's prediction.

    python benchmarks/budget_trace.py --configs llama3-8b:8192:80 --loss liger --out DIR
    python benchmarks/budget_trace.py --configs llama3-1b:4096:30 --attention eager --out DIR

For each config (shape:seq:cap, as budget_bench.py's) two LoRA models over one base: today's
ckpt_offload (every layer checkpointed) and memory_budget="auto". After their warm-up (the
budget's second step is its measured one), one traced step of ckpt_offload and two of the
budget's plan. A traced step records the allocator's allocated bytes and its peak in each
stretch: each decoder layer's forward, the head (the last layer's forward end to its
gradient), each layer's backward (its output's gradient to the layer below's). The budget's
figures beside them: the measured step's phase peaks, and the terms of its plan's predicted
allocated peak (_Phases.allocated: kept, the resident layers' part and the one keeping
least, the transit).
Tracing resets the allocator's peak at every boundary, so no traced step is a measured one.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from typing import Dict, List, Optional

import torch

from budget_bench import GIB, set_cap
from gpu_bench import meta
from workloads import base_model, lora_model


class Trace:
    """The allocator's figures at each stretch boundary of one step (see the module)."""

    def __init__(self, layers):
        self.layers = layers
        self.tracing = False
        self.forward_done = False
        self.stretches: List[Dict] = []
        self._name = "start"
        self._hooks = []
        for index, layer in enumerate(layers):
            self._hooks.append(layer.register_forward_pre_hook(self._pre(index)))
            self._hooks.append(layer.register_forward_hook(self._post(index)))

    def _mark(self, next_name: str) -> None:
        self.stretches.append(dict(stretch=self._name,
                                   peak_gib=torch.cuda.max_memory_allocated() / GIB,
                                   end_gib=torch.cuda.memory_allocated() / GIB))
        self._name = next_name
        torch.cuda.reset_peak_memory_stats()

    def _pre(self, index: int):
        def hook(module, args):
            if self.tracing and not self.forward_done:
                self._mark(f"forward {index}")
        return hook

    def _post(self, index: int):
        def hook(module, args, output):
            if not self.tracing or self.forward_done:
                return  # a recompute's forward
            self._mark("head" if index == len(self.layers) - 1 else f"between {index}")
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                hidden.register_hook(self._gradient(index))
            if index == len(self.layers) - 1:
                self.forward_done = True
        return hook

    def _gradient(self, index: int):
        def hook(grad):
            self._mark(f"backward {index}")
        return hook

    def step(self, model, ids) -> List[Dict]:
        self.stretches, self._name = [], "start"
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.tracing, self.forward_done = True, False
        try:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.cuda.synchronize()
            self._mark("done")
        finally:
            self.tracing = False
        model.zero_grad(set_to_none=True)
        return self.stretches

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def plain_step(model, ids) -> None:
    gc.collect()
    torch.cuda.empty_cache()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)


def decoder_layers(model):
    return model.base_model.model.model.layers


def run_config(base, shape: str, seq: int, cap: str, loss: str) -> Dict:
    from ckpt_offload import budget as policy
    from ckpt_offload.hf import enable_activation_offload

    cap_bytes = set_cap(cap)
    generator = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, base.config.vocab_size, (1, seq), generator=generator).cuda()
    today = lora_model(base, loss)
    today_handle = enable_activation_offload(today)
    planned = lora_model(base, loss)
    handle = enable_activation_offload(planned, memory_budget="auto")
    calls = []  # every _Phases.allocated call: its terms and its result
    original = policy._Phases.allocated

    def recorded(self, kept, resident, lowest_resident, transit, *rest):
        result = original(self, kept, resident, lowest_resident, transit, *rest)
        calls.append(dict(step_gib=self.step / GIB, head_phase_gib=self.head_phase / GIB,
                          head_gib=self.head / GIB,
                          forward_gib=self.forward / GIB,
                          layers_gib=self.layers / GIB, stranded_gib=self.stranded / GIB,
                          layers_stranded_gib=self.layers_stranded / GIB, kept_gib=kept / GIB,
                          resident_gib=resident / GIB, lowest_resident_gib=lowest_resident / GIB,
                          transit_gib=transit / GIB, allocated_gib=result / GIB))
        return result

    policy._Phases.allocated = recorded
    try:
        for _ in range(3):  # warm-up: the budget measures its second step, plans its third
            plain_step(today, ids)
            plain_step(planned, ids)
        measured = handle._budget.measurement
        plan = handle._budget.latest_plan
        final = [c for c in calls
                 if abs(c["allocated_gib"] - plan.predicted_allocated_bytes / GIB) < 1e-6]
        traces = {}
        for name, model in (("ckpt_offload", today), ("budget", planned),
                            ("budget again", planned)):
            trace = Trace(decoder_layers(model))
            try:
                traces[name] = trace.step(model, ids)
            finally:
                trace.remove()
        layers = [dict(mode=plan.modes[i],
                       saved_gib=c.saved_bytes_per_token * measured.tokens / GIB,
                       input_gib=c.input_bytes_per_token * measured.tokens / GIB,
                       kept_gib=sum(o.bytes_per_token for o in c.outputs
                                    if o.key in plan.kept_outputs[i]) * measured.tokens / GIB,
                       offloaded_gib=sum(o.bytes_per_token for o in c.outputs
                                         if o.key in plan.offloaded_outputs[i])
                       * measured.tokens / GIB)
                  for i, c in enumerate(measured.layers)]
        result = dict(
            shape=shape, seq=seq, cap=cap, cap_gib=cap_bytes / GIB, loss=loss,
            plan=plan.describe(), predicted_peak_gib=plan.predicted_peak_bytes / GIB,
            predicted_allocated_gib=plan.predicted_allocated_bytes / GIB,
            terms=final[-1] if final else None,
            measured=dict(peak_gib=measured.peak_bytes / GIB,
                          activation_peak_gib=measured.activation_peak_bytes / GIB,
                          head_phase_gib=measured.head_phase_peak_bytes / GIB,
                          forward_gib=measured.forward_peak_bytes / GIB,
                          head_gib=measured.head_peak_bytes / GIB,
                          layer_phase_gib=measured.layer_phase_peak_bytes / GIB,
                          head_rise_gib=measured.head_rise_bytes / GIB,
                          stranded_gib=measured.stranded_bytes / GIB),
            layers=layers, traces=traces, stats=handle.stats())
    finally:
        policy._Phases.allocated = original
        today_handle.disable()
        handle.disable()
    return result


def summary(result: Dict) -> str:
    lines = [f"{result['shape']} s{result['seq']} cap {result['cap_gib']:.1f} GiB "
             f"({result['loss']}): {result['plan']}",
             f"predicted allocated {result['predicted_allocated_gib']:.2f} GiB, reserved "
             f"{result['predicted_peak_gib']:.2f}; terms {json.dumps(result['terms'])}",
             f"measured step: {json.dumps(result['measured'])}"]
    for name, stretches in result["traces"].items():
        top = max(stretches, key=lambda s: s["peak_gib"])
        lines.append(f"{name}: peak {top['peak_gib']:.2f} GiB in {top['stretch']}")
        lines.append("  " + "; ".join(f"{s['stretch']} {s['peak_gib']:.2f}/{s['end_gib']:.2f}"
                                      for s in stretches))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", required=True)
    parser.add_argument("--loss", default="hf")
    parser.add_argument("--attention", default="sdpa",
                        help="the models' attn_implementation (eager: a layer's forward "
                             "holds its attention probabilities in float32)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    report = dict(meta=meta(), attention=args.attention, runs=[])
    print(f"attn_implementation {args.attention}", flush=True)
    base, base_shape = None, None
    for item in args.configs.split(","):
        shape, seq, cap = item.split(":")
        if shape != base_shape:
            base = None
            gc.collect()
            base, base_shape = base_model(shape, args.attention), shape
        result = run_config(base, shape, int(seq), cap, args.loss)
        report["runs"].append(result)
        print(summary(result), flush=True)
        with open(os.path.join(args.out, "budget_trace.json"), "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
