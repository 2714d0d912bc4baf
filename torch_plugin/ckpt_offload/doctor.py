"""Checks this machine for activation offload and says what to change.

    python -m ckpt_offload.doctor [--device N] [--copy_mib 256] [--json]

Reports torch and CUDA versions, whether ckpt_offload._C was built with CUDA, an offload
round trip through the engine, and with a GPU: pinned host allocation speed, D2H, H2D and
both-directions copy bandwidth (pinned memory, a stream of its own, CUDA events), the GPU's
NUMA node and the node the engine would place its pinned memory on; then host RAM, the
memory limit of the process's cgroup, and the host_memory_limit the defaults choose per
local rank. Each finding that needs action comes with what to do.

Safe on a busy GPU: it allocates one buffer of --copy_mib (default 256 MiB; less when the
GPU has less free), touches no other process's memory, changes no device setting, and
takes a few seconds. Without a GPU it reports what it can and says what it skipped.
Exit status: 0, or 1 when a check failed (the extension does not load, the round trip
fails).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Dict, List, Optional

# Below these, copies are well under what a PCIe 4.0 x16 link gives (about 25 GB/s per
# direction; 5.0 x16 about 50): something in the path is off.
SLOW_COPY_GBPS = 10.0
# The engine's pool growing by a fresh slab (it pins its own: 14-19 GB/s on an H200 host,
# where torch's cudaHostAlloc gives 1.5-3.2); much slower pinning means the first
# steps at a new longest length wait for it.
SLOW_PIN_GBPS = 4.0
COPY_REPEATS = 5


class Report:
    """Findings in order, each a (section, label, value) row, plus advice lines."""

    def __init__(self):
        self.rows: List[tuple] = []
        self.values: Dict[str, object] = {}
        self.advice: List[str] = []
        self.failed = False

    def add(self, section: str, key: str, label: str, value, shown: Optional[str] = None):
        self.values[key] = value
        self.rows.append((section, label, shown if shown is not None else str(value)))

    def advise(self, text: str):
        self.advice.append(text)

    def text(self) -> str:
        out, section = [], None
        width = max((len(label) for _, label, _ in self.rows), default=0)
        for row_section, label, shown in self.rows:
            if row_section != section:
                out.append(f"{'' if section is None else chr(10)}{row_section}")
                section = row_section
            out.append(f"  {label.ljust(width)}  {shown}")
        out.append("")
        if self.advice:
            out.append("What to change")
            out.extend(f"  - {line}" for line in self.advice)
        else:
            out.append("Nothing to change.")
        return "\n".join(out) + "\n"

    def json(self) -> str:
        return json.dumps(dict(self.values, advice=self.advice, ok=not self.failed),
                          sort_keys=True) + "\n"


def gib(value: int) -> str:
    return f"{value / 2**30:.2f} GiB"


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def default_limit_for(local_ranks: int) -> int:
    """host_memory_limit=None's bytes with `local_ranks` processes on this node: the
    engine's own rule (ckpt_offload.config), evaluated with LOCAL_WORLD_SIZE set so."""
    from ckpt_offload.config import parse_host_memory_limit

    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(local_ranks)
    try:
        return parse_host_memory_limit(None)
    finally:
        if saved is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved


def pci_bus_id(props) -> Optional[str]:
    """domain:bus:device.function of a CUDA device, from torch's device properties."""
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    return (f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:"
            f"{getattr(props, 'pci_device_id', 0):02x}.0")


def check_software(report: Report):
    import torch

    report.add("Software", "python", "Python", platform.python_version())
    report.add("Software", "torch", "torch", torch.__version__)
    report.add("Software", "torch_cuda", "torch CUDA", torch.version.cuda or "none (CPU build)")
    try:
        import ckpt_offload
        from ckpt_offload._native import _C
    except ImportError as error:
        report.failed = True
        report.add("Software", "extension", "ckpt_offload._C", f"does not load: {error}")
        report.advise("Rebuild the extension against this torch: pip install "
                      "--no-build-isolation --force-reinstall --no-deps . (from the source tree)")
        return False
    report.add("Software", "ckpt_offload", "ckpt_offload", ckpt_offload.__version__)
    report.add("Software", "extension", "ckpt_offload._C", _C.__file__)
    report.add("Software", "built_with_torch", "built against torch", _C.BUILT_WITH_TORCH)
    cuda_compiled = bool(_C.cuda_support_compiled())
    report.add("Software", "c_has_cuda", "_C has CUDA", cuda_compiled,
               "yes" if cuda_compiled else "no (host backend only)")
    if torch.version.cuda and not cuda_compiled:
        report.advise("This torch has CUDA but _C was built without it (CKPT_OFFLOAD_NO_CUDA=1, "
                      "or built against another torch): reinstall with pip install "
                      "--no-build-isolation --force-reinstall --no-deps .")
    return True


def check_round_trip(report: Report, backend: str, device):
    """One checkpointed layer offloaded and restored; the gradient must be unchanged."""
    import torch

    import ckpt_offload

    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 256).to(device)
    x = torch.randn(64, 256, device=device)

    def grad(offload: bool):
        layer.zero_grad(set_to_none=True)
        inputs = x * 1.0
        if offload:
            with ckpt_offload.offload_activations(backend=backend, min_offload_bytes=0,
                                                  keep_last=0) as engine:
                ckpt_offload.checkpoint(layer, inputs).square().sum().backward()
            return layer.weight.grad.clone(), engine.stats()
        ckpt_offload.checkpoint(layer, inputs).square().sum().backward()
        return layer.weight.grad.clone(), None

    try:
        expected, _ = grad(False)
        got, stats = grad(True)
        ok = torch.equal(expected, got) and stats["offloaded_tensors"] == 1 \
            and stats["restored_tensors"] == 1
        detail = "ok (offloaded and restored, gradient identical)" if ok else \
            f"FAILED (gradient identical: {torch.equal(expected, got)}, stats {stats})"
    except Exception as error:  # noqa: BLE001  (any failure is the finding)
        ok, detail = False, f"FAILED: {type(error).__name__}: {error}"
    report.add("Engine", f"round_trip_{backend}", f"round trip ({backend} backend)", ok, detail)
    if not ok:
        report.failed = True
        report.advise(f"The {backend} backend's round trip failed; run the test suite "
                      "(bazel test //...) or report the output above.")


def engine_pool_growth(device, nbytes: int):
    """Bytes by which the engine's host pool grew when asked for `nbytes` more, and the
    seconds its pinned slabs took (its own pinning, not torch's)."""
    import torch

    import ckpt_offload

    layer = torch.nn.Linear(256, 256).to(device)
    x = torch.randn(64, 256, device=device)
    with ckpt_offload.offload_activations(backend="cuda", min_offload_bytes=0,
                                          keep_last=0) as engine:
        loss = ckpt_offload.checkpoint(layer, x * 1.0).square().sum()  # the engine is up
        before = engine.stats()
        engine.reserve_host(int(before["host_reserved_bytes"]) + nbytes)
        after = engine.stats()
        loss.backward()
    return (int(after["host_reserved_bytes"] - before["host_reserved_bytes"]),
            after["pinned_allocation_seconds"] - before["pinned_allocation_seconds"])


def measure_gpu(report: Report, device_index: int, copy_mib: int):
    """Pinned allocation speed and copy bandwidths on `device_index`, on a stream of its own."""
    import torch

    from ckpt_offload.copy_rate import copy_seconds

    device = torch.device("cuda", device_index)
    props = torch.cuda.get_device_properties(device)
    report.add("GPU", "gpu", "device",
               f"cuda:{device_index} {props.name}, {gib(props.total_memory)}")
    free, _ = torch.cuda.mem_get_info(device)
    # Stay well inside the free memory of a GPU others may be using.
    nbytes = min(copy_mib << 20, free // 4) // 4096 * 4096
    if nbytes < (16 << 20):
        report.add("GPU", "copy_skipped", "copies", f"skipped: only {gib(free)} free on the GPU")
        return props
    report.add("GPU", "copy_bytes", "copy size", nbytes, f"{nbytes >> 20} MiB")

    pin_gbps = None
    try:
        grown, pin_s = engine_pool_growth(device, nbytes)
        if grown > 0 and pin_s > 0:
            pin_gbps = grown / pin_s / 1e9
            detail = f"{pin_gbps:.2f} GB/s ({pin_s * 1e3:.0f} ms for {grown >> 20} MiB)"
        else:
            detail = "not measured: the pool did not grow"
    except RuntimeError as error:  # the pool refused (host_memory_limit, host memory)
        detail = f"not measured: {error}"
    report.add("GPU", "pinned_alloc_gbps", "pinned allocation (engine's pool)",
               None if pin_gbps is None else round(pin_gbps, 2), detail)
    start = time.perf_counter()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # torch's: cudaHostAlloc
    torch_pin_s = time.perf_counter() - start
    report.add("GPU", "torch_pinned_alloc_gbps", "pinned allocation (torch)",
               round(nbytes / torch_pin_s / 1e9, 2),
               f"{nbytes / torch_pin_s / 1e9:.2f} GB/s ({torch_pin_s * 1e3:.0f} ms)")
    host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    device_out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]
    d2h = nbytes / copy_seconds([(host, device_buf)], streams, COPY_REPEATS) / 1e9
    h2d = nbytes / copy_seconds([(device_out, host_in)], streams, COPY_REPEATS) / 1e9
    both = 2 * nbytes / copy_seconds([(host, device_buf), (device_out, host_in)], streams,
                                     COPY_REPEATS) / 1e9
    report.add("GPU", "d2h_gbps", "D2H (pinned)", round(d2h, 2), f"{d2h:.1f} GB/s")
    report.add("GPU", "h2d_gbps", "H2D (pinned)", round(h2d, 2), f"{h2d:.1f} GB/s")
    report.add("GPU", "bidir_gbps", "both at once", round(both, 2), f"{both:.1f} GB/s")
    report.add("GPU", "planner_flags", "for the planner",
               f"--d2h_gbps={d2h:.0f} --h2d_gbps={h2d:.0f} --bidir_gbps={both:.0f}")
    del host, host_in, device_buf, device_out
    torch.cuda.synchronize(device)
    if min(d2h, h2d) < SLOW_COPY_GBPS:
        report.advise(f"Copies run at {min(d2h, h2d):.1f} GB/s, below {SLOW_COPY_GBPS:.0f}: "
                      "check the link (nvidia-smi -q, 'PCIe Generation' and 'Link Width' "
                      "under load), other transfers on the same link, and that the GPU sits "
                      "on the CPU socket its memory is on (NUMA below). The offload's copies "
                      "then hide behind less compute: plan with these figures.")
    if pin_gbps is not None and pin_gbps < SLOW_PIN_GBPS:
        report.advise(f"Pinning host memory runs at {pin_gbps:.2f} GB/s: the engine's pool "
                      "grows slowly in the first steps. Check for memory pressure or "
                      "transparent huge page compaction (/sys/kernel/mm/transparent_hugepage).")
    return props


def check_numa(report: Report, bus_id: Optional[str]):
    online = _read("/sys/devices/system/node/online")
    report.add("NUMA", "numa_nodes_online", "nodes online", online or "unknown (no sysfs)")
    if bus_id is None:
        report.add("NUMA", "gpu_numa_node", "GPU's node", None, "no GPU")
        return
    node = _read(f"/sys/bus/pci/devices/{bus_id}/numa_node")
    report.add("NUMA", "gpu_pci_bus_id", "GPU PCI bus id", bus_id)
    report.add("NUMA", "gpu_numa_node", "GPU's node", int(node) if node and
               node.lstrip("-").isdigit() else None, node or "unknown")
    from ckpt_offload import _plan

    choice, reason = _plan.choose_numa_node(bus_id)
    report.add("NUMA", "engine_numa_node", "engine places pinned memory on", choice, reason)
    if choice is None and online and ("-" in online or "," in online):
        report.advise("Several NUMA nodes but no placement for this GPU (" + reason + "): "
                      "pinned memory may land on the far socket. Bind the process instead, "
                      "e.g. numactl --cpunodebind=N --membind=N (N: the GPU's node).")


def check_host_memory(report: Report, gpus: int):
    from ckpt_offload.config import cgroup_memory_limit, local_world_size, total_host_memory_bytes

    ram = total_host_memory_bytes()
    report.add("Host memory", "host_ram_bytes", "RAM", ram, gib(ram))
    limit = cgroup_memory_limit()
    report.add("Host memory", "cgroup_limit_bytes", "cgroup limit", limit,
               gib(limit) if limit else "none")
    env_ranks = os.environ.get("LOCAL_WORLD_SIZE")
    ranks = local_world_size() if env_ranks else max(gpus, 1)
    per_rank = default_limit_for(ranks)
    source = "LOCAL_WORLD_SIZE" if env_ranks else \
        (f"one process per GPU ({gpus})" if gpus else "one process")
    report.add("Host memory", "local_ranks", "local ranks", ranks, f"{ranks} ({source})")
    whole = "the cgroup limit" if limit is not None and limit < ram else "RAM"
    report.add("Host memory", "default_limit_per_rank", "default host_memory_limit per rank",
               per_rank, f"{gib(per_rank)} (half of {whole} / {ranks})")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckpt_offload.doctor",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=int, default=None,
                        help="CUDA device index (default: LOCAL_RANK, else 0)")
    parser.add_argument("--copy_mib", type=int, default=256,
                        help="size of the timed copies (default 256)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.copy_mib < 16:
        parser.error(f"--copy_mib must be at least 16, got {args.copy_mib}")

    report = Report()
    if check_software(report):
        import torch

        check_round_trip(report, "host", "cpu")
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        bus_id = None
        if gpus:
            index = args.device if args.device is not None else \
                int(os.environ.get("LOCAL_RANK", "0") or 0)
            if not 0 <= index < gpus:
                parser.error(f"--device must be in 0..{gpus - 1}, got {index}")
            torch.cuda.set_device(index)
            from ckpt_offload._native import _C

            if _C.cuda_support_compiled():
                check_round_trip(report, "cuda", torch.device("cuda", index))
            props = measure_gpu(report, index, args.copy_mib)
            bus_id = pci_bus_id(props)
        else:
            report.add("GPU", "gpu", "device", None,
                       "none visible: copy and pinning measurements skipped")
            report.advise("No CUDA device: ckpt_offload offloads nothing with backend='auto' "
                          "here (backend='host' exists for tests on CPU). On a GPU machine, "
                          "check that torch.cuda.is_available() is True.")
        check_numa(report, bus_id)
        check_host_memory(report, gpus)
    sys.stdout.write(report.json() if args.json else report.text())
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
