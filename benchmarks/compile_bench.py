"""Compiled training with ckpt_offload against compiled checkpointing, in one process.

    python benchmarks/compile_bench.py --configs llama3-1b:8192,llama3-8b:32768 --out DIR

Workload (benchmarks/workloads.py): peft LoRA (r=16, all linear layers) on random-init bf16
Llama-3-shaped models (vocabulary 128256; the 1B ties its embeddings), batch 1, sdpa
attention, non-reentrant gradient checkpointing, loss computed by the model (transformers'
ForCausalLMLoss).
Every mode has its own model; all share the same frozen base weights (one copy on the
GPU) and get identical LoRA weights and token ids. Modes run interleaved, one step each per
round, so drift hits all alike; the first rounds (compilation, warm-up) are not timed.

Modes:
- ckpt, ckpt_offload: eager, without and with ckpt_offload;
- compiled_ckpt: torch.compile(model), checkpointing alone (the whole model, one graph);
- compiled_ckpt_offload: enable_activation_offload(model), then torch.compile(model) (what
  a user writes; ckpt_offload compiles the model region by region under it);
- compiled_regions_ckpt: ckpt_offload.hf.compile_regions(model) without offload (the
  reference for bit-identical losses);
- compiled_axolotl_hs: torch.compile(model) with axolotl's hidden-states offload (peer).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

# The same run metadata as the eager benchmark, workloads and peers as real_bench.
from gpu_bench import fmt, meta, run_line
from peers import peer_context
from workloads import SHAPES, base_model, lora_model

GIB = 2**30

ALL_MODES = ("compiled_ckpt", "compiled_ckpt_offload", "compiled_regions_ckpt",
             "compiled_axolotl_hs", "ckpt", "ckpt_offload")


class Mode:
    """A model and how one training step runs on it."""

    def __init__(self, name: str, model, call: Callable, context=contextlib.nullcontext,
                 handle=None):
        self.name, self.model, self.call, self.context, self.handle = (
            name, model, call, context, handle)
        self.times: List[float] = []
        self.peaks: List[int] = []
        self.losses: List[float] = []
        self.graph_breaks = 0
        self.error = ""


def make_mode(name: str, base, peers_dir: str) -> Mode:
    from ckpt_offload.hf import compile_regions, enable_activation_offload

    model = lora_model(base)
    if name == "ckpt":
        return Mode(name, model, model)
    if name == "ckpt_offload":
        return Mode(name, model, model, handle=enable_activation_offload(model))
    if name == "compiled_ckpt":
        return Mode(name, model, torch.compile(model))
    if name == "compiled_ckpt_offload":
        handle = enable_activation_offload(model)
        return Mode(name, model, torch.compile(model), handle=handle)
    if name == "compiled_regions_ckpt":
        compile_regions(model)
        return Mode(name, model, model)
    if name == "compiled_axolotl_hs":
        return axolotl_mode(model, peers_dir)
    raise SystemExit(f"--modes: unknown mode {name!r}; known: {', '.join(ALL_MODES)}")


def axolotl_mode(model, peers_dir: str) -> Mode:
    """axolotl's `activation_offloading: hidden_states` around a whole-model compile."""
    context = peer_context("axolotl_hs", model, peers_dir)
    return Mode("compiled_axolotl_hs", model, torch.compile(model), context=context)


def step(mode: Mode, ids) -> None:
    from torch._dynamo.utils import counters

    breaks_before = sum(counters["graph_break"].values())
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    with mode.context():
        loss = mode.call(input_ids=ids, labels=ids).loss
        loss.backward()
    torch.cuda.synchronize()
    mode.times.append((time.perf_counter() - start) * 1e3)
    mode.peaks.append(torch.cuda.max_memory_allocated() - before)
    mode.losses.append(float(loss.detach()))
    mode.model.zero_grad(set_to_none=True)
    mode.graph_breaks += sum(counters["graph_break"].values()) - breaks_before


def run_config(shape: str, seq: int, names: List[str], rounds: int, warmup: int,
               peers_dir: str) -> List[Dict]:
    base = base_model(shape)
    modes = []
    for name in names:
        try:
            modes.append(make_mode(name, base, peers_dir))
        except Exception as error:  # noqa: BLE001 - a peer that fails must not lose the rest
            print(f"== {shape}:{seq} {name}: setup failed: {type(error).__name__}: {error}")
    ids = torch.randint(0, SHAPES[shape]["vocab_size"], (1, seq),
                        generator=torch.Generator().manual_seed(1234)).cuda()
    for index in range(warmup + rounds):
        for mode in modes:
            if mode.error:
                continue
            try:
                step(mode, ids)
            except Exception as error:  # noqa: BLE001
                mode.error = f"{type(error).__name__}: {error}".splitlines()[0]
                gc.collect()
                torch.cuda.empty_cache()
            print(f"round {index} {mode.name}: "
                  + (mode.error or f"{mode.times[-1]:.1f} ms, "
                     f"{mode.peaks[-1] / GIB:.2f} GiB, loss {mode.losses[-1]:.6f}"),
                  flush=True)
    results = []
    reference = {m.name: m for m in modes if not m.error}
    for mode in modes:
        result = dict(model=shape, seq=seq, mode=mode.name)
        if mode.error:
            result["error"] = mode.error
            results.append(result)
            continue
        timed = mode.times[warmup:]
        result.update(step_ms=statistics.median(timed), step_ms_all=mode.times,
                      act_peak_gib=max(mode.peaks[warmup:]) / GIB,
                      losses=mode.losses, graph_breaks=mode.graph_breaks)
        if mode.handle is not None:
            stats = mode.handle.stats()
            result.update(offloaded_gib=stats.get("offloaded_bytes", 0) / GIB,
                          head_offloaded_gib=stats.get("head_offloaded_bytes", 0) / GIB,
                          exposed_wait_ms=stats.get("exposed_wait_ms", 0),
                          compiled_regions=len(mode.handle.regions.modules)
                          if mode.handle.regions is not None else 0)
        results.append(result)
    for result in results:
        for ref_name, key in (("compiled_ckpt", "vs_compiled_ckpt"), ("ckpt", "vs_eager_ckpt")):
            ref = reference.get(ref_name)
            if ref is not None and "step_ms" in result:
                ref_ms = statistics.median(ref.times[warmup:])
                result[key] = result["step_ms"] / ref_ms
        regions = reference.get("compiled_regions_ckpt")
        if regions is not None and result["mode"] == "compiled_ckpt_offload" and "losses" in result:
            result["losses_equal_compiled_regions_ckpt"] = result["losses"] == regions.losses
    del modes, base
    gc.collect()
    torch.cuda.empty_cache()
    return results


def markdown_table(report: Dict) -> str:
    m = report["meta"]
    lines = [run_line(m), "",
             "| model | seq | mode | step ms | × compiled ckpt | × eager ckpt | act peak GiB | "
             "graph breaks | offloaded GiB |",
             "|---|---|---|---|---|---|---|---|---|"]

    for r in report["runs"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['seq']} | {r['mode']} | {r['error']} ||||||")
            continue
        lines.append("| " + " | ".join([
            r["model"], str(r["seq"]), r["mode"], fmt(r["step_ms"], ".0f"),
            fmt(r.get("vs_compiled_ckpt"), ".4f"), fmt(r.get("vs_eager_ckpt"), ".4f"),
            fmt(r["act_peak_gib"], ".2f"), fmt(r.get("graph_breaks"), "d"),
            fmt(r.get("offloaded_gib"), ".2f")]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="llama3-1b:8192")
    parser.add_argument("--modes", default=",".join(ALL_MODES))
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first rounds")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="compile_bench")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("compile_bench needs a CUDA GPU")
    # Every mode's model goes through the one nn.Module._call_impl frame (whole-model and
    # regional compiles alike), so each is a cache entry of that code object.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    os.makedirs(args.out, exist_ok=True)
    peers_dir = os.environ.get("CKPT_OFFLOAD_PEERS_DIR", ".peers")
    runs: List[Dict] = []
    for item in args.configs.split(","):
        shape, _, seq = item.partition(":")
        if shape not in SHAPES:
            raise SystemExit(f"--configs: unknown shape {shape!r}; known: {sorted(SHAPES)}")
        runs.extend(run_config(shape, int(seq), args.modes.split(","), args.rounds,
                               args.warmup, peers_dir))
        report = dict(meta=meta(), runs=runs)
        with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.join(args.out, f"{args.tag}.md"), "w") as f:
            f.write(markdown_table(report))
        print(markdown_table(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
