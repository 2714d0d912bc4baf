"""Real workloads on the GPU: real vocabularies, fused losses, peers, variable lengths and
the longest context that trains, with every mode in one process.

    python benchmarks/real_bench.py matrix  --configs llama3-8b:16384:hf,llama3-8b:16384:liger
    python benchmarks/real_bench.py longest --configs llama3-8b:liger --limits 80,40
    python benchmarks/real_bench.py var     --config llama3-8b:hf --range 8192:16384

Workload (benchmarks/workloads.py): peft LoRA r=16 on all linear layers of a random-init
bf16 model of Llama-3.1-8B's, Llama-3.2-1B's or Qwen3-8B's shape and vocabulary, batch 1,
sdpa attention, non-reentrant checkpointing, the loss `hf` (the model's own), `liger`
(fused linear cross-entropy) or `cce` (Cut Cross-Entropy). Every mode has its own LoRA
model over one shared copy of the base weights, the same LoRA init and the same token ids.

- matrix: modes interleaved one step each per round, so drift hits all alike; the first
  two rounds are warm-up (the second is ckpt_offload's profiled step). Step time is the
  median over timed rounds; `paired` is the median of each round's ratio to ckpt's step of
  that round. Act peak = max allocated during the step minus allocated before it.
- longest: the longest sequence of the grid (powers of two and their midpoints) that trains
  one step with the process's GPU memory capped (torch.cuda.set_per_process_memory_fraction)
  at each limit. After two warm-up steps, two short steps per mode measure
  peak = a + b * seq; the search starts at the longest length the fit allows and steps up
  until a step runs out of memory; a length whose fitted peak is over the cap by more than
  the fit's margin is counted as failing without running it (its allocated bytes alone
  would exceed the cap).
- var: lengths drawn at random (the first too: the pool meets new longest lengths after
  warm-up), every mode stepping through the same lengths, interleaved step by step;
  ckpt_offload with and without a length hint (reserve_for_tokens).
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
from typing import Callable, Dict, List, Optional

import torch

from gpu_bench import fmt, meta, run_line, write_memory_timeline
from peers import PEERS, contexts
from workloads import LOSSES, SHAPES, base_model, lora_model

GIB = 2**30
MODES = ("ckpt", "ckpt_offload") + PEERS
# Powers of two and their midpoints, up to the Llama-3.x context length (131072).
GRID = [4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152, 65536, 98304, 131072]


class Mode:
    """A LoRA model and the context its training steps run in."""

    def __init__(self, name: str, model, context: Callable = contextlib.nullcontext,
                 handle=None):
        self.name, self.model, self.context, self.handle = name, model, context, handle
        self.times: List[float] = []
        self.peaks: List[int] = []
        self.totals: List[int] = []
        self.losses: List[float] = []
        self.pinned: List[int] = []
        self.pinned_seconds: List[float] = []  # time spent making pinned slabs, so far
        self.host_peaks: List[int] = []  # the host pool's peak live bytes, per step
        # The caching allocator's calls to the driver per step (cudaMalloc/cudaFree and
        # their expandable-segment kin, failed mallocs retried after freeing the cache):
        # each synchronizes, so after warm-up any of them is a cost one mode pays alone.
        self.driver_calls: List[int] = []
        self.error = ""


def make_modes(names: List[str], base, loss: str, peers_dir: str) -> List[Mode]:
    from ckpt_offload.hf import enable_activation_offload

    modes = []
    for name in names:
        model = lora_model(base, loss)
        if name == "ckpt":
            modes.append(Mode(name, model))
        elif name.startswith("ckpt_offload"):  # ckpt_offload, ckpt_offload_hint (var)
            modes.append(Mode(name, model, handle=enable_activation_offload(model)))
        elif name in PEERS:
            found = contexts([name], model, peers_dir)
            if name in found:
                modes.append(Mode(name, model, found[name]))
        else:
            raise SystemExit(f"--modes: unknown mode {name!r}; known: {', '.join(MODES)}")
    return modes


def step(mode: Mode, ids, history: Optional[str] = None) -> None:
    """One training step; its time, activation peak, absolute peak and loss are recorded."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    calls_before = allocator_driver_calls()
    if history:
        torch.cuda.memory._record_memory_history(max_entries=400000)
    start = time.perf_counter()
    try:
        with mode.context():
            loss = mode.model(input_ids=ids, labels=ids).loss
            loss.backward()
        torch.cuda.synchronize()
    finally:
        if history:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
    if history:
        write_memory_timeline(snapshot, before, history)
    mode.times.append((time.perf_counter() - start) * 1e3)
    mode.peaks.append(torch.cuda.max_memory_allocated() - before)
    mode.totals.append(torch.cuda.max_memory_allocated())
    mode.losses.append(float(loss.detach()))
    mode.model.zero_grad(set_to_none=True)
    mode.driver_calls.append(allocator_driver_calls() - calls_before)
    if mode.handle is not None:
        stats = mode.handle.stats()
        mode.pinned.append(int(stats.get("pinned_allocations", 0)))
        mode.pinned_seconds.append(round(float(stats.get("pinned_allocation_seconds", 0)), 3))
        mode.host_peaks.append(int(stats.get("host_peak_bytes", 0)))


# The allocator's calls into the driver (cudaMalloc, cudaFree) and its free-cache-and-retry
# rounds, as torch.cuda.memory_stats() counts them.
ALLOCATOR_DRIVER_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def allocator_driver_calls() -> int:
    stats = torch.cuda.memory_stats()
    return sum(int(stats.get(key, 0)) for key in ALLOCATOR_DRIVER_KEYS)


def recover(mode: Mode, error: BaseException) -> str:
    mode.model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()
    return f"{type(error).__name__}: {error}".splitlines()[0][:200]


def handle_figures(mode: Mode) -> Dict:
    if mode.handle is None:
        return {}
    stats = mode.handle.stats()
    figures = dict(offloaded_gib=stats.get("offloaded_bytes", 0) / GIB,
                   offloaded_tensors=stats.get("offloaded_tensors", 0),
                   head_offloaded_gib=stats.get("head_offloaded_bytes", 0) / GIB,
                   exposed_wait_ms=stats.get("exposed_wait_ms", 0),
                   host_reserved_gib=stats.get("host_reserved_bytes", 0) / GIB,
                   host_peak_gib=max(mode.host_peaks, default=0) / GIB,  # the run's
                   pinned_allocations_per_step=mode.pinned,
                   pinned_seconds_per_step=mode.pinned_seconds)
    breakdown = getattr(mode.handle, "peak_breakdown", None)
    if callable(breakdown):
        figures["peak_breakdown"] = breakdown()
    return figures


# matrix


def run_matrix(args) -> List[Dict]:
    runs: List[Dict] = []
    groups: Dict[tuple, List[str]] = {}
    for item in args.configs.split(","):
        shape, seq, loss = parse_config(item, with_seq=True)
        groups.setdefault((shape, seq), []).append(loss)
    for (shape, seq), losses in groups.items():
        base = base_model(shape)
        ids = token_ids(shape, seq, seed=1234)
        for loss in losses:
            label = f"{shape}:{seq}:{loss}"
            modes = make_modes(args.modes.split(","), base, loss, args.peers_dir)
            for index in range(args.warmup + args.rounds):
                last = index == args.warmup + args.rounds - 1
                for mode in modes:
                    if mode.error:
                        continue
                    history = None
                    if last and label in args.memory_plot.split(",") and mode.name in (
                            "ckpt", "ckpt_offload"):
                        history = os.path.join(
                            args.out, f"{args.tag}_memory_{label.replace(':', '_')}_"
                                      f"{mode.name}.json")
                    try:
                        step(mode, ids, history)
                    except Exception as error:  # noqa: BLE001 - keep the other modes going
                        mode.error = recover(mode, error)
                    print(f"{label} round {index} {mode.name}: " + (
                        mode.error or f"{mode.times[-1]:.1f} ms, {mode.peaks[-1] / GIB:.3f} GiB"
                        f", loss {mode.losses[-1]:.6f}"), flush=True)
            runs.extend(matrix_results(shape, seq, loss, modes, args.warmup))
            write_report(args, runs, matrix_table)
            release(modes)
        del base
        gc.collect()
        torch.cuda.empty_cache()
    return runs


def matrix_results(shape, seq, loss, modes: List[Mode], warmup: int) -> List[Dict]:
    reference = next((m for m in modes if m.name == "ckpt" and not m.error), None)
    results = []
    for mode in modes:
        result = dict(model=shape, seq=seq, loss=loss, mode=mode.name)
        if mode.error:
            result["error"] = mode.error
            results.append(result)
            continue
        timed = mode.times[warmup:]
        result.update(step_ms=statistics.median(timed), step_ms_all=mode.times,
                      act_peak_gib=max(mode.peaks[warmup:]) / GIB,
                      act_peak_gib_all=[p / GIB for p in mode.peaks], losses=mode.losses,
                      driver_calls_per_step=mode.driver_calls,
                      driver_calls_after_warmup=sum(mode.driver_calls[warmup:]))
        if reference is not None:
            ref = reference.times[warmup:]
            result["overhead_pct"] = 100 * (result["step_ms"] / statistics.median(ref) - 1)
            ratios = [t / r for t, r in zip(timed, ref)]
            result["paired_overhead_pct"] = 100 * (statistics.median(ratios) - 1)
            result["losses_equal_ckpt"] = mode.losses == reference.losses
        result.update(handle_figures(mode))
        results.append(result)
    return results


def matrix_table(report) -> str:
    lines = header(report) + [
        "| model | seq | loss | mode | step ms | overhead % (medians) | paired % | act peak GiB "
        "| losses = ckpt | offloaded GiB | head GiB | pinned allocs after warm-up | exposed "
        "wait ms | allocator driver calls after warm-up |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['seq']} | {r['loss']} | {r['mode']} | "
                         f"{r['error']} |||||||||")
            continue
        pinned = r.get("pinned_allocations_per_step")
        lines.append("| " + " | ".join([
            r["model"], str(r["seq"]), r["loss"], r["mode"], fmt(r["step_ms"], ".0f"),
            fmt(r.get("overhead_pct"), "+.2f"), fmt(r.get("paired_overhead_pct"), "+.2f"),
            fmt(r["act_peak_gib"], ".2f"), str(r.get("losses_equal_ckpt", "—")),
            fmt(r.get("offloaded_gib"), ".2f"), fmt(r.get("head_offloaded_gib"), ".2f"),
            fmt(pinned[-1] - pinned[0] if pinned else None, "d"),
            fmt(r.get("exposed_wait_ms"), ".1f"),
            fmt(r.get("driver_calls_after_warmup"), "d")]) + " |")
    return "\n".join(lines) + "\n"


# longest


def run_longest(args) -> List[Dict]:
    runs: List[Dict] = []
    limits = [float(v) for v in args.limits.split(",")]
    deadline = time.monotonic() + args.time_budget
    total = torch.cuda.get_device_properties(0).total_memory
    for item in args.configs.split(","):
        shape, _, loss = parse_config(item, with_seq=False)
        base = base_model(shape)
        modes = make_modes(args.modes.split(","), base, loss, args.peers_dir)
        for mode in modes:
            torch.cuda.set_per_process_memory_fraction(1.0)
            # A first step's peak holds one-time buffers (kernel autotuning, workspaces): the
            # H200 run of 7da6f44 fitted a falling line through an unwarmed 8k step. The
            # second step is the one ckpt_offload's peak breakdown profiles, which resets
            # the allocator's peak counter (its reading was 15.5 GiB of 27.1 in the run of
            # 804e6c6): neither goes into the fit.
            for _ in range(2):
                probe(mode, shape, 8192, [], None)
            fit = []  # (seq, absolute peak bytes) of steps that ran
            for seq in (8192, 16384):
                probe(mode, shape, seq, fit, None)
            if len(fit) < 2:
                runs.append(dict(model=shape, loss=loss, mode=mode.name, error=mode.error
                                 or "the fit's short steps did not run"))
                continue
            for limit in sorted(limits, reverse=True):
                torch.cuda.empty_cache()
                torch.cuda.set_per_process_memory_fraction(min(1.0, limit * GIB / total))
                result = dict(model=shape, loss=loss, mode=mode.name, limit_gib=limit,
                              steps=[])
                result.update(search(mode, shape, limit * GIB, fit, result["steps"], deadline,
                                     args.margin))
                runs.append(result)
                print(json.dumps(result), flush=True)
                write_report(args, runs, longest_table)
        torch.cuda.set_per_process_memory_fraction(1.0)
        release(modes)
        del base
        gc.collect()
        torch.cuda.empty_cache()
    return runs


def probe(mode: Mode, shape: str, seq: int, fit: list, steps: Optional[list]) -> bool:
    """One step at `seq`; True when it trained. A step that ran goes into the fit."""
    try:
        step(mode, token_ids(shape, seq, seed=seq))
        ok, record = True, dict(seq=seq, ok=True, ms=mode.times[-1],
                                peak_gib=mode.totals[-1] / GIB)
        if mode.pinned_seconds:
            record["pinned_s"] = mode.pinned_seconds[-1]
        fit.append((seq, mode.totals[-1]))
    except Exception as error:  # noqa: BLE001 - out of memory, or a peer's own failure
        ok, record = False, dict(seq=seq, ok=False, error=recover(mode, error))
        if not isinstance(error, torch.OutOfMemoryError):
            mode.error = record["error"]
    print(f"{mode.name} seq {seq}: {record}", flush=True)
    if steps is not None:
        steps.append(record)
    return ok


def fitted_peak(fit: list, seq: int) -> float:
    """Absolute peak bytes at `seq` on the line through the two longest steps that ran."""
    points = sorted(set(fit))[-2:]
    (s0, p0), (s1, p1) = points
    return p0 + (p1 - p0) * (seq - s0) / (s1 - s0)


def search(mode: Mode, shape: str, cap: float, fit: list, steps: list, deadline: float,
           margin: float) -> Dict:
    fits = [s for s in GRID if fitted_peak(fit, s) <= cap]
    index = GRID.index(fits[-1]) if fits else 0
    longest = None
    while 0 <= index < len(GRID):
        if time.monotonic() > deadline:
            return dict(longest=longest, note="time budget spent")
        seq = GRID[index]
        if longest is not None and fitted_peak(fit, seq) > cap * (1 + margin):
            steps.append(dict(seq=seq, ok=False, fitted_peak_gib=fitted_peak(fit, seq) / GIB))
            return dict(longest=longest, next_fails="by fit")
        if probe(mode, shape, seq, fit, steps):
            longest = seq
            index += 1
        elif mode.error:
            return dict(longest=longest, error=mode.error)
        elif longest is not None:
            return dict(longest=longest, next_fails="measured")
        else:
            index -= 1
    return dict(longest=longest, note="grid end" if longest == GRID[-1] else "none fits")


def longest_table(report) -> str:
    cells: Dict[tuple, Dict[str, str]] = {}
    modes: List[str] = []
    errors = []
    for r in report["runs"]:
        if "limit_gib" not in r:
            errors.append(f"{r['model']} {r['loss']} {r['mode']}: {r['error']}")
            continue
        key = (r["model"], r["loss"], r["limit_gib"])
        if r["mode"] not in modes:
            modes.append(r["mode"])
        longest = r.get("longest")
        text = "none" if longest is None else f"{longest // 1024}k"
        if r.get("note") == "grid end":
            text = f"≥ {text}"
        elif r.get("note") == "time budget spent" and not r["steps"]:
            text = "not measured (time budget)"
        elif r.get("note") == "time budget spent":
            failed = [f"{step['seq'] // 1024}k" for step in r["steps"] if not step["ok"]]
            text = (f"≥ {text}" if longest else "not found") + " (search cut short" + (
                f"; {', '.join(failed)} out of memory)" if failed else ")")
        if r.get("error"):
            text += f" ({r['error'][:40]})"
        cells.setdefault(key, {})[r["mode"]] = text
    lines = header(report) + ["| model | loss | GPU memory cap GiB | " + " | ".join(modes) + " |",
                              "|---|---|---|" + "---|" * len(modes)]
    for (model, loss, limit), row in cells.items():
        lines.append(f"| {model} | {loss} | {limit:g} | "
                     + " | ".join(row.get(m, "—") for m in modes) + " |")
    lines.extend(f"- {error}" for error in errors)
    return "\n".join(lines) + "\n"


# var


def run_var(args) -> List[Dict]:
    shape, _, loss = parse_config(args.config, with_seq=False)
    low, high = (int(v) for v in args.range.split(":"))
    generator = torch.Generator().manual_seed(7)
    seqs = [int(torch.randint(low, high + 1, (1,), generator=generator))
            for _ in range(args.steps)]
    base = base_model(shape)
    modes = make_modes(["ckpt", "ckpt_offload", "ckpt_offload_hint"], base, loss,
                       args.peers_dir)
    for mode in modes:
        if mode.name == "ckpt_offload_hint":
            mode.handle.reserve_for_tokens(high)
    for index, seq in enumerate(seqs):
        ids = token_ids(shape, seq, seed=seq)
        for mode in modes:
            step(mode, ids)
            pinned = f", pinned {mode.pinned_seconds[-1]:.3f} s" if mode.pinned_seconds else ""
            print(f"var step {index} seq {seq} {mode.name}: {mode.times[-1]:.1f} ms{pinned}",
                  flush=True)
    ckpt = modes[0]
    runs = []
    for mode in modes:
        ratios = [t / r for t, r in zip(mode.times, ckpt.times)]
        result = dict(model=shape, loss=loss, mode=mode.name, seqs=seqs,
                      step_ms_all=mode.times, ratio_to_ckpt=ratios,
                      worst_after_first_pct=100 * (max(ratios[1:]) - 1),
                      median_pct=100 * (statistics.median(ratios[1:]) - 1),
                      act_peak_gib=max(mode.peaks) / GIB,
                      losses_equal_ckpt=mode.losses == ckpt.losses)
        result.update(handle_figures(mode))
        runs.append(result)
    write_report(args, runs, var_table)
    release(modes)
    return runs


def var_table(report) -> str:
    lines = header(report) + [
        "| model | loss | mode | median step vs ckpt % | worst step after the first vs ckpt % "
        "| act peak GiB | pinned allocations per step | losses = ckpt |",
        "|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        lines.append("| " + " | ".join([
            r["model"], r["loss"], r["mode"], fmt(r["median_pct"], "+.2f"),
            fmt(r["worst_after_first_pct"], "+.2f"), fmt(r["act_peak_gib"], ".2f"),
            str(r.get("pinned_allocations_per_step", "—")),
            str(r["losses_equal_ckpt"])]) + " |")
    lines.append("")
    lines.append("lengths: " + ", ".join(str(s) for s in report["runs"][0]["seqs"]))
    return "\n".join(lines) + "\n"


# shared


def parse_config(item: str, with_seq: bool):
    parts = item.split(":")
    if len(parts) != (3 if with_seq else 2):
        form = "SHAPE:SEQ:LOSS" if with_seq else "SHAPE:LOSS"
        raise SystemExit(f"--configs: {item!r} is not {form}")
    shape, loss = parts[0], parts[-1]
    if shape not in SHAPES:
        raise SystemExit(f"--configs: unknown shape {shape!r}; known: {sorted(SHAPES)}")
    if loss not in LOSSES:
        raise SystemExit(f"--configs: unknown loss {loss!r}; known: {', '.join(LOSSES)}")
    seq = None
    if with_seq:
        try:
            seq = int(parts[1])
        except ValueError:
            raise SystemExit(f"--configs: bad sequence length in {item!r}") from None
    return shape, seq, loss


def token_ids(shape: str, seq: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, SHAPES[shape]["vocab_size"], (1, seq), generator=generator).cuda()


def release(modes: List[Mode]) -> None:
    for mode in modes:
        if mode.handle is not None:
            mode.handle.disable()
    modes.clear()
    gc.collect()
    torch.cuda.empty_cache()


def header(report) -> List[str]:
    m = report["meta"]
    allocator = f"; PYTORCH_CUDA_ALLOC_CONF={m['alloc_conf']}" if m.get("alloc_conf") else ""
    return [f"{run_line(m)}; {m.get('packages', '')}{allocator}", ""]


def packages() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in ("liger_kernel", "cut_cross_entropy"):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            module = sys.modules.get(name)
            if module is not None:
                found.append(f"{name} {getattr(module, '__version__', '?')}")
    return ", ".join(found)


def run_meta() -> Dict:
    return dict(meta(), packages=packages(), argv=sys.argv[1:],
                alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))


def write_report(args, runs, table) -> None:
    report = dict(meta=run_meta(), runs=runs)
    with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, f"{args.tag}.md"), "w") as f:
        f.write(table(report))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("matrix", "longest", "var"))
    parser.add_argument("--configs", default="llama3-1b:8192:hf")
    parser.add_argument("--config", default="llama3-8b:hf", help="var: SHAPE:LOSS")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=3, help="matrix: timed rounds")
    # The second round is ckpt_offload's profiled step (its peak breakdown, once per run),
    # 0.5-0.7 % slower on the H200 run of 804e6c6: the default leaves it untimed.
    parser.add_argument("--warmup", type=int, default=2, help="matrix: untimed first rounds")
    parser.add_argument("--memory_plot", default="",
                        help="matrix: comma list of SHAPE:SEQ:LOSS whose last step's "
                             "allocator history is recorded (ckpt and ckpt_offload)")
    parser.add_argument("--limits", default="80,40", help="longest: GPU memory caps, GiB")
    parser.add_argument("--margin", type=float, default=0.03,
                        help="longest: a length fitted over the cap by more than this "
                             "fraction counts as failing without a run")
    parser.add_argument("--time_budget", type=float, default=1e9,
                        help="longest: seconds after which no new search step starts")
    parser.add_argument("--range", default="8192:16384", help="var: LOW:HIGH lengths")
    parser.add_argument("--steps", type=int, default=12, help="var: steps per mode")
    parser.add_argument("--peers_dir", default=os.environ.get("CKPT_OFFLOAD_PEERS_DIR", ".peers"))
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    args.tag = args.tag or f"real_{args.what}"
    if not torch.cuda.is_available():
        raise SystemExit("real_bench needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    runs = {"matrix": run_matrix, "longest": run_longest, "var": run_var}[args.what](args)
    table = {"matrix": matrix_table, "longest": longest_table, "var": var_table}[args.what]
    print(table(dict(meta=run_meta(), runs=runs)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
