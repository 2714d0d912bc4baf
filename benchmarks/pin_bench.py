"""How fast can this machine make pinned host memory, and does the way it was made change
copy speed? Times each way of pinning a fresh range (cudaHostAlloc; torch's pinned
allocator; mmap + population by 1 or N threads, with or without transparent huge pages,
then cudaHostRegister) and the device-to-host and host-to-device copy rate into the result.

Needs only torch with CUDA (the CUDA runtime is called through ctypes). Usage:
    python3 benchmarks/pin_bench.py [--gib 1 4] [--threads 8] [--out pin.json]
"""
import argparse
import ctypes
import ctypes.util
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time

import torch

GIB = 1 << 30
HUGE_PAGE = 2 << 20
PROT_READ, PROT_WRITE = 1, 2
MAP_PRIVATE, MAP_ANONYMOUS = 0x02, 0x20
MADV_HUGEPAGE, MADV_NOHUGEPAGE, MADV_POPULATE_WRITE = 14, 15, 23
CUDA_HOST_ALLOC_PORTABLE = 1
CUDA_HOST_REGISTER_PORTABLE = 1
D2H, H2D = 2, 1

libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def load_cudart():
    torch.cuda.init()
    candidates = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    for path in sys.path:
        candidates += sorted(glob.glob(os.path.join(path, "nvidia", "**", "libcudart.so*"),
                                       recursive=True))
    for name in candidates:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("libcudart not found")


cudart = load_cudart()
cudart.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                 ctypes.c_uint]
cudart.cudaFreeHost.argtypes = [ctypes.c_void_p]
cudart.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
cudart.cudaHostUnregister.argtypes = [ctypes.c_void_p]
cudart.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


TOUCH_SOURCE = """
#include <stddef.h>
void touch_pages(char* p, size_t n, size_t stride) {
  for (size_t i = 0; i < n; i += stride) ((volatile char*)p)[i] = 0;
}
"""


def load_touch():
    """touch_pages(ptr, bytes, stride) compiled here (a write per page from Python would take
    seconds per GiB); None when no C compiler is found."""
    folder = tempfile.mkdtemp()
    source, library = os.path.join(folder, "touch.c"), os.path.join(folder, "touch.so")
    with open(source, "w") as f:
        f.write(TOUCH_SOURCE)
    try:
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", source, "-o", library], check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"no touch rows: {e}", flush=True)
        return None
    touch = ctypes.CDLL(library).touch_pages
    touch.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    return touch


touch_pages = load_touch()


def check(error: int, call: str) -> None:
    if error != 0:
        raise RuntimeError(f"{call} failed: CUDA error {error}")


def read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        return f"unreadable ({e.strerror})"


def machine() -> dict:
    meminfo = {line.split(":")[0]: line.split(":")[1].strip()
               for line in read("/proc/meminfo").splitlines() if ":" in line}
    return dict(
        kernel=platform.release(), cpus=os.cpu_count(),
        thp_enabled=read("/sys/kernel/mm/transparent_hugepage/enabled"),
        thp_defrag=read("/sys/kernel/mm/transparent_hugepage/defrag"),
        numa_nodes=sorted(os.path.basename(p) for p in
                          glob.glob("/sys/devices/system/node/node[0-9]*")),
        mem_total=meminfo.get("MemTotal"), mem_available=meminfo.get("MemAvailable"),
        memlock=read("/proc/self/limits").split("Max locked memory")[-1].split("\n")[0].strip(),
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda)


class Pinned:
    """A pinned range and how to give it back."""

    def __init__(self, ptr: int, nbytes: int, release):
        self.ptr, self.nbytes, self._release = ptr, nbytes, release

    def free(self) -> None:
        self._release()
        if hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # torch's pool would serve the next round


def host_alloc(nbytes: int, flags: int) -> Pinned:
    ptr = ctypes.c_void_p()
    check(cudart.cudaHostAlloc(ctypes.byref(ptr), nbytes, flags), "cudaHostAlloc")
    return Pinned(ptr.value, nbytes, lambda: check(cudart.cudaFreeHost(ptr), "cudaFreeHost"))


def torch_pinned(nbytes: int) -> Pinned:
    tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    holder = [tensor]
    return Pinned(tensor.data_ptr(), nbytes, holder.clear)


def populate(ptr: int, nbytes: int, threads: int, touch: bool = False) -> None:
    """Faults the range in with MADV_POPULATE_WRITE, or a write per 4 KiB page, split over
    `threads` (ctypes drops the GIL for the call, so the threads fault in parallel)."""
    chunk = -(-nbytes // threads // HUGE_PAGE) * HUGE_PAGE
    errors = []

    def work(start: int) -> None:
        length = min(chunk, nbytes - start)
        if length <= 0:
            return
        if touch:
            touch_pages(ptr + start, length, 4096)
        elif libc.madvise(ptr + start, length, MADV_POPULATE_WRITE) != 0:
            errors.append(ctypes.get_errno())

    workers = [threading.Thread(target=work, args=(i * chunk,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise OSError(errors[0], "madvise(MADV_POPULATE_WRITE)")


def map_and_register(nbytes: int, threads: int, huge: bool, phases: dict,
                     touch: bool = False) -> Pinned:
    t0 = time.perf_counter()
    ptr = libc.mmap(None, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    if ptr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    libc.madvise(ptr, nbytes, MADV_HUGEPAGE if huge else MADV_NOHUGEPAGE)
    populate(ptr, nbytes, threads, touch)
    t1 = time.perf_counter()
    check(cudart.cudaHostRegister(ptr, nbytes, CUDA_HOST_REGISTER_PORTABLE),
          "cudaHostRegister")
    t2 = time.perf_counter()
    phases["populate_s"] = t1 - t0
    phases["register_s"] = t2 - t1

    def release():
        check(cudart.cudaHostUnregister(ptr), "cudaHostUnregister")
        libc.munmap(ptr, nbytes)

    return Pinned(ptr, nbytes, release)


def anon_huge_kib() -> int:
    for line in read("/proc/self/smaps_rollup").splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return -1


def copy_rates(pinned: Pinned, device_buffer: torch.Tensor) -> dict:
    rates = {}
    nbytes = min(pinned.nbytes, device_buffer.numel())
    for name, direction, dst, src in (("d2h_gbps", D2H, pinned.ptr, device_buffer.data_ptr()),
                                      ("h2d_gbps", H2D, device_buffer.data_ptr(), pinned.ptr)):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            check(cudart.cudaMemcpy(dst, src, nbytes, direction), "cudaMemcpy")
            best = min(best, time.perf_counter() - t0)
        rates[name] = nbytes / best / 1e9
    return rates


def methods(threads: int):
    touch_rows = [] if touch_pages is None else [
        (f"mmap 4k pages, {threads} threads touch + register",
         lambda n, p: map_and_register(n, threads, False, p, touch=True)),
        (f"mmap huge pages, {threads} threads touch + register",
         lambda n, p: map_and_register(n, threads, True, p, touch=True)),
    ]
    return touch_rows + [
        ("cudaHostAlloc portable", lambda n, p: host_alloc(n, CUDA_HOST_ALLOC_PORTABLE)),
        ("cudaHostAlloc default", lambda n, p: host_alloc(n, 0)),
        ("torch pin_memory", lambda n, p: torch_pinned(n)),
        ("mmap 4k pages, 1 thread + register", lambda n, p: map_and_register(n, 1, False, p)),
        (f"mmap 4k pages, {threads} threads + register",
         lambda n, p: map_and_register(n, threads, False, p)),
        ("mmap huge pages, 1 thread + register", lambda n, p: map_and_register(n, 1, True, p)),
        (f"mmap huge pages, {threads} threads + register",
         lambda n, p: map_and_register(n, threads, True, p)),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, nargs="+", default=[1, 4])
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    report = dict(machine=machine(), rows=[])
    print(json.dumps(report["machine"]), flush=True)
    device_buffer = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    # Interleaved: round by round, every method once per size, so drift hits all alike.
    for round_index in range(args.rounds):
        for gib in args.gib:
            nbytes = int(gib * GIB) // HUGE_PAGE * HUGE_PAGE
            for name, make in methods(args.threads):
                phases = {}
                huge_before = anon_huge_kib()
                t0 = time.perf_counter()
                pinned = make(nbytes, phases)
                seconds = time.perf_counter() - t0
                row = dict(round=round_index, method=name, gib=gib, seconds=seconds,
                           s_per_gib=seconds / gib,
                           anon_huge_mib=(anon_huge_kib() - huge_before) // 1024, **phases)
                if gib == args.gib[0]:
                    row.update(copy_rates(pinned, device_buffer))
                pinned.free()
                torch.cuda.synchronize()
                report["rows"].append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
