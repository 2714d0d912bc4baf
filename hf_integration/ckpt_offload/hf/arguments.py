"""OffloadArguments: ckpt_offload settings for HfArgumentParser (command line, YAML, JSON).

    parser = HfArgumentParser((TrainingArguments, OffloadArguments))
    training_args, offload_args = parser.parse_args_into_dataclasses()
    callback = ActivationOffloadCallback.from_args(offload_args)   # None when off

Besides `activation_offloading`, there is one argument per OffloadConfig field, made from
that field (name, type, default and help), so that the two cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from ckpt_offload import OffloadConfig


def argument_name(field_name: str) -> str:
    """The argument of an OffloadConfig field: "offload_" and the field's name without its
    own "offload_" (keep_last -> offload_keep_last, min_offload_bytes -> offload_min_bytes,
    offload_head -> offload_head)."""
    return "offload_" + field_name.replace("offload_", "")


# OffloadConfig field -> argument name, so that errors name what the user typed.
ARGUMENT_FOR_FIELD = {f.name: argument_name(f.name) for f in dataclasses.fields(OffloadConfig)}

_CONFIG_TYPES = typing.get_type_hints(OffloadConfig)

# Fields that accept several types (host_memory_limit: bytes, a size or a fraction) arrive
# as text from the command line and are read by _normalize_text.
_TEXT_FIELDS = tuple(name for name, hint in _CONFIG_TYPES.items()
                     if typing.get_origin(hint) is Union)


def _argument_type(config_field: dataclasses.Field):
    choices = config_field.metadata.get("choices")
    if choices:
        return Literal[tuple(choices)]  # the parser offers and checks the choices
    if config_field.name in _TEXT_FIELDS:
        return Optional[str]
    return _CONFIG_TYPES[config_field.name]


@dataclass
class _OffloadSwitch:
    activation_offloading: bool = field(default=False, metadata={
        "help": "Offload checkpointed layers' inputs to pinned host memory with ckpt_offload "
                "(turns on non-reentrant gradient checkpointing)."})

    def __post_init__(self):
        # Validate at parse time, so a bad value stops the run before the model loads.
        for name in _TEXT_FIELDS:
            argument = ARGUMENT_FOR_FIELD[name]
            setattr(self, argument, _normalize_text(getattr(self, argument), argument))
        self.to_config()

    def to_config(self) -> OffloadConfig:
        """The OffloadConfig these arguments describe (ValueError names the argument)."""
        try:
            return OffloadConfig(**{name: getattr(self, argument)
                                    for name, argument in ARGUMENT_FOR_FIELD.items()})
        except ValueError as error:
            raise ValueError(_rename_field(str(error))) from None


OffloadArguments = dataclasses.make_dataclass(
    "OffloadArguments",
    [(ARGUMENT_FOR_FIELD[f.name], _argument_type(f),
      field(default=f.default, metadata={"help": f.metadata["help"]}))
     for f in dataclasses.fields(OffloadConfig)],
    bases=(_OffloadSwitch,),
    namespace={
        "__module__": __name__,
        "__doc__": "Activation offload settings; they apply only when activation_offloading "
                   "is true. One argument per OffloadConfig field (see ARGUMENT_FOR_FIELD).",
    })


def _normalize_text(value: Union[None, int, float, str], argument: str):
    """A YAML file gives numbers as numbers, the command line as strings: keep numbers,
    read "0.5" as a fraction and "25769803776" as bytes, and leave the rest as text."""
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
    return value  # a size or a word: checked by OffloadConfig (to_config names the argument)


def _rename_field(message: str) -> str:
    name, sep, rest = message.partition(":")
    if sep and name in ARGUMENT_FOR_FIELD:
        return f"{ARGUMENT_FOR_FIELD[name]}:{rest}"
    return message


OFFLOAD_ARGUMENT_NAMES = tuple(f.name for f in dataclasses.fields(OffloadArguments))
