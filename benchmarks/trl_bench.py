"""TRL's checkpointing toggles and generation with ckpt_offload installed (issue 29), in
one process, without TRL (the GPU machine has none): its pattern is reproduced here.

    python benchmarks/trl_bench.py --out DIR          # both parts: about 5 minutes on an H200

Part `toggle` (default: Llama-3.1-8B's shape, vocabulary 128256, seq 16384, the model's own
loss, peft LoRA r=16 on all linear layers, bf16, batch 1; benchmarks/workloads.py). Four
modes, each its own LoRA model over one shared copy of the base weights, the same LoRA
init and token ids, interleaved one training step (forward + backward) each per round; the
first --warmup rounds are not timed (the second is ckpt_offload's profiled step):

    ckpt               non-reentrant checkpointing alone
    ckpt_trl           the same, with TRL's pattern before every step
    ckpt_offload       ckpt_offload installed (enable_activation_offload)
    ckpt_offload_trl   ckpt_offload installed, TRL's pattern before every step

TRL's pattern is what trl.models.utils.disable_gradient_checkpointing() does around DPO's
and KTO's reference forward with LoRA (and GRPO's and RLOO's around theirs, after each
generation): model.gradient_checkpointing_disable(), the forward under no_grad with the
adapters disabled, model.gradient_checkpointing_enable({"use_reentrant": False}). It
runs before the step and is not part of its time. Before the fix, every step after it
prefetched 1 layer input and waited for the others. Printed per step: ms, prefetched /
restored / offloaded layer inputs and exposed wait; per mode: median step time and the
median of each round's ratio to ckpt's step of the round (`paired`), both against ckpt
(the *_trl modes also against ckpt_trl).

Part `generate` (default: Llama-3.2-1B's shape, LoRA as above): model.generate() under
no_grad in eval mode, 8 prompts x 256 random tokens + 256 new tokens (greedy, KV cache,
min_new_tokens so every call makes all 256), with and without ckpt_offload installed on
the model, interleaved, one warm-up round, then --gen_rounds timed ones. Printed: ms per
call and per decode forward, and the installed model's overhead (median of the rounds'
ratios). With --gen_train, the same in training mode with checkpointing on (generation
that leaves the model in training mode: the layers call their checkpoint function, and
transformers turns the KV cache off, so each call takes several times longer).

Writes DIR/trl_bench.json (every step's figures, the medians, versions) and prints a
summary. --device cpu --shape tiny --gen_shape tiny --seq 256 --prompt 16 --new 16 is a
smoke run of the harness on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch

from workloads import SHAPES, base_model, lora_model

GIB = 2**30
TOGGLE_MODES = ("ckpt", "ckpt_trl", "ckpt_offload", "ckpt_offload_trl")


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def trl_pattern(model, ids) -> None:
    """trl.models.utils.disable_gradient_checkpointing() around a LoRA reference forward
    (DPOTrainer.compute_ref_log_probs with ref_model=None: adapters disabled)."""
    was_enabled = model.is_gradient_checkpointing
    if was_enabled:
        model.gradient_checkpointing_disable()
    try:
        with torch.no_grad(), model.disable_adapter():
            outputs = model(input_ids=ids, use_cache=False)
            del outputs
    finally:
        if was_enabled:
            model.gradient_checkpointing_enable({"use_reentrant": False})


class Mode:
    def __init__(self, name: str, model, handle=None, pattern: bool = False):
        self.name, self.model, self.handle, self.pattern = name, model, handle, pattern
        self.times: List[float] = []
        self.losses: List[float] = []
        self.peaks: List[float] = []
        self.figures: List[Dict] = []


def train_step(mode: Mode, ids, device: str) -> None:
    if mode.pattern:
        trl_pattern(mode.model, ids)
    gc.collect()
    synchronize(device)
    before = 0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    loss = mode.model(input_ids=ids, labels=ids).loss
    loss.backward()
    synchronize(device)
    mode.times.append((time.perf_counter() - start) * 1e3)
    mode.losses.append(float(loss.detach()))
    if device == "cuda":
        mode.peaks.append((torch.cuda.max_memory_allocated() - before) / GIB)
    mode.model.zero_grad(set_to_none=True)
    if mode.handle is not None:
        stats = mode.handle.stats()
        mode.figures.append({key: stats.get(key, 0) for key in (
            "offloaded_tensors", "restored_tensors", "prefetched_tensors", "exposed_wait_ms",
            "offloaded_bytes", "pinned_allocations", "kept_resident_tensors",
            "peak_layer_recompute_bytes")})


def summarize(modes: List[Mode], warmup: int, reference: str) -> Dict[str, Dict]:
    ref = next(m for m in modes if m.name == reference)
    ref_timed = ref.times[warmup:]
    out = {}
    for mode in modes:
        timed = mode.times[warmup:]
        ratios = [t / r for t, r in zip(timed, ref_timed)]
        out[mode.name] = dict(
            step_ms=statistics.median(timed),
            overhead_pct=100 * (statistics.median(timed) / statistics.median(ref_timed) - 1),
            paired_pct=100 * (statistics.median(ratios) - 1))
    return out


def run_toggle(args, report: Dict) -> None:
    device = args.device
    base = base_model(args.shape, device=device)
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, SHAPES[args.shape]["vocab_size"], (1, args.seq),
                        generator=generator).to(device)
    from ckpt_offload.hf import enable_activation_offload

    modes = []
    for name in TOGGLE_MODES:
        model = lora_model(base)
        handle = enable_activation_offload(model) if name.startswith("ckpt_offload") else None
        if handle is not None and device == "cpu":  # smoke run: the host backend
            handle.disable()
            handle = enable_activation_offload(model, backend="host", min_offload_bytes=0)
        modes.append(Mode(name, model, handle, pattern=name.endswith("_trl")))
    for index in range(args.warmup + args.rounds):
        for mode in modes:
            train_step(mode, ids, device)
            line = f"toggle round {index} {mode.name}: {mode.times[-1]:.1f} ms"
            if mode.peaks:
                line += f", act peak {mode.peaks[-1]:.2f} GiB"
            line += f", loss {mode.losses[-1]:.6f}"
            if mode.figures:
                f = mode.figures[-1]
                line += (f", prefetched {f['prefetched_tensors']}/restored "
                         f"{f['restored_tensors']}/offloaded {f['offloaded_tensors']}, exposed "
                         f"wait {f['exposed_wait_ms']:.2f} ms")
            print(line, flush=True)
    summary = summarize(modes, args.warmup, "ckpt")
    against_trl = summarize([m for m in modes if m.name.endswith("_trl")], args.warmup,
                            "ckpt_trl")
    for name, figures in against_trl.items():
        summary[name]["vs_ckpt_trl_overhead_pct"] = figures["overhead_pct"]
        summary[name]["vs_ckpt_trl_paired_pct"] = figures["paired_pct"]
    ref_losses = modes[0].losses
    for mode in modes:
        summary[mode.name]["losses_equal_ckpt"] = mode.losses == ref_losses
        if mode.figures:
            timed = mode.figures[args.warmup:]
            summary[mode.name]["prefetched_every_step"] = all(
                f["prefetched_tensors"] == f["restored_tensors"] > 0 for f in timed)
            summary[mode.name]["exposed_wait_ms_max"] = max(f["exposed_wait_ms"] for f in timed)
            summary[mode.name]["peak_layer_recompute_gib"] = max(
                f["peak_layer_recompute_bytes"] for f in mode.figures) / GIB
    report["toggle"] = dict(
        shape=args.shape, seq=args.seq, warmup=args.warmup, rounds=args.rounds,
        summary=summary,
        steps={m.name: dict(ms=m.times, losses=m.losses, act_peak_gib=m.peaks,
                            figures=m.figures) for m in modes})
    for mode in modes:
        if mode.handle is not None:
            mode.handle.disable()
    modes.clear()
    del base
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def run_generate(args, report: Dict) -> None:
    device = args.device
    base = base_model(args.gen_shape, device=device)
    generator = torch.Generator().manual_seed(4321)
    prompts = torch.randint(3, SHAPES[args.gen_shape]["vocab_size"], (args.batch, args.prompt),
                            generator=generator).to(device)
    from ckpt_offload.hf import enable_activation_offload

    plain = lora_model(base)
    installed = lora_model(base)
    options = dict(backend="host", min_offload_bytes=0) if device == "cpu" else {}
    handle = enable_activation_offload(installed, **options)
    # With a training step behind it, as in a training run that generates between steps.
    for model in (plain, installed):
        ids = prompts[:1]
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    def generate(model) -> float:
        gc.collect()
        synchronize(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                 max_new_tokens=args.new, min_new_tokens=args.new,
                                 do_sample=False, use_cache=True, pad_token_id=0)
        synchronize(device)
        elapsed = (time.perf_counter() - start) * 1e3
        assert out.shape[1] == args.prompt + args.new, out.shape
        return elapsed

    results = {}
    for train_mode in ([False, True] if args.gen_train else [False]):
        label = "train" if train_mode else "eval"
        for model in (plain, installed):
            model.train(train_mode)
        times = {"plain": [], "installed": []}
        steps_before = handle.totals()["micro_steps"]
        for index in range(1 + args.gen_rounds):
            # Alternate which goes first, so that drift within a round hits both alike.
            order = [("plain", plain), ("installed", installed)]
            if index % 2:
                order.reverse()
            for name, model in order:
                times[name].append(generate(model))
                print(f"generate {label} round {index} {name}: {times[name][-1]:.1f} ms "
                      f"({times[name][-1] / args.new:.3f} ms per decode forward)", flush=True)
        timed = {name: values[1:] for name, values in times.items()}
        ratios = [b / a for a, b in zip(timed["plain"], timed["installed"])]
        plain_ms = statistics.median(timed["plain"])
        installed_ms = statistics.median(timed["installed"])
        results[label] = dict(
            plain_ms=plain_ms, installed_ms=installed_ms, ms_all=times,
            overhead_pct=100 * (installed_ms / plain_ms - 1),
            paired_pct=100 * (statistics.median(ratios) - 1),
            per_decode_forward_us=1e3 * (installed_ms - plain_ms) / args.new,
            engine_steps_during_generation=handle.totals()["micro_steps"] - steps_before)
        model = None
    handle.disable()
    report["generate"] = dict(shape=args.gen_shape, batch=args.batch, prompt=args.prompt,
                              new=args.new, rounds=args.gen_rounds, results=results)
    del plain, installed, base
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def versions(device: str) -> Dict:
    import peft
    import transformers

    return dict(commit=os.environ.get("CKPT_OFFLOAD_COMMIT", ""),
                device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                torch=torch.__version__, transformers=transformers.__version__,
                peft=peft.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def print_summary(report: Dict) -> None:
    toggle = report.get("toggle")
    if toggle:
        print(f"\n== toggle: {toggle['shape']} seq {toggle['seq']}, {toggle['rounds']} timed "
              "rounds (ms: median; % against ckpt: medians, paired)")
        for name, s in toggle["summary"].items():
            line = (f"{name:18s} {s['step_ms']:9.1f} ms  {s['overhead_pct']:+6.2f} %  "
                    f"paired {s['paired_pct']:+6.2f} %  losses = ckpt: {s['losses_equal_ckpt']}")
            if "vs_ckpt_trl_paired_pct" in s:
                line += (f"  vs ckpt_trl {s['vs_ckpt_trl_overhead_pct']:+.2f} % "
                         f"(paired {s['vs_ckpt_trl_paired_pct']:+.2f} %)")
            if "prefetched_every_step" in s:
                line += (f"  prefetched every step: {s['prefetched_every_step']}, exposed wait "
                         f"max {s['exposed_wait_ms_max']:.2f} ms, layer recompute in the "
                         f"breakdown {s['peak_layer_recompute_gib']:.2f} GiB")
            print(line)
    generate = report.get("generate")
    if generate:
        print(f"\n== generate: {generate['shape']}, {generate['batch']} x {generate['prompt']} "
              f"+ {generate['new']} new tokens, {generate['rounds']} timed rounds")
        for label, r in generate["results"].items():
            print(f"{label:5s} plain {r['plain_ms']:.1f} ms, installed {r['installed_ms']:.1f} ms: "
                  f"{r['overhead_pct']:+.2f} % (paired {r['paired_pct']:+.2f} %), "
                  f"{r['per_decode_forward_us']:+.1f} us per decode forward, engine steps "
                  f"{r['engine_steps_during_generation']}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="toggle,generate")
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--gen_shape", default="llama3-1b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--gen_rounds", type=int, default=4)
    parser.add_argument("--gen_train", action="store_true",
                        help="also generate in training mode with checkpointing on")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    report: Dict = dict(meta=versions(args.device), argv=sys.argv[1:])
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "trl_bench.json")
    started = time.perf_counter()
    for part, run in (("toggle", run_toggle), ("generate", run_generate)):
        if part in parts:
            run(args, report)
            report["seconds"] = round(time.perf_counter() - started, 1)
            with open(path, "w") as f:
                json.dump(report, f, indent=1)
    print_summary(report)
    print(f"\nwrote {path} ({report['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
