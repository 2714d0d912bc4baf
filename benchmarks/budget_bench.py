"""memory_budget on the GPU: step time and peak of every way to spend a memory cap, in one
process, interleaved round by round.

    python benchmarks/budget_bench.py --configs llama3-8b:8192:full,llama3-8b:8192:80 \\
        --rounds 6 --out DIR

A config is shape:seq:cap (cap: GiB, or `full` for the whole device; applied with
torch.cuda.set_per_process_memory_fraction). Workload: benchmarks/workloads.py (peft LoRA
r=16 on all linear layers, bf16, batch 1, sdpa, the model's own loss, or --loss liger /
cce). Modes, each its own LoRA model over one shared base:

- ckpt: every layer checkpointed (non-reentrant), the reference of every ratio;
- ckpt_offload: today's ckpt_offload (inputs offloaded, every layer checkpointed);
- budget: ckpt_offload with memory_budget="auto" (95 % of the cap), or --budget;
- budget_keep: the same budget with no op outputs offloaded (kept on the device only);
- budget@S (e.g. budget@0.95): the budget with each layer's copy window at share S of its
  forward (ckpt_offload.budget.COPY_WINDOW_SHARE otherwise);
- budget_res: the budget with resident layers offloading saved storages (see
  ckpt_offload.budget, "Resident layers"; off by default);
- none: no checkpointing, where it fits;
- every_n: transformers' every_n_layers at the largest N (fewest layers checkpointed) of
  2, 3, 4, 6, 8, 16, 32 whose step fits, found before the timed rounds.

Three warm-up rounds (the budget's second step is its measured one, its third the first
planned), the cache emptied before each warm-up step so that no mode's measurement sees
another's cached blocks; then timed rounds. Step time: median; `paired`: median of each
round's ratio to ckpt's step. Peaks: the allocator's max allocated and max reserved during
the step (weights included), against the cap. Losses are compared across modes.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch

from gpu_bench import meta, run_line
from workloads import base_model, lora_model

GIB = 2**30
PLAN_LETTERS = {"checkpoint": "C", "selective": "S", "resident": "R"}
MODES = ("ckpt", "ckpt_offload", "budget", "budget_keep", "none", "every_n")
EVERY_N = (32, 16, 8, 6, 4, 3, 2)
WARMUP = 3
# The allocator's figures an OOM reports: what tensors hold, what segments hold, and the free
# pieces of segments that also hold tensors (which no retry can give back).
OOM_FIGURES = ("allocated_bytes", "reserved_bytes", "inactive_split_bytes")


class Mode:
    def __init__(self, name: str, model, handle=None, note: str = ""):
        self.name, self.model, self.handle, self.note = name, model, handle, note
        self.times: List[float] = []
        self.allocated: List[int] = []
        self.reserved: List[int] = []
        self.losses: List[float] = []
        self.stats: Dict = {}  # the handle's figures after this mode's latest timed step
        self.error = ""


def one_step(mode: Mode, ids, record: bool) -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    loss = mode.model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) * 1e3
    mode.model.zero_grad(set_to_none=True)
    if record:
        mode.times.append(elapsed)
        mode.allocated.append(torch.cuda.max_memory_allocated())
        mode.reserved.append(torch.cuda.max_memory_reserved())
        mode.losses.append(float(loss.detach()))
        if mode.handle is not None:
            # Read now: handles of equal engine settings share one offloader per thread.
            mode.stats = mode.handle.stats()


def try_step(mode: Mode, ids, record: bool) -> bool:
    try:
        one_step(mode, ids, record)
        return True
    except torch.OutOfMemoryError as error:
        # Read before the traceback goes: its frames still hold the step's tensors, so the
        # allocator's figures are those of the failed allocation.
        stats = torch.cuda.memory_stats()
        mode.error = ("OOM: " + " ".join(str(error).split())[:600] + " | allocator: " +
                      ", ".join(f"{key} {stats.get(key + '.all.current', 0) / GIB:.2f} GiB"
                                for key in OOM_FIGURES))
        print(f"{mode.name}: {mode.error}", flush=True)
        if mode.handle is not None:
            mode.stats = mode.handle.stats()  # the failed step's plan
        del error
        mode.model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        return False


def set_cap(cap: str) -> float:
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = 1.0 if cap == "full" else min(1.0, float(cap) * GIB / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    return total * fraction


def checkpoint_every(model, n: int) -> None:
    model.base_model.model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=n)


def make_modes(names, base, budget="auto", loss="hf") -> List[Mode]:
    from ckpt_offload.hf import enable_activation_offload

    modes = []
    for name in names:
        model = lora_model(base, loss)
        if name == "ckpt_offload":
            modes.append(Mode(name, model, enable_activation_offload(model)))
        elif name in ("budget", "budget_keep", "budget_res") or name.startswith("budget@"):
            handle = enable_activation_offload(model, memory_budget=budget)
            if name == "budget_keep":
                handle._budget.copy_bytes_per_second = 0
            elif name == "budget_res":
                handle._budget.resident_storage_offload = True
            elif "@" in name:
                handle._budget.copy_window_share = float(name.partition("@")[2])
            modes.append(Mode(name, model, handle))
        elif name == "none":
            model.base_model.model.gradient_checkpointing_disable()
            modes.append(Mode(name, model))
        else:
            modes.append(Mode(name, model))
    return modes


def find_every_n(mode: Mode, ids) -> None:
    """The largest N whose step fits (two steps each: the second without warm-up)."""
    for n in EVERY_N:
        checkpoint_every(mode.model, n)
        torch.cuda.empty_cache()
        if try_step(mode, ids, False) and try_step(mode, ids, False):
            mode.note = f"every_n_layers={n}"
            mode.error = ""
            return
    mode.note = "no N fits"


def run_config(shape: str, seq: int, cap: str, rounds: int, names, base, budget="auto",
               empty_each_step: bool = False, loss: str = "hf") -> Dict:
    cap_bytes = set_cap(cap)
    gc.collect()
    torch.cuda.empty_cache()
    generator = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, base.config.vocab_size, (1, seq), generator=generator).cuda()
    modes = make_modes(names, base, budget, loss)
    for mode in modes:
        if mode.name == "every_n":
            find_every_n(mode, ids)
    alive = {m.name: m.note != "no N fits" for m in modes}
    for _ in range(WARMUP):
        for mode in modes:
            if alive[mode.name]:
                torch.cuda.empty_cache()
                alive[mode.name] = try_step(mode, ids, False)
    for _ in range(rounds):
        for mode in modes:
            if alive[mode.name]:
                if empty_each_step:  # each step's reserved peak its own
                    torch.cuda.empty_cache()
                alive[mode.name] = try_step(mode, ids, True)
    rows = []
    reference = next((m for m in modes if m.name == "ckpt"), None)
    for mode in modes:
        row = dict(mode=mode.name, note=mode.note, error=mode.error,
                   fits=bool(mode.times) and not mode.error)
        if mode.times:
            row.update(step_ms=statistics.median(mode.times),
                       allocated_peak_gib=max(mode.allocated) / GIB,
                       reserved_peak_gib=max(mode.reserved) / GIB,
                       losses=mode.losses, times_ms=mode.times)
            if reference is not None and reference.times:
                n = min(len(mode.times), len(reference.times))
                row["ratio"] = row["step_ms"] / statistics.median(reference.times)
                row["paired"] = statistics.median(
                    mode.times[i] / reference.times[i] for i in range(n))
        if mode.handle is not None:
            row["stats"] = {k: v for k, v in mode.stats.items()
                            if k.startswith(("budget", "peak_", "head_offloaded"))
                            or k in ("exposed_wait_ms", "offloaded_bytes", "groups")}
            modes_now = getattr(mode.handle, "layer_modes", lambda: None)()
            if modes_now is not None:
                row["plan"] = "".join(PLAN_LETTERS[m] for m in modes_now)
            measured = mode.handle._budget.measurement
            if measured is not None:
                row["measured_layer_gib"] = max(
                    c.saved_bytes_per_token for c in measured.layers) * measured.tokens / GIB
                row["measured_recompute_ms"] = max(
                    c.recompute_seconds_per_token for c in measured.layers) * measured.tokens * 1e3
                row["measured_peak_gib"] = measured.peak_bytes / GIB
                # Where the checkpointed step peaked: the forward and the head (together and
                # apart), the layers' backward (allocated, weights and all), and what the
                # head asked for.
                row["measured_head_phase_gib"] = measured.head_phase_peak_bytes / GIB
                row["measured_forward_gib"] = measured.forward_peak_bytes / GIB
                row["measured_head_gib"] = measured.head_peak_bytes / GIB
                row["measured_layer_phase_gib"] = measured.layer_phase_peak_bytes / GIB
                row["measured_head_rise_gib"] = measured.head_rise_bytes / GIB
                # The middle layer's candidates: (op, ordinal, MiB, ms) at the measured length.
                layer = measured.layers[len(measured.layers) // 2]
                row["measured_outputs"] = [
                    (o.key[0], o.key[1], round(o.bytes_per_token * measured.tokens / 2**20, 2),
                     round(o.seconds_per_token * measured.tokens * 1e3, 3))
                    for o in layer.outputs]
                row["measured_layer_input_mib"] = (
                    layer.input_bytes_per_token * measured.tokens / 2**20)
            mode.handle.disable()
        rows.append(row)
    losses = {tuple(r["losses"][:1]) for r in rows if r.get("losses")}
    for mode in modes:
        mode.model = None
    del modes
    gc.collect()
    torch.cuda.empty_cache()
    return dict(shape=shape, seq=seq, cap=cap, cap_gib=cap_bytes / GIB, rows=rows,
                budget=budget, loss=loss, same_first_loss=len(losses) <= 1)


def run_var(shape: str, low: int, high: int, steps: int, cap: str, base,
            measured_length_ratio: Optional[float] = None) -> Dict:
    """`steps` steps of lengths drawn uniformly from [low, high] (multiples of 256) with
    memory_budget="auto" under `cap` (and the budget's measured_length_ratio): per step its
    length, time, peaks, the plan's prediction, and any OOM."""
    from ckpt_offload.hf import enable_activation_offload

    cap_bytes = set_cap(cap)
    gc.collect()
    torch.cuda.empty_cache()
    model = lora_model(base)
    handle = enable_activation_offload(model, memory_budget="auto")
    if measured_length_ratio is not None:
        handle._budget.measured_length_ratio = measured_length_ratio
    measured_length_ratio = handle._budget.measured_length_ratio
    mode = Mode("budget", model, handle)
    generator = torch.Generator().manual_seed(7)
    records = []
    for index in range(steps):
        seq = 256 * int(torch.randint(low // 256, high // 256 + 1, (1,), generator=generator))
        ids = torch.randint(0, base.config.vocab_size, (1, seq), generator=generator).cuda()
        ok = try_step(mode, ids, True)
        stats = mode.stats if ok else {}
        records.append(dict(
            step=index + 1, seq=seq, ok=ok, error=mode.error if not ok else "",
            step_ms=mode.times[-1] if ok else None,
            allocated_peak_gib=mode.allocated[-1] / GIB if ok else None,
            reserved_peak_gib=mode.reserved[-1] / GIB if ok else None,
            measuring=bool(stats.get("budget_measuring")),
            resident=stats.get("budget_resident_layers"),
            selective=stats.get("budget_selective_layers"),
            kept_output_gib=stats.get("budget_kept_output_bytes", 0) / GIB,
            offloaded_output_gib=stats.get("budget_offloaded_output_bytes", 0) / GIB,
            exposed_wait_ms=stats.get("exposed_wait_ms"),
            predicted_saved_ms=stats.get("budget_predicted_saved_ms"),
            predicted_step_ms=stats.get("budget_predicted_step_ms"),
            timed_step_ms=stats.get("budget_measured_step_ms"),
            predicted_peak_gib=stats.get("budget_predicted_peak_bytes", 0) / GIB,
            predicted_allocated_gib=stats.get("budget_predicted_allocated_bytes", 0) / GIB,
            stranded_gib=stats.get("budget_stranded_bytes", 0) / GIB,
            plan_tokens=stats.get("budget_tokens")))
        print(json.dumps(records[-1]), flush=True)
    handle.disable()
    return dict(shape=shape, cap=cap, cap_gib=cap_bytes / GIB, low=low, high=high,
                measured_length_ratio=measured_length_ratio, records=records)


def var_table(run) -> str:
    records = run["records"]
    planned = [r for r in records if r["ok"] and not r["measuring"] and r["plan_tokens"]]
    errors = [r for r in records if r["error"].startswith("OOM")]
    over = [r for r in records if r["ok"] and r["reserved_peak_gib"] > run["cap_gib"]]
    under = [r["predicted_peak_gib"] - r["allocated_peak_gib"] for r in planned]
    allocated = [r["predicted_allocated_gib"] - r["allocated_peak_gib"] for r in planned
                 if r.get("predicted_allocated_gib")]
    lines = [f"var {run['shape']} lengths [{run['low']}, {run['high']}], cap "
             f"{run['cap_gib']:.1f} GiB: {len(records)} steps, {len(errors)} OOM, "
             f"{len(over)} over the cap (reserved), {len(records) - len(planned)} measured "
             f"(every layer checkpointed), max reserved "
             f"{max(r['reserved_peak_gib'] or 0 for r in records):.2f} GiB"]
    idle = [r["seq"] for r in planned
            if not r["resident"] and not r["selective"] and not r["offloaded_output_gib"]]
    if idle:  # planned, yet every layer checkpointed offloading nothing: nothing fitted
        lines.append(f"planned steps with every layer checkpointed: {len(idle)}, lengths "
                     f"{min(idle)}-{max(idle)}")
    if under:
        lines.append(f"planned steps: predicted peak minus allocated peak, GiB: min "
                     f"{min(under):.2f}, median {statistics.median(under):.2f}, max "
                     f"{max(under):.2f}")
    if allocated:
        lines.append(f"planned steps: predicted allocated peak minus allocated peak, GiB: min "
                     f"{min(allocated):.2f}, median {statistics.median(allocated):.2f}, max "
                     f"{max(allocated):.2f}")
    return "\n".join(lines)


def table(report) -> str:
    conf = report.get("allocator_conf") or "default"
    budgets = sorted({run.get("budget", "auto") for run in report["runs"]})
    lines = [run_line(report["meta"]),
             f"PYTORCH_CUDA_ALLOC_CONF: {conf}; budget mode's memory_budget: "
             f"{', '.join(budgets)}", "",
             "| model | seq | cap GiB | mode | step ms | / ckpt | paired | alloc peak GiB | "
             "reserved peak GiB | plan (C ckpt, S selective, R resident) | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        loss_note = f" ({run['loss']})" if run.get("loss", "hf") != "hf" else ""
        for row in run["rows"]:
            def cell(key, spec):
                value = row.get(key)
                return format(value, spec) if isinstance(value, (int, float)) else "—"
            note = row.get("note") or row.get("error") or ""
            plan = row.get("plan", "")
            if plan:
                plan = " / ".join(f"{plan.count(letter)} {letter}" for letter in "RSC")
                stats = row.get("stats", {})
                kept = stats.get("budget_kept_output_bytes", 0)
                if kept:
                    plan += f", kept {kept / GIB:.1f} GiB"
                offloaded = stats.get("budget_offloaded_output_bytes", 0)
                if offloaded:
                    plan += (f", {stats.get('budget_offloading_layers', 0)} offload "
                             f"{offloaded / GIB:.1f} GiB of outputs")
                if "exposed_wait_ms" in stats:
                    plan += f", exposed wait {stats['exposed_wait_ms']:.1f} ms"
                rate = stats.get("budget_copy_bytes_per_second", 0)
                if rate and offloaded:
                    plan += f", copies {rate / 1e9:.1f} GB/s"
                predicted = stats.get("budget_predicted_peak_bytes", 0)
                if predicted:
                    plan += f", predicted peak {predicted / GIB:.1f} GiB"
                allocated = stats.get("budget_predicted_allocated_bytes", 0)
                if allocated:
                    plan += f" ({allocated / GIB:.1f} allocated)"
                saved = stats.get("budget_predicted_saved_ms", 0)
                if saved:
                    plan += f", predicted saving {saved:.0f} ms"
                step = stats.get("budget_predicted_step_ms", 0)
                if step:  # the run time's own figures: predicted, and its median timed step
                    plan += (f", step predicted {step:.0f} ms, timed "
                             f"{stats.get('budget_measured_step_ms', 0):.0f} ms")
            lines.append(
                f"| {run['shape']}{loss_note} | {run['seq']} | {run['cap_gib']:.0f} | "
                f"{row['mode']} | "
                f"{cell('step_ms', '.1f')} | {cell('ratio', '.3f')} | {cell('paired', '.3f')} | "
                f"{cell('allocated_peak_gib', '.1f')} | {cell('reserved_peak_gib', '.1f')} | "
                f"{plan} | {note[:60]} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="")
    parser.add_argument("--var", default="",
                        help="shape:low:high:steps:cap, e.g. llama3-8b:4096:32768:100:80")
    parser.add_argument("--measured-length-ratio", type=float, default=None,
                        help="--var: plan a step only from a measurement at most this many "
                             "times as long (default: the budget's, off)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--budget", default="auto",
                        help="the budget mode's memory_budget (default auto), e.g. 76GiB")
    parser.add_argument("--empty-cache", action="store_true",
                        help="empty the allocator's cache before every timed step too")
    parser.add_argument("--loss", default="hf",
                        help="hf (the model's own), liger (its fused loss), liger_full (its "
                             "default model patch) or cce")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    # The budget's measurements and plans, as a Trainer's log would show them.
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("ckpt_offload.hf").setLevel(logging.INFO)
    names = args.modes.split(",")
    report = dict(meta=meta(), runs=[],
                  allocator_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    bases = {}
    if args.var:
        shape, low, high, steps, cap = args.var.split(":")
        run = run_var(shape, int(low), int(high), int(steps), cap, base_model(shape),
                      args.measured_length_ratio)
        report["var"] = run
        text = var_table(run)
        print(text, flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "budget_var.json"), "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.join(args.out, "budget_var.md"), "w") as f:
            f.write(run_line(report["meta"]) + "\n\n" + text + "\n")
        return 0
    for item in filter(None, args.configs.split(",")):
        shape, seq, cap = item.split(":")
        if shape not in bases:
            bases.clear()
            gc.collect()
            bases[shape] = base_model(shape)
        run = run_config(shape, int(seq), cap, args.rounds, names, bases[shape], args.budget,
                         args.empty_cache, args.loss)
        report["runs"].append(run)
        text = table(report)
        print(text, flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "budget_bench.json"), "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.join(args.out, "budget_bench.md"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
