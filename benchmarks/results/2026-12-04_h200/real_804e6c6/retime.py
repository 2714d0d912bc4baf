"""The matrix rows of this run without ckpt_offload's profiled step.

real_bench.py at 804e6c6 timed every round after one warm-up round; its second round is
ckpt_offload's once-per-run profiled step (peak breakdown), 0.5-0.7 % slower than its other
steps. This re-reads the raw logs and takes rounds 2.. only (the harness's default since).

    python3 retime.py > retimed.md
"""
import collections
import re
import statistics

LINE = re.compile(r"(\S+) round (\d+) (\S+): ([\d.]+) ms, ([\d.]+) GiB")
FIRST_TIMED = 2

print("| config | mode | step ms | overhead % (medians) | paired % | act peak GiB | rounds |")
print("|---|---|---|---|---|---|---|")
for log in ("matrix_8b.log", "matrix_qwen3.log", "matrix_1b.log"):
    rows = collections.defaultdict(lambda: collections.defaultdict(dict))
    with open(log) as f:
        for line in f:
            m = LINE.match(line)
            if m:
                rows[m[1]][m[3]][int(m[2])] = (float(m[4]), float(m[5]))
    for config, modes in rows.items():
        ckpt = modes["ckpt"]
        for mode, rounds in modes.items():
            timed = [r for r in ckpt if r >= FIRST_TIMED and r in rounds]
            if not timed:
                continue
            step = statistics.median(rounds[r][0] for r in timed)
            base = statistics.median(ckpt[r][0] for r in timed)
            paired = statistics.median(rounds[r][0] / ckpt[r][0] - 1 for r in timed) * 100
            # Peak over every round after the first (the profiled round's reading is low).
            peak = max(rounds[r][1] for r in rounds if r >= 1)
            print(f"| {config} | {mode} | {step:.0f} | {100 * (step / base - 1):+.2f} | "
                  f"{paired:+.2f} | {peak:.2f} | {len(timed)} |")
