"""OffloadConfig: the user-facing settings, validated when constructed."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional, Union

BACKENDS = ("auto", "cuda", "host")
SCOPES = ("checkpoint_inputs", "all")

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")

# The native engine stores the integer fields as C++ int, int64_t and uint64_t: larger values
# must fail here, naming the field, not as a TypeError from the extension's constructor.
_INT_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
_UINT64_MAX = 2**64 - 1

HostMemoryLimit = Union[None, int, float, str]
MemoryBudget = Union[None, int, float, str]

# memory_budget="auto": the device memory this process may use, less this share of it for
# what the plan cannot see (the allocator's fragmentation, a CUDA context growing).
AUTO_BUDGET_MARGIN = 0.05


def total_host_memory_bytes() -> int:
    """Physical RAM of this machine (from sysconf)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cgroup_memory_limit(root: str = "/sys/fs/cgroup") -> Optional[int]:
    """The memory limit of this process's cgroup (v2, else v1) in bytes; None when none.
    Reads the files of the cgroup mount the process sees (a container's own)."""
    for path in (os.path.join(root, "memory.max"),
                 os.path.join(root, "memory", "memory.limit_in_bytes")):
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if text.isdigit() and int(text) < 2**60:  # v1 reports "no limit" as about 2**63
            return int(text)
    return None


def usable_host_memory_bytes() -> int:
    """RAM, or the cgroup's memory limit when lower (a container's): the pool's pinned
    pages are the process's own anonymous memory, charged to its cgroup."""
    limit = cgroup_memory_limit()
    ram = total_host_memory_bytes()
    return ram if limit is None else min(ram, limit)


def local_world_size() -> int:
    """Processes sharing this node's RAM (LOCAL_WORLD_SIZE from torchrun/accelerate)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def parse_host_memory_limit(value: HostMemoryLimit, field: str = "host_memory_limit") -> int:
    """Bytes for a limit given as bytes, a size string ("24GiB", "512MB"), a fraction of RAM
    in (0, 1] (e.g. 0.5), or None (half of usable_host_memory_bytes() split across the
    node's local ranks)."""
    accepted = ("accepted: an int of bytes, a size string like '24GiB' or '512MB', "
                "a fraction of RAM in (0, 1] like 0.5, or None")
    if value is None:
        return usable_host_memory_bytes() // 2 // local_world_size()
    ram = total_host_memory_bytes()
    if isinstance(value, bool):
        raise ValueError(f"{field}: got {value!r}; {accepted}")
    if isinstance(value, int):
        if not 0 < value <= _UINT64_MAX:
            raise ValueError(f"{field}: must be positive and at most 2**64 - 1 bytes, got {value}; "
                             f"{accepted}")
        return value
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"{field}: a fraction must be in (0, 1], got {value}; {accepted}")
        size = int(ram * value)
        if size <= 0:
            raise ValueError(f"{field}: the fraction {value} of RAM is 0 bytes; {accepted}")
        return size
    if isinstance(value, str):
        match = _SIZE.match(value)
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            raise ValueError(f"{field}: cannot parse {value!r}; {accepted}")
        number = float(match.group(1))
        if unit == "" and "." in match.group(1):
            return parse_host_memory_limit(number, field)
        size = int(number * _UNITS[unit])
        if not 0 < size <= _UINT64_MAX:
            raise ValueError(f"{field}: must be positive and at most 2**64 - 1 bytes, got "
                             f"{value!r}; {accepted}")
        return size
    raise ValueError(f"{field}: unsupported type {type(value).__name__} ({value!r}); {accepted}")


def parse_memory_budget(value: MemoryBudget, device_bytes: Optional[int] = None,
                        field: str = "memory_budget") -> Optional[int]:
    """Bytes of device memory a step may use for `value`: None (no budget), "auto" (the
    device's memory as this process may use it, less AUTO_BUDGET_MARGIN), bytes, a size
    string ("40GiB"), or a fraction of the device in (0, 1]. `device_bytes` (the memory this
    process may use on the device) is needed for "auto" and fractions; without it they are
    only checked and None is returned."""
    accepted = ("accepted: None, 'auto', an int of bytes, a size string like '40GiB', or a "
                "fraction of the device's memory in (0, 1] like 0.5")
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == "auto":
        if device_bytes is None:
            return None
        return int(device_bytes * (1.0 - AUTO_BUDGET_MARGIN))
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{field}: unsupported value {value!r}; {accepted}")
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"{field}: a fraction must be in (0, 1], got {value}; {accepted}")
        return None if device_bytes is None else int(device_bytes * value)
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2) == "" and "." in match.group(1):
            return parse_memory_budget(float(match.group(1)), device_bytes, field)
    try:
        return parse_host_memory_limit(value, field)
    except ValueError as error:
        raise ValueError(str(error).split("; accepted")[0] + f"; {accepted}") from None


def check_int(name: str, value, minimum: int, maximum: int = _INT_MAX) -> None:
    """Raises ValueError naming `name` unless `value` is an int (not a bool) in range."""
    accepted = f"accepted: an int from {minimum} to {maximum}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an int >= {minimum}, got {value!r} "
                         f"({type(value).__name__}); {accepted}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{name}: must be an int >= {minimum}, got {value}; {accepted}")


def _setting(default, help: str, **extra):
    """A field of OffloadConfig with its help text (read by the HF and Axolotl arguments)."""
    return dataclasses.field(default=default, metadata={"help": help, **extra})


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """Settings of one offload engine (each field's text: `OffloadConfig.field_help()`).

    The HF arguments (ckpt_offload.hf.OffloadArguments) and the Axolotl config keys
    (ckpt_offload.axolotl) are made from these fields, their defaults and their help.
    """

    keep_last: int = _setting(
        1, "Last N checkpoint groups (layers) whose inputs stay on the device.")
    prefetch_depth: int = _setting(1, "Groups fetched back ahead of need during backward.")
    min_offload_bytes: int = _setting(
        1 << 20, "Saved tensors smaller than this many bytes stay where they are.")
    host_memory_limit: HostMemoryLimit = _setting(
        None, "Cap on host memory for offloaded tensors: bytes, a size such as '24GiB', or a "
              "fraction of RAM such as 0.5. Default: half of RAM (of the cgroup's memory "
              "limit when that is lower), split across the node's local ranks.")
    backend: str = _setting(
        "auto", "'auto' offloads CUDA tensors and leaves others; 'cuda'; 'host' moves CPU "
                "tensors through host memory (so every path runs on CPU-only machines, for "
                "tests).", choices=BACKENDS)
    scope: str = _setting(
        "checkpoint_inputs", "'checkpoint_inputs': only tensors tagged by "
                             "ckpt_offload.checkpoint or mark_checkpoint_inputs (the "
                             "checkpointed layers' inputs); 'all': every saved tensor of at "
                             "least min_offload_bytes.", choices=SCOPES)
    max_inflight_d2h_groups: int = _setting(
        2, "Groups whose device-to-host copies may be in flight at once.")
    offload_head: bool = _setting(
        True, "With scope 'checkpoint_inputs', also offload hidden-state-sized tensors saved "
              "after the checkpointed layers (a language model's final norm input): copied "
              "out once a later large tensor is saved, brought back when backward reaches "
              "that tensor (the LM head's backward), ahead of their own use.")

    memory_budget: MemoryBudget = _setting(
        None, "Device memory a training step may use: 'auto' (what the device lets this "
              "process use, less 5 %), bytes, a size such as '40GiB', or a fraction of the "
              "device such as 0.8. Layers that fit run without checkpointing, the fastest "
              "first; the rest are checkpointed with their inputs offloaded. Unset: every "
              "layer is checkpointed (Hugging Face models only).", native=False)

    def __post_init__(self):
        if not isinstance(self.offload_head, bool):
            raise ValueError(f"offload_head: must be True or False, got {self.offload_head!r}")
        check_int("keep_last", self.keep_last, 0)
        check_int("prefetch_depth", self.prefetch_depth, 0)
        check_int("min_offload_bytes", self.min_offload_bytes, 0, INT64_MAX)
        check_int("max_inflight_d2h_groups", self.max_inflight_d2h_groups, 1)
        if not isinstance(self.backend, str) or self.backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {BACKENDS}, got {self.backend!r}")
        if not isinstance(self.scope, str) or self.scope not in SCOPES:
            raise ValueError(f"scope: must be one of {SCOPES}, got {self.scope!r}")
        parse_host_memory_limit(self.host_memory_limit)
        parse_memory_budget(self.memory_budget)

    @classmethod
    def field_help(cls) -> str:
        """One line per field: name, default and help text."""
        return "\n".join(f"{f.name} (default {f.default!r}): {f.metadata['help']}"
                         for f in dataclasses.fields(cls))

    @classmethod
    def engine_fields(cls) -> tuple:
        """The fields the native engine takes (the others are read in Python)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("native", True))

    def host_memory_limit_bytes(self) -> int:
        return parse_host_memory_limit(self.host_memory_limit)

    def resolved_backend(self) -> Optional[str]:
        """"cuda", "host", or None when "auto" finds no GPU (then nothing is offloaded)."""
        if self.backend != "auto":
            return self.backend
        import torch

        return "cuda" if torch.cuda.is_available() else None

    def replace(self, **overrides) -> "OffloadConfig":
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"unknown OffloadConfig field(s) {unknown}; fields: {sorted(names)}")
        return dataclasses.replace(self, **overrides)


def make_config(config: Optional[OffloadConfig] = None, **overrides) -> OffloadConfig:
    """`config` (or the defaults) with `overrides` applied."""
    if config is not None and not isinstance(config, OffloadConfig):
        raise ValueError(f"config: must be an OffloadConfig or None, got {type(config).__name__}")
    return (config or OffloadConfig()).replace(**overrides)
