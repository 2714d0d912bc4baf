"""Copy rates between device memory and pinned host memory, timed with CUDA events.

The memory budget sizes each layer's copy window with the device-to-host rate of the
device at hand (ckpt_offload.budget, "Offloaded outputs"): links differ by far (PCIe 4
boards copy about 25 GB/s, PCIe 5 boards such as the H100 and H200 about 55, NVLink-C2C
hosts several hundred), so no one constant fits them all. The doctor reports the same
figures in both directions.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

# The budget's probe: bytes per timed copy, large enough that launch latency is noise
# (about 1 ms at 55 GB/s) and small enough to pin quickly (tens of ms) once per process.
PROBE_BYTES = 64 << 20
PROBE_REPEATS = 3

_MEASURED: Dict[int, float] = {}  # bytes per second, by CUDA device index


def copy_seconds(copies: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                 streams: Sequence[torch.cuda.Stream], repeats: int) -> float:
    """Seconds the `copies` ((destination, source) pairs, each on its own of `streams`,
    issued at once) take: the best of `repeats` after one untimed round.
    REQUIRES: len(streams) >= len(copies); the sources are ready on the current stream."""
    best = float("inf")
    begin_stream = streams[0]
    begin_stream.wait_stream(torch.cuda.current_stream(begin_stream.device))
    for _ in range(repeats + 1):  # the first is a warm-up
        begin = torch.cuda.Event(enable_timing=True)
        ends = []
        begin.record(begin_stream)
        for (destination, source), stream in zip(copies, streams):
            stream.wait_event(begin)
            with torch.cuda.stream(stream):
                destination.copy_(source, non_blocking=True)
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            ends.append(end)
        for end in ends:
            end.synchronize()
        best = min(best, max(begin.elapsed_time(end) for end in ends) / 1e3)
    return best


def host_copy_bytes_per_second(device: Optional[int] = None) -> float:
    """The device-to-host rate into pinned memory of `device` (default: the current one),
    PROBE_BYTES at a time, measured once per device and process. 0.0 where it cannot be
    measured (no CUDA device, no room for the probe): the caller keeps its own figure.
    REQUIRES: called between steps (it waits for its copies)."""
    if not torch.cuda.is_available():
        return 0.0
    index = torch.cuda.current_device() if device is None else int(device)
    if index not in _MEASURED:
        try:
            with torch.cuda.device(index):
                source = torch.empty(PROBE_BYTES, dtype=torch.uint8, device="cuda")
                target = torch.empty(PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
                seconds = copy_seconds([(target, source)], [torch.cuda.Stream()],
                                       PROBE_REPEATS)
                del source, target  # their copies completed
        except RuntimeError:  # out of memory (device or pinned host): not remembered
            return 0.0
        _MEASURED[index] = PROBE_BYTES / seconds if seconds > 0 else 0.0
    return _MEASURED[index]
