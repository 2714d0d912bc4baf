"""Where does a mode's step time go? One profiled training step per mode, and the compute
stream's idle gaps explained.

    python benchmarks/timeline_probe.py --config 8b:32768 --out /tmp/timeline   (GPU machine)
    python benchmarks/timeline_probe.py --config qwen3-8b:8192:liger --modes ckpt,ckpt_offload,trl

A SHAPE:SEQ config is gpu_bench's model (modes ckpt, ckpt_offload, ckpt_offload_no_head); a
SHAPE:SEQ:LOSS config is real_bench's workload (a real vocabulary and loss; modes ckpt,
ckpt_offload and the peers, each its own LoRA model over shared base weights).
For each mode it runs two warm-up steps (ckpt_offload profiles its second step once per run)
and a few timed steps; then, every mode timed, one step of each under
torch.profiler, and prints:
- the compute stream's busy and idle time inside the step;
- its longest idle gaps: when (ms from the step's start, and the phase), the kernels on
  either side, how late the host launched the next kernel, and the longest host-side CUDA
  synchronization that overlaps the gap (the usual reason a queue runs dry);
- the host's CUDA calls that block or reach the driver (synchronizations, device and pinned
  allocations): count and total time inside the step;
- the side streams' copy totals.
Traces go to --out as gzipped Chrome traces (open in Perfetto).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_bench  # noqa: E402  (the benchmark's model and modes)


class Probed:
    """One mode as the probe runs it: its model, the context its steps run in, its stats."""

    def __init__(self, name, model, context, stats=dict, setup=None, teardown=None):
        self.name, self.model, self.context, self.stats = name, model, context, stats
        self.setup, self.teardown = setup or (lambda: None), teardown or (lambda: None)


def train_step(probed: Probed, ids) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    with probed.context():
        loss = probed.model(input_ids=ids, labels=ids).loss
        loss.backward()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    probed.model.zero_grad(set_to_none=True)
    return elapsed * 1e3


def profiled_step(probed: Probed, ids, trace_path: str):
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("probe_step"):
            with probed.context():
                with record_function("probe_forward"):
                    loss = probed.model(input_ids=ids, labels=ids).loss
                with record_function("probe_backward"):
                    loss.backward()
            torch.cuda.synchronize()
    probed.model.zero_grad(set_to_none=True)
    prof.export_chrome_trace(trace_path)


def analyse(trace_path: str, top: int = 10) -> dict:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
           and "dur" in e]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime" and "dur" in e]
    annotations = {e["name"]: e for e in events
                   if e.get("cat") == "user_annotation" and e["name"].startswith("probe_")}
    launch_by_corr = {e["args"].get("correlation"): e for e in runtime if "args" in e}
    streams = {}
    for e in gpu:
        streams.setdefault(e["args"].get("stream"), []).append(e)
    compute_id = max(streams, key=lambda s: sum(1 for e in streams[s] if e["cat"] == "kernel"))
    compute = sorted(streams[compute_id], key=lambda e: e["ts"])
    step = annotations["probe_step"]
    t0 = step["ts"]
    backward_start = annotations["probe_backward"]["ts"]
    gpu_end = max(e["ts"] + e["dur"] for e in gpu)
    busy = sum(e["dur"] for e in compute)
    syncs = [r for r in runtime if "ynchronize" in r["name"] or "Memcpy" in r["name"]]
    gaps = []
    for prev, nxt in zip(compute, compute[1:]):
        gap = nxt["ts"] - (prev["ts"] + prev["dur"])
        if gap <= 50:  # µs: launch spacing, not a stall
            continue
        start = prev["ts"] + prev["dur"]
        launch = launch_by_corr.get(nxt["args"].get("correlation"))
        overlapping = [r for r in syncs if r["ts"] < nxt["ts"] and r["ts"] + r["dur"] > start]
        longest = max(overlapping, key=lambda r: r["dur"], default=None)
        gaps.append(dict(
            at_ms=round((start - t0) / 1e3, 3), gap_ms=round(gap / 1e3, 3),
            # By the next kernel's launch (host time); without one, by the gap's start.
            phase=("backward" if (launch["ts"] if launch else start) >= backward_start
                   else "forward"),
            before=prev["name"][:70], after=nxt["name"][:70],
            next_launched_ms_after_gap_start=(round((launch["ts"] - start) / 1e3, 3)
                                              if launch else None),
            host_sync=(dict(name=longest["name"], ms=round(longest["dur"] / 1e3, 3),
                            from_ms=round((longest["ts"] - t0) / 1e3, 3))
                       if longest else None)))
    copies = {}
    for stream_id, items in streams.items():
        if stream_id == compute_id:
            continue
        for e in items:
            kind = e["name"].split(" ")[0] if e["cat"] == "gpu_memcpy" else e["cat"]
            key = f"stream {stream_id} {kind}"
            total = copies.setdefault(key, dict(count=0, ms=0.0))
            total["count"] += 1
            total["ms"] += e["dur"] / 1e3
    idle = sum(g["gap_ms"] for g in gaps)
    step_end = step["ts"] + step["dur"]
    host_calls = {}
    for r in runtime:
        if r["ts"] < t0 or r["ts"] > step_end or not _BLOCKING_CALL.search(r["name"]):
            continue
        total = host_calls.setdefault(r["name"], dict(count=0, ms=0.0))
        total["count"] += 1
        total["ms"] += r["dur"] / 1e3
    return dict(
        step_span_ms=round((gpu_end - t0) / 1e3, 3),
        forward_host_ms=round((backward_start - t0) / 1e3, 3),
        compute_busy_ms=round(busy / 1e3, 3),
        compute_idle_gaps_ms=round(idle, 3),
        compute_idle_gap_count=len(gaps),
        idle_forward_ms=round(sum(g["gap_ms"] for g in gaps if g["phase"] == "forward"), 3),
        idle_backward_ms=round(sum(g["gap_ms"] for g in gaps if g["phase"] == "backward"), 3),
        longest_gaps=sorted(gaps, key=lambda g: -g["gap_ms"])[:top],
        side_streams={k: dict(count=v["count"], ms=round(v["ms"], 3)) for k, v in copies.items()},
        host_blocking_calls={k: dict(count=v["count"], ms=round(v["ms"], 3))
                             for k, v in sorted(host_calls.items())},
    )


# Runtime calls that wait for the device or reach the driver's allocator.
_BLOCKING_CALL = re.compile(
    r"ynchronize|Malloc|Free|HostAlloc|HostRegister|MemPool|Memcpy(?!Async)")


def gpu_bench_modes(shape: str, seq: int, names):
    """gpu_bench's model (one, shared) and the modes set up on it in turn."""
    model = gpu_bench.build_model(shape, seq)
    ids = torch.randint(0, gpu_bench.SHAPES[shape]["vocab_size"], (1, seq),
                        generator=torch.Generator().manual_seed(1234)).cuda()
    makers = {"ckpt": gpu_bench.Mode, "ckpt_offload": gpu_bench.CkptOffload,
              "ckpt_offload_no_head": _no_head}
    probed = []
    for name in names:
        if name not in makers:
            raise SystemExit(f"--modes: unknown mode {name!r}; known: {', '.join(makers)}")
        mode = makers[name]()
        probed.append(Probed(name, model, mode.context, mode.stats,
                             setup=lambda m=mode: m.setup(model),
                             teardown=lambda m=mode: m.teardown(model)))
    return probed, ids


def real_modes(shape: str, seq: int, loss: str, names, peers_dir: str):
    """real_bench's workload: each mode its own LoRA model over one shared base."""
    import real_bench
    from workloads import base_model

    base = base_model(shape)
    modes = real_bench.make_modes(names, base, loss, peers_dir)
    probed = [Probed(m.name, m.model, m.context,
                     (m.handle.stats if m.handle is not None else dict)) for m in modes]
    return probed, real_bench.token_ids(shape, seq, seed=1234)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="8b:32768", help="SHAPE:SEQ or SHAPE:SEQ:LOSS")
    parser.add_argument("--modes", default="ckpt,ckpt_offload,ckpt_offload_no_head")
    parser.add_argument("--timed", type=int, default=2, help="unprofiled timed steps per mode")
    parser.add_argument("--peers_dir", default=os.environ.get("CKPT_OFFLOAD_PEERS_DIR", ".peers"))
    parser.add_argument("--out", default="/tmp/timeline")
    args = parser.parse_args(argv)
    parts = args.config.split(":")
    if len(parts) not in (2, 3):
        raise SystemExit(f"--config: {args.config!r} is not SHAPE:SEQ or SHAPE:SEQ:LOSS")
    try:
        seq = int(parts[1])
    except ValueError:
        raise SystemExit(f"--config: bad sequence length in {args.config!r}") from None
    os.makedirs(args.out, exist_ok=True)
    names = args.modes.split(",")
    if len(parts) == 2:
        probed, ids = gpu_bench_modes(parts[0], seq, names)
    else:
        probed, ids = real_modes(parts[0], seq, parts[2], names, args.peers_dir)
    report = dict(meta=gpu_bench.meta(), config=args.config, modes={})
    # Every mode is timed before anything is profiled: at 1B s4k (host-bound) the mode timed
    # right after another mode's profiled step ran 1.7x its benchmark time.
    timed = {}
    for mode in probed:
        mode.setup()
        try:
            for _ in range(WARMUP_STEPS):
                train_step(mode, ids)
            timed[mode.name] = [train_step(mode, ids) for _ in range(args.timed)]
        finally:
            mode.teardown()
    for mode in probed:
        mode.setup()
        try:
            train_step(mode, ids)  # warm-up
            trace = os.path.join(args.out, f"trace_{mode.name}.json")
            profiled_step(mode, ids, trace)
            summary = analyse(trace)
            summary["timed_step_ms"] = [round(t, 2) for t in timed[mode.name]]
            summary["timed_median_ms"] = round(statistics.median(timed[mode.name]), 2)
            summary["stats"] = mode.stats()
        finally:
            mode.teardown()
        with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(trace)
        report["modes"][mode.name] = summary
        print(f"== {mode.name}\n{json.dumps(summary, indent=1)}", flush=True)
        with open(os.path.join(args.out, "timeline_probe.json"), "w") as f:
            json.dump(report, f, indent=1)
    base = report["modes"].get("ckpt")
    if base:
        for name, summary in report["modes"].items():
            print(f"{name}: span {summary['step_span_ms']:.1f} ms "
                  f"({summary['step_span_ms'] - base['step_span_ms']:+.1f}), busy "
                  f"{summary['compute_busy_ms']:.1f} "
                  f"({summary['compute_busy_ms'] - base['compute_busy_ms']:+.1f}), "
                  f"idle {summary['compute_idle_gaps_ms']:.1f} "
                  f"(fwd {summary['idle_forward_ms']:.1f}, bwd {summary['idle_backward_ms']:.1f}), "
                  f"timed {summary['timed_median_ms']:.1f} ms", flush=True)
    return 0


# ckpt_offload profiles its second step once per run: both untimed.
WARMUP_STEPS = 2


def _no_head():
    mode = gpu_bench.CkptOffload()
    mode.kwargs["offload_head"] = False
    mode.name = "ckpt_offload_no_head"
    return mode


if __name__ == "__main__":
    sys.exit(main())
