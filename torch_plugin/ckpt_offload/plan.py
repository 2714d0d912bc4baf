"""The offload planner from Python: what offloading a model's activations saves and costs.

    python -m ckpt_offload.plan --config path/to/config.json --seq 32768 --batch 1 \\
        --gpus_per_node 8 --host_ram 2TiB [--json]
    python -m ckpt_offload.plan --preset llama-70b --seq 131072

Takes offload_plan's flags (`--help` lists them) plus `--config`: a local Hugging Face
config.json, or a directory holding one, whose shape (layers, hidden, ffn, heads, kv_heads)
and dtype fill in the flags not given. Everything else is the C++ planner's
(ckpt_offload._plan, offload_core/planner.h): the same flag checks, figures and output as
`bazel run //offload_core:offload_plan`. Nothing is read from the network.

Exit status: 0, 2 for a bad flag or config (the message names it), 1 when planning failed.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Dict, List, Optional

# The planner flag each config.json key fills, in the order the keys are looked up.
CONFIG_KEYS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "ffn": ("intermediate_size", "n_inner", "ffn_dim"),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads"),
}
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

CONFIG_USAGE = """
Also (python -m ckpt_offload.plan only):
  --config=PATH             a Hugging Face config.json (or its directory): fills the
                            shape flags and --dtype that are not given, and --name
"""


class ConfigError(ValueError):
    """A config.json that cannot describe the model; the message names the file and key."""


def _flag_name(arg: str) -> str:
    return arg[2:].split("=", 1)[0] if arg.startswith("--") else ""


def _split_config_flag(args: List[str]) -> tuple[Optional[str], List[str]]:
    """(the --config value or None, the other arguments)."""
    config, rest, i = None, [], 0
    while i < len(args):
        arg = args[i]
        if arg == "--config" or arg.startswith("--config="):
            if "=" in arg:
                config = arg.split("=", 1)[1]
            elif i + 1 < len(args):
                i += 1
                config = args[i]
            else:
                raise ConfigError("--config needs a value")
            if not config:
                raise ConfigError("--config must name a config.json or its directory")
        else:
            rest.append(arg)
        i += 1
    return config, rest


def config_flags(path: str) -> Dict[str, str]:
    """Planner flags for the model a Hugging Face config.json describes. Multimodal configs
    are read through their text_config."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as error:
        raise ConfigError(f"--config: cannot read {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"--config: {path} is not JSON: {error}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"--config: {path} holds no JSON object")
    if "text_config" in config and not any(k in config for k in CONFIG_KEYS["layers"]):
        config = config["text_config"]
    flags = {}
    for flag, keys in CONFIG_KEYS.items():
        key = next((k for k in keys if config.get(k) is not None), None)
        if key is None:
            if flag == "kv_heads" and "heads" in flags:  # no GQA: one KV head per head
                flags[flag] = flags["heads"]
                continue
            if flag == "ffn" and "n_inner" in config:  # GPT-2: n_inner null = 4 x hidden
                flags[flag] = str(4 * int(flags["hidden"]))
                continue
            raise ConfigError(f"--config: {path} has none of {', '.join(keys)} "
                              f"(needed for --{flag})")
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"--config: {path}: {key} must be a positive integer, "
                              f"got {value!r}")
        flags[flag] = str(value)
    dtype = DTYPES.get(str(config.get("torch_dtype") or config.get("dtype") or ""))
    if dtype:
        flags["dtype"] = dtype
    name = config.get("_name_or_path") or os.path.basename(os.path.dirname(
        os.path.abspath(path))) or config.get("model_type")
    if name:
        flags["name"] = str(name)
    return flags


def planner_args(args: List[str]) -> List[str]:
    """offload_plan's flags for `args`: --config expanded into the flags not given."""
    config, rest = _split_config_flag(args)
    if config is None:
        return rest
    given = {_flag_name(a) for a in rest}
    return [f"--{flag}={value}" for flag, value in config_flags(config).items()
            if flag not in given] + rest


def run(args: List[str]) -> str:
    """The planner's output for `args`; ValueError (naming the flag) for a bad one."""
    from ckpt_offload import _plan

    text = _plan.run(planner_args(args))
    if any(a in ("-h", "--help") or a.startswith("--help=") for a in args):
        text += CONFIG_USAGE
    return text


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        text = run(args)
    except ValueError as error:
        print(f"ckpt_offload.plan: {error}\n(--help lists the flags)", file=sys.stderr)
        return 2
    except RuntimeError as error:
        print(f"ckpt_offload.plan: {error}", file=sys.stderr)
        return 1
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
