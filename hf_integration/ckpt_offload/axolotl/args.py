"""Axolotl config keys of ckpt_offload, merged into axolotl's schema by the plugin.

    plugins:
      - ckpt_offload.axolotl.ActivationOffloadPlugin
    gradient_checkpointing: true
    activation_offloading: true
    ckpt_offload_keep_last: 1            # optional
    ckpt_offload_prefetch_depth: 1       # optional
    ckpt_offload_host_memory_limit: 24GiB  # optional: bytes, "24GiB", or a fraction like 0.5

There is one key per OffloadConfig field, made from that field (name, type, help), so the
two cannot drift apart. Any other `ckpt_offload_*` key (a misspelling) fails validation,
naming the key; unset keys take OffloadConfig's defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Literal, Optional, Union

from pydantic import (BaseModel, Field, ValidationInfo, create_model, field_validator,
                      model_validator)

from ckpt_offload import OffloadConfig

PREFIX = "ckpt_offload_"


def config_key(field_name: str) -> str:
    """The config key of an OffloadConfig field: "ckpt_offload_" and the field's name without
    a leading "offload_" (keep_last -> ckpt_offload_keep_last, offload_head ->
    ckpt_offload_head)."""
    return PREFIX + field_name.removeprefix("offload_")


# Config key -> OffloadConfig field.
CONFIG_FIELDS = {config_key(f.name): f.name for f in dataclasses.fields(OffloadConfig)}

_CONFIG_TYPES = typing.get_type_hints(OffloadConfig)


def _key_type(config_field: dataclasses.Field):
    choices = config_field.metadata.get("choices")
    if choices:
        return Optional[Literal[tuple(choices)]]
    hint = _CONFIG_TYPES[config_field.name]
    if typing.get_origin(hint) is Union:
        return hint  # host_memory_limit: None, bytes, a size string or a fraction
    return Optional[hint]


def _key_field(config_field: dataclasses.Field):
    text = (f"ckpt_offload: {config_field.metadata['help']} "
            f"(default {config_field.default!r}).")
    return Field(default=None, json_schema_extra={"description": text})


class _ActivationOffloadKeys(BaseModel):
    """Checks shared by every ckpt_offload key (the keys themselves: ActivationOffloadArgs)."""

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_ckpt_offload_keys(cls, data):
        # Axolotl's schema drops keys it does not know; a misspelled ckpt_offload_* key would
        # otherwise leave its setting at the default without a word. This model is merged
        # into Axolotl's config model, so `data` is the whole config.
        if not isinstance(data, dict):
            return data
        unknown = sorted(key for key in data
                         if isinstance(key, str) and key.startswith(PREFIX)
                         and key not in CONFIG_FIELDS)
        if unknown:
            raise ValueError("; ".join(_unknown_key_message(key) for key in unknown))
        return data


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


def _unknown_key_message(key: str) -> str:
    close = difflib.get_close_matches(key, list(CONFIG_FIELDS), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    return (f"{key}: not a ckpt_offload setting; {hint}"
            f"the ckpt_offload keys are {', '.join(CONFIG_FIELDS)}")


ActivationOffloadArgs = create_model(
    "ActivationOffloadArgs",
    __base__=_ActivationOffloadKeys,
    __module__=__name__,
    __doc__="ckpt_offload settings; used when `activation_offloading: true` (unset: "
            "OffloadConfig's defaults).",
    __validators__={"_valid_for_ckpt_offload": field_validator(
        *CONFIG_FIELDS, mode="before")(_valid_for_ckpt_offload)},
    **{config_key(f.name): (_key_type(f), _key_field(f))
       for f in dataclasses.fields(OffloadConfig)},
)


def offload_config_from(cfg) -> OffloadConfig:
    """The OffloadConfig that an axolotl config's ckpt_offload_* keys describe."""
    settings = {field: cfg.get(key) for key, field in CONFIG_FIELDS.items()
                if cfg.get(key) is not None}
    return OffloadConfig(**settings)
