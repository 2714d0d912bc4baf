"""budget_bench.py with each step's allocator figures printed: its time (timed steps),
what was allocated as it began, its reserved and allocated peak, and how many times during
it the allocator called cudaMalloc or cudaFree, or gave its cache back and retried
(num_alloc_retries); the CPU time this process spent in it (the budget's dispatch modes
run Python per op: a busy host slows them first) and the host's load. Same arguments as
budget_bench.py."""

import os
import sys
import time

import torch

import budget_bench
from real_bench import ALLOCATOR_DRIVER_KEYS

_one_step = budget_bench.one_step


def one_step_with_allocator_figures(mode, ids, record):
    before = torch.cuda.memory_stats()
    # What the step starts from: anything a mode keeps between steps narrows the next one.
    allocated_before = torch.cuda.memory_allocated() / 2**30
    cpu_before = time.process_time()
    _one_step(mode, ids, record)  # resets the peaks as it begins
    cpu_seconds = time.process_time() - cpu_before
    after = torch.cuda.memory_stats()
    delta = {key: int(after.get(key, 0)) - int(before.get(key, 0))
             for key in ALLOCATOR_DRIVER_KEYS}
    step_time = f"{mode.times[-1]:.1f} ms" if record else "warm-up"
    print(f"step {mode.name}: {step_time}, allocated before {allocated_before:.2f} GiB, "
          f"reserved peak {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB, allocated peak "
          f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, {delta}, this process's CPU "
          f"{cpu_seconds * 1e3:.0f} ms, load average {os.getloadavg()[0]:.1f}", flush=True)


budget_bench.one_step = one_step_with_allocator_figures

if __name__ == "__main__":
    sys.exit(budget_bench.main())
