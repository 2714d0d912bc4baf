"""OffloadArguments: ckpt_offload settings for HfArgumentParser (command line, YAML, JSON).

    parser = HfArgumentParser((TrainingArguments, OffloadArguments))
    training_args, offload_args = parser.parse_args_into_dataclasses()
    callback = ActivationOffloadCallback.from_args(offload_args)   # None when off
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from ckpt_offload import OffloadConfig
from ckpt_offload.config import parse_host_memory_limit

# OffloadConfig field -> argument name, so that errors name what the user typed.
_ARGUMENT_FOR_FIELD = {
    "keep_last": "offload_keep_last",
    "prefetch_depth": "offload_prefetch_depth",
    "min_offload_bytes": "offload_min_bytes",
    "host_memory_limit": "offload_host_memory_limit",
    "backend": "offload_backend",
    "scope": "offload_scope",
    "max_inflight_d2h_groups": "offload_max_inflight_d2h_groups",
    "offload_head": "offload_head",
}


@dataclass
class OffloadArguments:
    """Activation offload settings; they apply only when activation_offloading is true."""

    activation_offloading: bool = field(default=False, metadata={
        "help": "Offload checkpointed layers' inputs to pinned host memory with ckpt_offload "
                "(turns on non-reentrant gradient checkpointing)."})
    offload_keep_last: int = field(default=1, metadata={
        "help": "Last N checkpointed layers whose inputs stay on the GPU."})
    offload_prefetch_depth: int = field(default=1, metadata={
        "help": "Layers whose inputs are fetched back ahead of need during backward."})
    offload_host_memory_limit: Optional[str] = field(default=None, metadata={
        "help": "Cap on host memory for offloaded activations: bytes, a size such as "
                "'24GiB', or a fraction of RAM such as '0.5'. Default: half of RAM, split "
                "across the node's local ranks."})
    offload_min_bytes: int = field(default=1 << 20, metadata={
        "help": "Saved tensors smaller than this stay where they are."})
    offload_backend: Literal["auto", "cuda", "host"] = field(default="auto", metadata={
        "help": "'auto' offloads CUDA tensors; 'host' moves CPU tensors (for tests)."})
    offload_scope: Literal["checkpoint_inputs", "all"] = field(default="checkpoint_inputs",
                                                               metadata={
        "help": "'checkpoint_inputs' (layer inputs only) or 'all' saved tensors."})
    offload_max_inflight_d2h_groups: int = field(default=2, metadata={
        "help": "Layers whose device-to-host copies may be in flight at once."})
    offload_head: bool = field(default=True, metadata={
        "help": "Also offload hidden-state-sized tensors saved after the checkpointed layers "
                "(the final norm's input), restored during the LM head's backward."})

    def __post_init__(self):
        # Validate at parse time, so a bad value stops the run before the model loads.
        self.offload_host_memory_limit = _normalize_limit(self.offload_host_memory_limit)
        self.to_config()

    def to_config(self) -> OffloadConfig:
        """The OffloadConfig these arguments describe (ValueError names the argument)."""
        try:
            return OffloadConfig(
                keep_last=self.offload_keep_last,
                prefetch_depth=self.offload_prefetch_depth,
                min_offload_bytes=self.offload_min_bytes,
                host_memory_limit=self.offload_host_memory_limit,
                backend=self.offload_backend,
                scope=self.offload_scope,
                max_inflight_d2h_groups=self.offload_max_inflight_d2h_groups,
                offload_head=self.offload_head,
            )
        except ValueError as error:
            raise ValueError(_rename_field(str(error))) from None


def _normalize_limit(value: Union[None, int, float, str]) -> Union[None, int, float, str]:
    """A YAML file gives numbers as numbers, the command line as strings: keep numbers,
    read "0.5" as a fraction and "25769803776" as bytes, and check the rest."""
    if value is None or isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            return int(text)
        try:
            return float(text)
        except ValueError:
            pass
    parse_host_memory_limit(value, field="offload_host_memory_limit")
    return value


def _rename_field(message: str) -> str:
    name, sep, rest = message.partition(":")
    if sep and name in _ARGUMENT_FOR_FIELD:
        return f"{_ARGUMENT_FOR_FIELD[name]}:{rest}"
    return message


OFFLOAD_ARGUMENT_NAMES = tuple(f.name for f in dataclasses.fields(OffloadArguments))
