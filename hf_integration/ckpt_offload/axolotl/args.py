"""Axolotl config keys of ckpt_offload, merged into axolotl's schema by the plugin.

    plugins:
      - ckpt_offload.axolotl.ActivationOffloadPlugin
    gradient_checkpointing: true
    activation_offloading: true
    ckpt_offload_keep_last: 1            # optional
    ckpt_offload_prefetch_depth: 1       # optional
    ckpt_offload_host_memory_limit: 24GiB  # optional: bytes, "24GiB", or a fraction like 0.5
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from ckpt_offload import OffloadConfig

# Config key -> OffloadConfig field.
CONFIG_FIELDS = {
    "ckpt_offload_keep_last": "keep_last",
    "ckpt_offload_prefetch_depth": "prefetch_depth",
    "ckpt_offload_host_memory_limit": "host_memory_limit",
    "ckpt_offload_min_offload_bytes": "min_offload_bytes",
    "ckpt_offload_backend": "backend",
    "ckpt_offload_head": "offload_head",
}


def _described(text: str):
    return Field(default=None, json_schema_extra={"description": text})


class ActivationOffloadArgs(BaseModel):
    """ckpt_offload settings; used when `activation_offloading: true` (unset: defaults)."""

    ckpt_offload_keep_last: Optional[int] = _described(
        "ckpt_offload: last N checkpointed layers whose inputs stay on the GPU (default 1).")
    ckpt_offload_prefetch_depth: Optional[int] = _described(
        "ckpt_offload: layers fetched back ahead of need during backward (default 1).")
    ckpt_offload_host_memory_limit: Optional[Union[int, float, str]] = _described(
        "ckpt_offload: cap on host memory for offloaded activations: bytes, a size such as "
        "'24GiB', or a fraction of RAM such as 0.5 (default: half of RAM split across the "
        "node's local ranks).")
    ckpt_offload_min_offload_bytes: Optional[int] = _described(
        "ckpt_offload: saved tensors smaller than this stay where they are (default 1 MiB).")
    ckpt_offload_backend: Optional[Literal["auto", "cuda", "host"]] = _described(
        "ckpt_offload: 'auto' offloads CUDA tensors; 'host' moves CPU tensors (for tests).")
    ckpt_offload_head: Optional[bool] = _described(
        "ckpt_offload: also offload hidden-state-sized tensors saved after the checkpointed "
        "layers (the final norm's input), restored during the LM head's backward "
        "(default true).")

    @field_validator(*CONFIG_FIELDS, mode="before")
    @classmethod
    def _valid_for_ckpt_offload(cls, value, info: ValidationInfo):
        # OffloadConfig's own checks, so the rules are the same everywhere; the message is
        # reworded to name the config key.
        if value is None:
            return value
        try:
            OffloadConfig(**{CONFIG_FIELDS[info.field_name]: value})
        except ValueError as error:
            reason = str(error).partition(": ")[2] or str(error)
            raise ValueError(f"{info.field_name}: {reason}") from None
        return value


def offload_config_from(cfg) -> OffloadConfig:
    """The OffloadConfig that an axolotl config's ckpt_offload_* keys describe."""
    settings = {field: cfg.get(key) for key, field in CONFIG_FIELDS.items()
                if cfg.get(key) is not None}
    return OffloadConfig(**settings)
