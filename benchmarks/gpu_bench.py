"""Side-by-side GPU benchmark: ckpt_offload against plain non-reentrant checkpointing,
torch's save_on_cpu, and peers when importable.

    python benchmarks/gpu_bench.py --configs 8b:8192,1b:4096 --out results/   (GPU machine)
    bazel run //benchmarks:gpu_bench -- --configs ...                          (with Bazel)

Workload: peft LoRA (r=16, all linear layers) on a random-init bf16 Llama-shaped model,
batch 1, sdpa attention, gradient checkpointing (non-reentrant). For each config every
mode uses the same weights and the same token ids; modes run back to back in one process;
warm-up steps are excluded; figures are medians over the timed steps, timed with
CUDA-synchronized wall clocks.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

import torch

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000),
    # For smoke runs of the harness itself.
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1024),
}

GIB = 2**30


def build_model(shape: str, max_seq: int):
    import transformers
    from peft import LoraConfig, get_peft_model

    config = transformers.LlamaConfig(**SHAPES[shape], max_position_embeddings=max_seq,
                                      attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0,
                      task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    model.train()
    return model


class Mode:
    """One way of running a training step; `context()` wraps forward and backward."""

    name = "ckpt"

    def setup(self, model):
        pass

    def context(self):
        return contextlib.nullcontext()

    def teardown(self, model):
        pass

    def stats(self) -> Dict[str, float]:
        return {}


class CkptOffload(Mode):
    name = "ckpt_offload"

    def __init__(self, keep_last=1, prefetch_depth=1):
        self.kwargs = dict(keep_last=keep_last, prefetch_depth=prefetch_depth)
        self.handle = None

    def setup(self, model):
        from ckpt_offload.hf import enable_activation_offload

        self.handle = enable_activation_offload(model, **self.kwargs)

    def teardown(self, model):
        self.handle.disable()

    def stats(self):
        return self.handle.stats()


class SaveOnCpu(Mode):
    name = "save_on_cpu"

    def context(self):
        return torch.autograd.graph.save_on_cpu(pin_memory=True)


class Peer(Mode):
    """A peer's step context (benchmarks/peers.py), made once and entered every step."""

    def __init__(self, name: str, context):
        self.name, self.context = name, context


def peer_modes(model) -> List[Mode]:
    """axolotl's hidden-states offload and TRL's activation offloading, when their module
    files are found (CKPT_OFFLOAD_PEERS_DIR, filled by tools/gpu_peers.sh)."""
    from peers import contexts

    names = {"axolotl_hs": "axolotl_hs_offload", "trl": "trl_offload"}
    found = contexts(names, model, os.environ.get("CKPT_OFFLOAD_PEERS_DIR", ".peers"))
    return [Peer(names[name], context) for name, context in found.items()]


def train_step(model, ids, mode: Mode) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    with mode.context():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed * 1e3, float(loss.detach())


def run_mode(model, shape, seqs: List[int], mode: Mode, warmup: int,
             memory_history: Optional[str] = None) -> Dict:
    cfg = SHAPES[shape]
    mode.setup(model)
    try:
        generator = torch.Generator(device="cpu").manual_seed(1234)
        token_sets = [torch.randint(0, cfg["vocab_size"], (1, s), generator=generator)
                      for s in seqs]
        times, peaks, losses, per_step_stats = [], [], [], []
        pinned_per_step = []  # the host pool's cumulative pinned allocations, every step
        pinned_before_timed = None
        # The physical side: what the caching allocator holds, from an empty cache on.
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        reserved_peak = 0
        host_peak = 0  # the host pool's most live bytes over every step of the run
        for index, tokens in enumerate(token_sets):
            ids = tokens.cuda()
            gc.collect()
            torch.cuda.synchronize()
            reserved_peak = max(reserved_peak, torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            recording = memory_history and index == len(token_sets) - 1
            if recording:
                torch.cuda.memory._record_memory_history(max_entries=200000)
            if index == warmup:
                pinned_before_timed = mode.stats().get("pinned_allocations")
            ms, loss = train_step(model, ids, mode)
            if recording:
                snapshot = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                write_memory_timeline(snapshot, before, memory_history)
            peak = torch.cuda.max_memory_allocated() - before
            step_stats = mode.stats()
            if step_stats:
                pinned_per_step.append(step_stats.get("pinned_allocations", 0))
                # The run's host peak includes the warm-up step: the pool was sized for it.
                host_peak = max(host_peak, step_stats.get("host_peak_bytes", 0))
            if index >= warmup:
                times.append(ms)
                peaks.append(peak)
                losses.append(loss)
                per_step_stats.append(step_stats)
        torch.cuda.synchronize()
        reserved_peak = max(reserved_peak, torch.cuda.max_memory_reserved())
        result = dict(mode=mode.name, step_ms=statistics.median(times),
                      step_ms_all=times, act_peak_gib=max(peaks) / GIB, losses=losses,
                      reserved_peak_gib=reserved_peak / GIB, seqs=seqs)
        if pinned_per_step:
            result["pinned_allocations_per_step"] = pinned_per_step
        stats = per_step_stats[-1] if per_step_stats else {}
        if stats:
            hidden_bytes = seqs[-1] * cfg["hidden_size"] * 2
            layers = cfg["num_hidden_layers"]
            keep_last = getattr(mode, "kwargs", {}).get("keep_last", 1)
            offloaded = stats.get("offloaded_bytes", 0)  # layer inputs (head apart)
            result.update(
                offloaded_bytes=offloaded,
                # The definition: layer inputs moved over those outside keep_last.
                # Above 1 when the head's restore point releases the kept layers too.
                offloaded_fraction=offloaded / ((layers - keep_last) * hidden_bytes),
                layers_offloaded=stats.get("offloaded_tensors", 0),
                layers_kept=stats.get("kept_resident_tensors", 0),
                head_offloaded_gib=stats.get("head_offloaded_bytes", 0) / GIB,
                host_reserved_gib=stats.get("host_reserved_bytes", 0) / GIB,
                host_peak_gib=host_peak / GIB,
                host_reserved_over_peak=(stats.get("host_reserved_bytes", 0) / host_peak
                                         if host_peak else None),
                pinned_allocs_after_warmup=(stats.get("pinned_allocations", 0)
                                            - (pinned_before_timed or 0)),
                exposed_wait_ms=statistics.median(s.get("exposed_wait_ms", 0)
                                                  for s in per_step_stats),
                cap_fallbacks=stats.get("cap_fallbacks", 0),
                achieved_gbps=(stats.get("offloaded_bytes", 0) + stats.get("restored_bytes", 0)
                               + stats.get("head_offloaded_bytes", 0)
                               + stats.get("head_restored_bytes", 0))
                / (result["step_ms"] * 1e6),
            )
        return result
    finally:
        mode.teardown(model)


def write_memory_timeline(snapshot, baseline_bytes: int, path: str, points: int = 4000) -> None:
    """Allocated bytes over one step (from the allocator's trace) as JSON [[ms, GiB], ...],
    relative to what was allocated before the step."""
    events = []
    for trace in snapshot.get("device_traces", []):
        for entry in trace:
            action = entry.get("action")
            if action == "alloc":
                events.append((entry["time_us"], entry["size"]))
            elif action == "free_completed":
                events.append((entry["time_us"], -entry["size"]))
    events.sort()
    if not events:
        return
    start = events[0][0]
    level, series = 0, []
    for time_us, delta in events:
        level += delta
        series.append(((time_us - start) / 1e3, level / GIB))
    stride = max(1, len(series) // points)
    sampled = series[::stride]
    peak = max(series, key=lambda p: p[1])
    if peak not in sampled:
        sampled.append(peak)
        sampled.sort()
    with open(path, "w") as f:
        json.dump(dict(baseline_gib=baseline_bytes / GIB, points=sampled), f)


def meta() -> Dict:
    def sh(cmd):
        try:
            return subprocess.check_output(cmd, text=True, stderr=subprocess.DEVNULL).strip()
        except Exception:  # noqa: BLE001
            return ""

    import peft
    import transformers

    return dict(commit=os.environ.get("CKPT_OFFLOAD_COMMIT") or sh(["git", "rev-parse", "HEAD"]),
                gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                cuda=torch.version.cuda, transformers=transformers.__version__,
                peft=peft.__version__, peers=os.environ.get("CKPT_OFFLOAD_PEERS", ""),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def parse_configs(text: str):
    configs = []
    for item in text.split(","):
        shape, _, seq = item.partition(":")
        if shape not in SHAPES:
            raise SystemExit(f"--configs: unknown shape {shape!r}; known: {sorted(SHAPES)}")
        if seq.startswith("var"):
            configs.append((shape, "var"))
        else:
            try:
                configs.append((shape, int(seq)))
            except ValueError:
                raise SystemExit(f"--configs: bad sequence length in {item!r}") from None
    return configs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="1b:4096",
                        help="comma list of SHAPE:SEQ or SHAPE:var (variable length)")
    parser.add_argument("--modes", default="ckpt,ckpt_offload,save_on_cpu,peers")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--min_timed_seconds", type=float, default=3.0,
                        help="short steps are timed more often: at least this long per mode "
                             "(the count comes from a calibration run of plain checkpointing, "
                             "the same for every mode of a config)")
    parser.add_argument("--var_steps", type=int, default=20)
    parser.add_argument("--var_range", default="16384:32768")
    parser.add_argument("--var_first", choices=("longest", "random"), default="longest",
                        help="variable length: the warm-up step at the range's top, or drawn "
                             "like the rest (the host pool then meets new longest lengths "
                             "after warm-up)")
    parser.add_argument("--memory_plot_config", default="",
                        help="SHAPE:SEQ whose last step's allocator history is recorded")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="gpu_bench")
    args = parser.parse_args(argv)
    if args.steps < 1:
        raise SystemExit("--steps must be >= 1")
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    wanted = args.modes.split(",")
    runs = []
    for shape, seq in parse_configs(args.configs):
        if seq == "var":
            low, high = (int(v) for v in args.var_range.split(":"))
            generator = torch.Generator().manual_seed(7)
            drawn = [int(torch.randint(low, high + 1, (1,), generator=generator))
                     for _ in range(args.var_steps - 1)]
            first = high if args.var_first == "longest" else int(
                torch.randint(low, high + 1, (1,), generator=generator))
            seqs = [first] + drawn
            warmup = 1
            model = build_model(shape, max(seqs))
        else:
            model = build_model(shape, seq)
            steps = timed_steps(model, shape, seq, args.steps, args.min_timed_seconds)
            seqs = [seq] * (args.warmup + steps)
            warmup = args.warmup
        modes: List[Mode] = []
        if "ckpt" in wanted:
            modes.append(Mode())
        if "ckpt_offload" in wanted:
            modes.append(CkptOffload())
        if "save_on_cpu" in wanted and seq != "var":
            modes.append(SaveOnCpu())
        if "peers" in wanted and seq != "var":
            modes.extend(peer_modes(model))
        baseline = None
        label = f"{shape}:{seq}"
        for mode in modes:
            history = None
            if label == args.memory_plot_config and mode.name in ("ckpt", "ckpt_offload"):
                history = os.path.join(args.out, f"{args.tag}_memory_{mode.name}.json")
            print(f"== {label} {mode.name}", flush=True)
            try:
                result = run_mode(model, shape, seqs, mode, warmup, history)
            except Exception as error:  # noqa: BLE001 - one mode failing must not lose the rest
                message = f"{type(error).__name__}: {error}".splitlines()[0]
                result = dict(mode=mode.name, error=message)
                gc.collect()
                torch.cuda.empty_cache()
            result.update(model=shape, seq=seq)
            if mode.name == "ckpt" and "step_ms" in result:
                baseline = result
            if baseline and "step_ms" in result:
                result["overhead_pct"] = 100.0 * (result["step_ms"] / baseline["step_ms"] - 1)
                result["losses_equal_ckpt"] = result["losses"] == baseline["losses"]
            print(json.dumps({k: v for k, v in result.items() if k not in ("losses",)}),
                  flush=True)
            runs.append(result)
            write_report(args, runs)  # after every run: a later failure keeps what ran
        del model
        gc.collect()
        torch.cuda.empty_cache()
    print(markdown_table(write_report(args, runs)))
    return 0


def timed_steps(model, shape: str, seq: int, minimum: int, min_seconds: float) -> int:
    """How many steps to time per mode: `minimum`, or more for steps so short that a few of
    them do not outlast the GPU's and the host's noise. Two plain steps calibrate it (and
    warm the GPU up before the first mode is timed)."""
    ids = torch.randint(0, SHAPES[shape]["vocab_size"], (1, seq),
                        generator=torch.Generator().manual_seed(99)).cuda()
    first_ms = train_step(model, ids, Mode())[0]
    if first_ms >= 10 * min_seconds * 1e3:
        return minimum  # even a cold step is long: no second one needed
    # The first step of a model pays for warm-up (kernel selection, allocator growth),
    # which can be longer than several warm steps: the second one is the measure.
    step_ms = train_step(model, ids, Mode())[0]
    if step_ms * minimum >= min_seconds * 1e3:
        return minimum
    return max(minimum, min(30, int(min_seconds * 1e3 / step_ms) + 1))


def write_report(args, runs) -> Dict:
    report = dict(meta=meta(), runs=runs)
    with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, f"{args.tag}.md"), "w") as f:
        f.write(markdown_table(report))
    return report


def run_line(m: Dict) -> str:
    """A report's first line: where and what ran."""
    return (f"GPU {m['gpu']}, torch {m['torch']}, transformers {m['transformers']}, "
            f"commit {m['commit'][:12]}, {m['date']}")


def fmt(value, spec) -> str:
    """A table cell: `value` formatted, or a dash when the run did not measure it."""
    return format(value, spec) if isinstance(value, (int, float)) else "—"


def markdown_table(report) -> str:
    m = report["meta"]
    lines = [run_line(m), "",
             "| model | seq | mode | step ms | overhead % | act peak GiB | reserved peak GiB | "
             "offloaded frac | head GiB | host reserved GiB | pinned allocs after warm-up | "
             "exposed wait ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    for r in report["runs"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['seq']} | {r['mode']} | {r['error']} |||||||||")
            continue
        lines.append("| " + " | ".join([
            r["model"], str(r["seq"]), r["mode"], fmt(r["step_ms"], ".0f"),
            fmt(r.get("overhead_pct"), "+.2f"), fmt(r["act_peak_gib"], ".2f"),
            fmt(r.get("reserved_peak_gib"), ".2f"),
            fmt(r.get("offloaded_fraction"), ".3f"), fmt(r.get("head_offloaded_gib"), ".2f"),
            fmt(r.get("host_reserved_gib"), ".2f") + (
                f" ({r['host_reserved_over_peak']:.2f}× peak)"
                if isinstance(r.get("host_reserved_over_peak"), float) else ""),
            fmt(r.get("pinned_allocs_after_warmup"), "d"), fmt(r.get("exposed_wait_ms"), ".1f"),
        ]) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
