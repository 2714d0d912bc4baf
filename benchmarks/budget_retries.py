"""budget_bench.py with each timed step's allocator figures printed: its time, reserved
peak, and how many times the allocator freed its cache and retried (num_alloc_retries) or
called cudaMalloc / cudaFree during it. Same arguments as budget_bench.py."""

import sys
import time

import torch

import budget_bench

_one_step = budget_bench.one_step


def one_step_with_allocator_figures(mode, ids, record):
    before = torch.cuda.memory_stats()
    start = time.perf_counter()
    _one_step(mode, ids, record)
    after = torch.cuda.memory_stats()
    delta = {key: int(after.get(key, 0)) - int(before.get(key, 0))
             for key in ("num_alloc_retries", "num_device_alloc", "num_device_free")}
    print(f"step {mode.name}: {(time.perf_counter() - start) * 1e3:.1f} ms, reserved peak "
          f"{torch.cuda.max_memory_reserved() / 2**30:.2f} GiB, allocated peak "
          f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, {delta}", flush=True)


budget_bench.one_step = one_step_with_allocator_figures

if __name__ == "__main__":
    sys.exit(budget_bench.main())
