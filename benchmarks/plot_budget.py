"""PNG plot of budget_bench results: each mode's step time against its peak GPU memory.

    python benchmarks/plot_budget.py OUT.png RUN_DIR/budget_bench.json ... [--title TITLE]

One panel per model and sequence length. x: the step's peak reserved memory; y: its median
step time over full checkpointing's median step in the same process. Where a mode of a config
(model, seq, cap, budget) ran in more than one file, the last file given wins.
"""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Per mode: legend label, marker, colour, where its ratio is written (offset in points).
MODE_STYLES = {
    "ckpt": ("full checkpointing (the reference)", "s", "black", None),
    "ckpt_offload": ("ckpt_offload today", "D", "tab:gray", (-8, 4)),
    "budget": ("ckpt_offload + memory budget", "o", "tab:blue", (8, -13)),
    "budget_keep": ("budget, op outputs kept on the device only", "v", "tab:cyan", (8, 2)),
    "budget_res": ("budget, resident layers offload storages", "^", "tab:purple", (8, 2)),
    "none": ("no checkpointing", "X", "tab:red", (8, 2)),
    "every_n": ("transformers every_n_layers, best N", "P", "tab:orange", (-8, 4)),
}


def load_runs(paths):
    """Every file's runs merged by config (model, seq, cap, budget): a mode that ran in more
    than one file keeps the last file's row."""
    runs = {}
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        for run in report["runs"]:
            key = (run["shape"], run["seq"], run["cap"], run.get("budget", "auto"))
            merged = runs.setdefault(key, dict(run, rows={}))
            merged["rows"].update((row["mode"], row) for row in run["rows"])
    return list(runs.values())


def cap_of(run):
    """The memory the budget was held to, in GiB, and how to call it."""
    budget = run.get("budget", "auto")
    if budget != "auto":  # an explicit budget under the whole card, e.g. "29GiB"
        gib = float(budget.removesuffix("GiB"))
        return gib, f"{gib:g} GiB budget"
    if run["cap"] == "full":
        return run["cap_gib"], "whole card"
    return run["cap_gib"], f"{run['cap']} GiB"


def plot_panel(ax, runs):
    """Every mode's points, the budget's joined in order of memory, and the caps."""
    points = {mode: [] for mode in MODE_STYLES}
    for run in runs:
        cap_label = cap_of(run)[1]
        for row in run["rows"].values():
            if "ratio" in row:  # modes that ran out of memory have no step to plot
                points.setdefault(row["mode"], []).append(
                    (row["reserved_peak_gib"], row["ratio"], cap_label, row))
    for mode, mode_points in points.items():
        if not mode_points:
            continue
        label, marker, colour, offset = MODE_STYLES.get(mode, (mode, "*", None, (8, 2)))
        xs, ys = [p[0] for p in mode_points], [p[1] for p in mode_points]
        ax.scatter(xs, ys, marker=marker, color=colour, s=55, zorder=3, label=label)
        if mode == "budget":
            mode_points.sort()
            ax.plot([p[0] for p in mode_points], [p[1] for p in mode_points], color=colour,
                    linewidth=1, zorder=2)
        if offset is None:  # checkpointing's ratio is 1.0 by definition
            continue
        for x, y, cap_label, row in mode_points:
            text = f"{y:.3f}"
            if mode == "budget":
                text = f"{cap_label}: {text}"
            elif mode == "every_n":
                text = row["note"].replace("every_n_layers=", "N=") + f": {text}"
            ax.annotate(text, (x, y), textcoords="offset points", xytext=offset, fontsize=8,
                        color=colour, ha="left" if offset[0] > 0 else "right")
    caps = dict(cap_of(run) for run in runs)
    for cap_gib in caps:
        ax.axvline(cap_gib, linestyle=":", color="gray", linewidth=1)
    # The caps named above the frame, where no point or label can hide them.
    ax.secondary_xaxis("top").set_xticks(list(caps), labels=list(caps.values()), fontsize=8)
    ax.margins(x=0.12, y=0.08)  # room for the labels of points near the edges
    ax.axhline(1.0, color="black", linewidth=0.6, zorder=1)
    ax.grid(axis="y", alpha=0.3)
    ax.set_xlabel("peak GPU memory of the step, GiB (allocator's max reserved)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the PNG to write")
    parser.add_argument("results", nargs="+", help="budget_bench.json files, oldest first")
    parser.add_argument("--title", default="LoRA step time against peak GPU memory")
    args = parser.parse_args()
    runs = load_runs(args.results)
    panels = sorted({(run["shape"], run["seq"]) for run in runs})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 + 4 * len(panels), 6), sharex=True,
                             sharey=True, squeeze=False, layout="constrained")
    for ax, (shape, seq) in zip(axes[0], panels):
        plot_panel(ax, [run for run in runs if (run["shape"], run["seq"]) == (shape, seq)])
        if len(panels) > 1:
            ax.set_title(f"{shape}, s{seq // 1024}k")
    axes[0][0].set_ylabel("step time / full checkpointing's step, same process\n"
                          "(1.0 = checkpointing; lower is faster)")
    # One legend for all panels, below them: a mode may appear in one panel only.
    handles = {}
    for ax in axes[0]:
        handles.update(zip(*reversed(ax.get_legend_handles_labels())))
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncol=3, fontsize=8)
    fig.suptitle(args.title)
    fig.savefig(args.out, dpi=130)
    plt.close(fig)


if __name__ == "__main__":
    main()
