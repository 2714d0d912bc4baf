"""The offload planner from Python: what offloading a model's activations saves and costs.

    python -m ckpt_offload.plan --config path/to/config.json --seq 32768 --batch 1 \\
        --gpus_per_node 8 --host_ram 2TiB [--json]
    python -m ckpt_offload.plan --preset llama-70b --seq 131072
    python -m ckpt_offload.plan --preset llama-8b --seq 8192 --memory_budget 80GiB \
        --step_peak_gib 27.5 [--layer_gib 2.25 --layer_ms 12.1 --step_ms 1351]

Takes offload_plan's flags (`--help` lists them) plus `--config`: a local Hugging Face
config.json, or a directory holding one, whose shape (layers, hidden, ffn, heads, kv_heads)
and dtype fill in the flags not given. Everything else is the C++ planner's
(ckpt_offload._plan, offload_core/planner.h): the same flag checks, figures and output as
`bazel run //offload_core:offload_plan`. Nothing is read from the network.

With --memory_budget, a section follows: how many layers a step of that length runs without
checkpointing, how many keep op outputs for their recompute, and how many offload op
outputs with their inputs (within the copy window the planner's D2H rate gives each
layer's forward), under the budget (ckpt_offload.budget's policy, as memory_budget plans
it at run time), its predicted peak and step time. Figures that stats() and the Trainer
log report after a run (budget measured, per layer) make it exact; without them a layer's
saved bytes are estimated from the shape, its recompute is the planner's forward time, and
the outputs it could keep are its projections and attention, each worth its share of the
layer's matrix-multiply FLOPs.

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
  --memory_budget=SIZE      plan a memory budget: a size (80GiB), a fraction of
                            --device_gib (0.9), or auto (95 % of --device_gib)
  --device_gib=N            the device's memory, for auto and fractions
  --step_peak_gib=N         the step's peak with every layer checkpointed (weights
                            included): required with --memory_budget
  --stranded_gib=N          the allocator's free pieces stranded as that step's head
                            began (the Trainer log's measurement line; default 0): the
                            plan holds reserved memory to the budget, and they are part
                            of it
  --head_peak_gib=N, --layer_phase_peak_gib=N
                            the same step's peak in its forward and head, and in its
                            layers' backward (the Trainer log's measurement line; default:
                            the step's peak for both): what the plan keeps counts where it
                            is live (a fused loss's step peaks in the layers' backward)
  --forward_peak_gib=N      the same step's peak in its forward alone (same line); with
                            it, --head_peak_gib is its head's alone (both are required):
                            the predicted allocations count a resident layer's forward
                            as its backward
  --head_rise_gib=N         what that step's head allocated above its start (same line;
                            default: unknown): bounds the allocator's margin
  --layer_gib=N             one layer's saved tensors (default: estimated from the shape)
  --layer_ms=N              one layer's recompute (default: the planner's forward time)
  --step_ms=N               the checkpointed step's time (default: the simulated step)
  --kept_gib=N, --kept_ms=N one layer's kept outputs and the recompute they save, as one
                            set (default: per projection and attention, from the shape;
                            0 and 0: layers keep nothing, as compiled layers)
"""

# The flags python -m ckpt_offload.plan reads for a memory budget (the others go to the planner).
BUDGET_FLAGS = ("memory_budget", "device_gib", "step_peak_gib", "stranded_gib",
                "head_peak_gib", "layer_phase_peak_gib", "forward_peak_gib", "head_rise_gib",
                "layer_gib", "layer_ms", "step_ms", "kept_gib", "kept_ms")

# A decoder layer's saved bytes per token in bf16 (twice that in fp32): 44 x hidden + 8 x ffn.
# Calibrated on the Llama-3.1-8B shape measured by memory_budget on the H200 (LoRA r=16,
# sdpa, bf16: 2.25 GiB per layer at 8192 tokens); other shapes are an estimate.
SAVED_HIDDEN_FACTOR, SAVED_FFN_FACTOR = 44, 8
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
GIB = float(1 << 30)


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


def _split_budget_flags(args: List[str]) -> tuple[Dict[str, str], List[str]]:
    """(the budget flags given, by name with "-" read as "_", the other arguments)."""
    budget, rest, i = {}, [], 0
    while i < len(args):
        name = _flag_name(args[i]).replace("-", "_")
        if name in BUDGET_FLAGS:
            if "=" in args[i]:
                value = args[i].split("=", 1)[1]
            elif i + 1 < len(args):
                i += 1
                value = args[i]
            else:
                raise ConfigError(f"--{name} needs a value")
            budget[name] = value
        else:
            rest.append(args[i])
        i += 1
    return budget, rest


def _positive(flags: Dict[str, str], name: str, zero: bool = False) -> Optional[float]:
    """The flag's number (None when not given); `zero`: 0 is allowed too."""
    if name not in flags:
        return None
    try:
        value = float(flags[name])
    except ValueError:
        value = -1.0
    if not (value >= 0 if zero else value > 0):
        kind = "a number >= 0" if zero else "a positive number"
        raise ConfigError(f"--{name}: must be {kind}, got {flags[name]!r}")
    return value


def shape_outputs(plan: Dict, layer_s: float):
    """The outputs a decoder layer of the planner's shape could keep, per token: its seven
    projections and its (causal) attention, each output's bytes at the model's dtype, and
    each worth `layer_s` (the layer's recompute) in proportion to its FLOPs."""
    from ckpt_offload.budget import KeptOutput

    hidden, ffn = plan["hidden"], plan["ffn"]
    kv = hidden * plan["kv_heads"] // plan["heads"]
    element = DTYPE_BYTES[plan["dtype"]]
    context = plan["tokens"] // plan["batch"]
    # (name, output elements per token, FLOPs per token)
    ops = [("q", hidden, 2 * hidden * hidden), ("k", kv, 2 * hidden * kv),
           ("v", kv, 2 * hidden * kv), ("attention", hidden, 2 * context * hidden),
           ("o", hidden, 2 * hidden * hidden), ("gate", ffn, 2 * hidden * ffn),
           ("up", ffn, 2 * hidden * ffn), ("down", hidden, 2 * ffn * hidden)]
    total = sum(flops for _, _, flops in ops)
    seconds = layer_s / plan["tokens"]
    return tuple(KeptOutput((name, 0), size * element, seconds * flops / total)
                 for name, size, flops in ops)


def budget_section(flags: Dict[str, str], plan: Dict) -> Dict:
    """The memory-budget figures for the planner's JSON `plan` and the budget flags."""
    import dataclasses

    from ckpt_offload.budget import (RESIDENT, SELECTIVE, KeptOutput, OutputOffload,
                                     plan_layers, uniform_measurement)
    from ckpt_offload.config import OffloadConfig, parse_memory_budget

    device_gib = _positive(flags, "device_gib")
    step_peak_gib = _positive(flags, "step_peak_gib")
    if "memory_budget" not in flags:
        raise ConfigError("--memory_budget: needed with --" + next(iter(flags)))
    if step_peak_gib is None:
        raise ConfigError("--step_peak_gib: required with --memory_budget (the step's peak "
                          "with every layer checkpointed: stats()' peak, or the Trainer log)")
    value = flags["memory_budget"]
    try:
        number = float(value)
    except ValueError:
        number = None
    if number is not None and "." in value:
        value = number
    elif number is not None:
        value = int(number)
    device = int(device_gib * GIB) if device_gib else None
    budget = parse_memory_budget(value, device, field="--memory_budget")
    if budget is None:
        raise ConfigError(f"--device_gib: needed for --memory_budget={flags['memory_budget']}")
    tokens = plan["tokens"]
    layer_gib = _positive(flags, "layer_gib")
    estimated = layer_gib is None
    if estimated:
        element = DTYPE_BYTES[plan["dtype"]] / 2
        per_token = SAVED_HIDDEN_FACTOR * plan["hidden"] + SAVED_FFN_FACTOR * plan["ffn"]
        layer_gib = per_token * element * tokens / GIB
    layer_ms = _positive(flags, "layer_ms") or plan["forward_s_per_layer"] * 1e3
    step_ms = _positive(flags, "step_ms") or plan["simulated_step_s"] * 1e3
    kept_gib, kept_ms = _positive(flags, "kept_gib", True), _positive(flags, "kept_ms", True)
    if (kept_gib is None) != (kept_ms is None):
        raise ConfigError("--kept_gib and --kept_ms: give both (one layer's kept outputs and "
                          "the recompute they save) or neither")
    if kept_gib is None:
        outputs = shape_outputs(plan, layer_ms / 1e3)
    elif kept_ms == 0:
        outputs = ()  # layers that keep nothing (compiled, or a context_fn of the user's)
    else:
        outputs = (KeptOutput(("kept", 0), kept_gib * GIB / tokens, kept_ms / 1e3 / tokens),)
    stranded_gib = _positive(flags, "stranded_gib", True) or 0.0
    phases = {name: _positive(flags, name)
              for name in ("head_peak_gib", "layer_phase_peak_gib", "forward_peak_gib")}
    for name, gib in phases.items():
        if gib is not None and gib > step_peak_gib:
            raise ConfigError(f"--{name}: at most --step_peak_gib ({step_peak_gib:g}; the "
                              f"step's peak is its higher phase's), got {flags[name]!r}")
    head_rise_gib = _positive(flags, "head_rise_gib") or 0.0
    apart = phases["forward_peak_gib"] is not None
    if apart and phases["head_peak_gib"] is None:
        raise ConfigError("--forward_peak_gib: needs --head_peak_gib (the head's peak alone)")
    head_phase_gib = max(phases["head_peak_gib"] or 0, phases["forward_peak_gib"] or 0)
    measured = uniform_measurement(
        plan["layers"], tokens, layer_gib * GIB / tokens, layer_ms / 1e3 / tokens,
        peak_bytes=int(step_peak_gib * GIB), activation_peak_bytes=0, outputs=outputs,
        step_seconds=step_ms / 1e3)
    # The layer's input is what the engine offloads of it (the planner's bytes per layer);
    # its saved storages, for a resident layer's offloads, are estimated as its projections'
    # and attention's outputs, then the rest in one piece (run time measures them).
    pieces = [o.bytes_per_token for o in shape_outputs(plan, layer_ms / 1e3)]
    whole = layer_gib * GIB / tokens
    pieces = pieces if sum(pieces) < whole else []
    layer = dataclasses.replace(measured.layers[0],
                                input_bytes_per_token=plan["bytes_per_layer"] / tokens,
                                storages=tuple(pieces) + (whole - sum(pieces),))
    measured = dataclasses.replace(
        measured, layers=(layer,) * plan["layers"], stranded_bytes=int(stranded_gib * GIB),
        head_phase_peak_bytes=int(head_phase_gib * GIB),
        layer_phase_peak_bytes=int((phases["layer_phase_peak_gib"] or 0) * GIB),
        head_rise_bytes=int(head_rise_gib * GIB),
        forward_peak_bytes=int((phases["forward_peak_gib"] or 0) * GIB),
        head_peak_bytes=int((phases["head_peak_gib"] or 0) * GIB) if apart else 0)
    offload = OutputOffload.for_engine(
        plan["d2h_gbps"] * 1e9, plan["keep_last"], plan["prefetch_depth"],
        plan["max_inflight_d2h_groups"], OffloadConfig().min_offload_bytes,
        plan["host_limit_per_gpu"] or None)
    layer_plan = plan_layers(measured, tokens, budget, 0, offload)
    resident, selective = layer_plan.count(RESIDENT), layer_plan.count(SELECTIVE)
    return {
        "budget_bytes": budget, "layer_bytes": int(layer_gib * GIB),
        "layer_bytes_estimated": estimated, "recompute_ms_per_layer": layer_ms,
        "kept_outputs_estimated": kept_gib is None,
        "resident_layers": resident, "selective_layers": selective,
        "checkpointed_layers": len(layer_plan.modes) - resident - selective,
        "kept_output_bytes": layer_plan.kept_output_bytes,
        "offloading_layers": layer_plan.offloading_layers,
        "offloaded_output_bytes": layer_plan.offloaded_output_bytes,
        "resident_offloaded_bytes": layer_plan.resident_offloaded_bytes,
        "host_limited_bytes": layer_plan.host_limited_bytes,
        "predicted_peak_bytes": layer_plan.predicted_peak_bytes,
        "predicted_allocated_bytes": layer_plan.predicted_allocated_bytes,
        "checkpointed_peak_bytes": layer_plan.checkpointed_peak_bytes,
        "checkpointed_step_ms": step_ms,
        "predicted_step_ms": layer_plan.predicted_step_seconds * 1e3,
        "fits": layer_plan.fits,
    }


def budget_text(section: Dict) -> str:
    layer = section["layer_bytes"] / GIB
    source = ("estimated from the shape" if section["layer_bytes_estimated"]
              else "given")
    held_back = (f"; {section['host_limited_bytes'] / GIB:.2f} GiB more fit the windows but "
                 f"not the host limit" if section["host_limited_bytes"] else "")
    lines = [
        "",
        f"memory budget {section['budget_bytes'] / GIB:.2f} GiB",
        f"  a layer's saved tensors       {layer:.2f} GiB ({source})",
        f"  recompute per layer           {section['recompute_ms_per_layer']:.2f} ms",
        f"  kept outputs                  "
        f"{'per op, from the shape' if section['kept_outputs_estimated'] else 'given'}",
        f"  plan                          {section['resident_layers']} layers without "
        f"checkpointing, {section['selective_layers']} keeping "
        f"{section['kept_output_bytes'] / GIB:.2f} GiB of op outputs, "
        f"{section['checkpointed_layers']} checkpointed",
        f"  offloaded outputs             {section['offloading_layers']} layers offload "
        f"{section['offloaded_output_bytes'] / GIB:.2f} GiB of op outputs with their inputs "
        f"(within each layer's copy window{held_back})",
    ]
    if section["resident_offloaded_bytes"]:  # resident layers' storage offloads (off by default)
        lines.append(f"  resident layers' offloads     "
                     f"{section['resident_offloaded_bytes'] / GIB:.2f} GiB of their saved "
                     f"tensors")
    lines += [
        f"  predicted peak                {section['predicted_peak_bytes'] / GIB:.2f} GiB "
        f"reserved, {section['predicted_allocated_bytes'] / GIB:.2f} GiB allocated "
        f"(checkpointed step {section['checkpointed_peak_bytes'] / GIB:.2f} GiB)",
        f"  predicted step                {section['predicted_step_ms']:.1f} ms "
        f"(checkpointed {section['checkpointed_step_ms']:.1f} ms, "
        f"{section['predicted_step_ms'] / section['checkpointed_step_ms']:.3f}x)",
    ]
    if not section["fits"]:
        lines.append("  the checkpointed step alone is over the budget: every layer stays "
                     "checkpointed")
    return "\n".join(lines) + "\n"


def run(args: List[str]) -> str:
    """The planner's output for `args`; ValueError (naming the flag) for a bad one."""
    from ckpt_offload import _plan

    budget_flags, args = _split_budget_flags(args)
    if any(a in ("-h", "--help") or a.startswith("--help=") for a in args):
        return _plan.run(planner_args(args)) + CONFIG_USAGE
    if not budget_flags:
        return _plan.run(planner_args(args))
    as_json = "--json" in args or any(a.startswith("--json=") for a in args)
    base = [a for a in planner_args(args) if a != "--json" and not a.startswith("--json=")]
    plan = json.loads(_plan.run(base + ["--json"]))
    section = budget_section(budget_flags, plan)
    if as_json:
        return json.dumps({**plan, "memory_budget": section}) + "\n"
    return _plan.run(base) + budget_text(section)


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
