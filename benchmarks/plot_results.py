"""PNG plots from gpu_bench output: overhead per config and mode, and GPU memory over one
training step (ckpt vs ckpt_offload).

    python benchmarks/plot_results.py benchmarks/results/gpu_bench_<date>.json ...

Files are read in the order given; where a config and mode ran more than once, the last
file's run is plotted.
"""

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_overhead(runs, path):
    configs = []
    for r in runs:
        key = f"{r['model']} s{r['seq']}"
        if key not in configs:
            configs.append(key)
    modes = []
    for r in runs:  # every mode but the baseline, in the order they ran
        if r["mode"] != "ckpt" and r["mode"] not in modes:
            modes.append(r["mode"])
    width = 0.8 / max(1, len(modes))
    fig, ax = plt.subplots(figsize=(1.6 * len(configs) + 3, 4))
    for i, mode in enumerate(modes):
        values = []
        for key in configs:
            match = [r for r in runs if f"{r['model']} s{r['seq']}" == key and r["mode"] == mode
                     and "overhead_pct" in r]
            # The latest run of a config and mode wins (files are given oldest first).
            values.append(match[-1]["overhead_pct"] if match else float("nan"))
        xs = [c + (i - (len(modes) - 1) / 2) * width for c in range(len(configs))]
        bars = ax.bar(xs, values, width, label=mode)
        for bar, value in zip(bars, values):
            if value == value:
                ax.annotate(f"{value:+.1f}%", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels(configs)
    ax.set_ylabel("step time vs checkpointing alone (%)")
    ax.set_title("Step-time overhead (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_memory(timelines, title, path):
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, timeline in timelines:
        xs = [p[0] for p in timeline["points"]]
        ys = [p[1] for p in timeline["points"]]
        ax.plot(xs, ys, label=f"{label} (peak {max(ys):.2f} GiB)")
    ax.set_xlabel("time in the step (ms)")
    ax.set_ylabel("GPU memory allocated by the step (GiB)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", nargs="*", help="gpu_bench JSON files (overhead plot)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--memory", nargs="*", default=[],
                        help="LABEL=timeline.json pairs for the memory plot")
    parser.add_argument("--memory_title", default="GPU memory over one training step")
    parser.add_argument("--memory_png", default="memory_step.png")
    args = parser.parse_args()
    runs = []
    for path in args.results:
        with open(path) as f:
            runs.extend(json.load(f)["runs"])
    if runs:
        plot_overhead([r for r in runs if r["seq"] != "var"],
                      os.path.join(args.out, "overhead.png"))
    if args.memory:
        timelines = []
        for item in args.memory:
            label, _, path = item.partition("=")
            with open(path) as f:
                timelines.append((label, json.load(f)))
        plot_memory(timelines, args.memory_title, os.path.join(args.out, args.memory_png))


if __name__ == "__main__":
    main()
