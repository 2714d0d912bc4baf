"""CPU cost of the saved-tensor hooks: pack + unpack (+ the handle's release) per tensor,
through the C++ hooks bound as ckpt_offload._C.Offloader.pack/unpack.

    bazel run -c opt //benchmarks:pack_bench

Host backend, 4 KiB tensors (so the copies are negligible next to the bookkeeping), one
group of `--group` tensors per checkpoint call, the pattern autograd produces: pack in
forward order, unpack and release in reverse.
"""

import argparse
import statistics
import time

import torch

from ckpt_offload import _C


def run(steps, group, groups, keep_last, prefetch_depth):
    offloader = _C.Offloader(keep_last=keep_last, prefetch_depth=prefetch_depth,
                             min_offload_bytes=0, host_memory_limit=1 << 32, backend="host",
                             scope="checkpoint_inputs")
    tensors = [[torch.randn(1024) for _ in range(group)] for _ in range(groups)]
    per_tensor_us = []
    for _ in range(steps):
        start = time.perf_counter()
        packed = []
        for layer in tensors:
            offloader.begin_group(layer)
            packed.append([offloader.pack(t) for t in layer])
            offloader.end_group()
        while packed:
            layer = packed.pop()  # the handles die as autograd frees them
            for handle in [offloader.unpack(p) for p in layer]:
                del handle
            del layer
        elapsed = time.perf_counter() - start
        per_tensor_us.append(elapsed * 1e6 / (group * groups))
    stats = offloader.stats()
    assert stats["host_live_bytes"] == 0, stats
    return statistics.median(per_tensor_us[1:] or per_tensor_us), stats


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    print("groups x tensors, keep_last, prefetch: median us per tensor (pack+unpack+release)")
    for groups, group, keep_last, prefetch in ((32, 1, 1, 1), (32, 4, 1, 1), (80, 2, 0, 2)):
        us, stats = run(args.steps, group, groups, keep_last, prefetch)
        print(f"{groups} x {group}, keep_last {keep_last}, prefetch {prefetch}: {us:.2f} us "
              f"(offloaded {stats['offloaded_tensors']}, restored {stats['restored_tensors']} "
              f"over all steps)")


if __name__ == "__main__":
    main()
