"""ckpt_offload.axolotl.ActivationOffloadPlugin with the real axolotl (0.21.0, CPU, offline).

Runs in the environment `pip install axolotl==0.21.0` makes by itself (scripts/pip_venv.sh),
with ckpt_offload built there by pip, through tests/venv_pytest.sh: plugin loading through
axolotl's PluginManager, the config keys it adds to axolotl's schema and their validation,
how each activation_offloading mode is handled, and `axolotl train` end to end on a tiny
local model and dataset.
"""

import ast
import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

# Before axolotl is imported: config loading (load_cfg) would otherwise send telemetry.
os.environ["AXOLOTL_DO_NOT_TRACK"] = "1"
os.environ["DO_NOT_TRACK"] = "1"

from axolotl.integrations.base import PluginManager
from axolotl.utils.config import prepare_plugins, validate_config
from axolotl.utils.dict import DictDefault

from ckpt_offload import OffloadConfig
from ckpt_offload.axolotl import ActivationOffloadArgs, ActivationOffloadPlugin
from ckpt_offload.axolotl.args import CONFIG_FIELDS

PLUGIN = "ckpt_offload.axolotl.ActivationOffloadPlugin"
LAYERS = 4


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny random Llama with a character-level tokenizer, and a jsonl dataset."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("assets")
    model_dir = root / "tiny-llama"
    words = ["<unk>", "<s>", "</s>", "<pad>"] + [chr(c) for c in range(32, 127)]
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)},
                                           unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>", pad_token="<pad>").save_pretrained(model_dir)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=3)).save_pretrained(model_dir)
    data = root / "data.jsonl"
    data.write_text("".join(
        json.dumps({"text": f"sample {i}: the quick brown fox jumps over the lazy dog {7 * i}"})
        + "\n" for i in range(32)))
    return model_dir, data


def axolotl_config(assets, out_dir, **extra):
    model_dir, data = assets
    config = {
        "base_model": str(model_dir),
        "tokenizer_type": "PreTrainedTokenizerFast",
        "plugins": [PLUGIN],
        "datasets": [{"path": str(data), "ds_type": "json", "type": "completion"}],
        "sequence_len": 64,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "max_steps": 4,
        "learning_rate": 0.001,
        "optimizer": "adamw_torch",
        "lr_scheduler": "constant",
        "output_dir": str(out_dir),
        "dataset_prepared_path": str(out_dir / "prepared"),
        "val_set_size": 0,
        "logging_steps": 1,
        "save_strategy": "no",
        "gradient_checkpointing": True,
        "seed": 0,
        "bf16": False,
        "fp16": False,
        "tf32": False,
        "dataloader_num_workers": 0,
    }
    config.update(extra)
    return config


# Plugin loading, schema and validation.


def test_plugin_loads_through_plugin_manager():
    manager = PluginManager.get_instance()
    manager.register(PLUGIN, required=True)
    assert isinstance(manager.plugins[PLUGIN], ActivationOffloadPlugin)
    assert "ckpt_offload.axolotl.args.ActivationOffloadArgs" in manager.get_input_args()


def validated(assets, tmp_path, **extra):
    cfg = DictDefault(axolotl_config(assets, tmp_path, **extra))
    prepare_plugins(cfg)
    return validate_config(cfg)


def test_schema_accepts_the_plugin_keys(assets, tmp_path):
    cfg = validated(assets, tmp_path, activation_offloading=True, ckpt_offload_keep_last=2,
                    ckpt_offload_prefetch_depth=0, ckpt_offload_host_memory_limit="24GiB",
                    ckpt_offload_backend="host", ckpt_offload_min_offload_bytes=0)
    assert cfg.ckpt_offload_keep_last == 2
    assert cfg.ckpt_offload_host_memory_limit == "24GiB"
    cfg = validated(assets, tmp_path, activation_offloading=True,
                    ckpt_offload_host_memory_limit=0.5)
    assert cfg.ckpt_offload_host_memory_limit == 0.5


@pytest.mark.parametrize("key, value", [
    ("ckpt_offload_keep_last", -1),
    ("ckpt_offload_keep_last", "two"),
    ("ckpt_offload_keep_last", True),
    ("ckpt_offload_prefetch_depth", -3),
    ("ckpt_offload_host_memory_limit", "24 parsecs"),
    ("ckpt_offload_host_memory_limit", 1.5),
    ("ckpt_offload_min_offload_bytes", -1),
    ("ckpt_offload_backend", "tpu"),
    ("ckpt_offload_head", "sometimes"),
    ("ckpt_offload_memory_budget", "most of it"),
    ("ckpt_offload_memory_budget", 1.5),
])
def test_schema_rejects_bad_values_naming_the_key(assets, tmp_path, key, value):
    with pytest.raises(ValueError, match=key):
        validated(assets, tmp_path, activation_offloading=True, **{key: value})


def test_args_model_on_its_own():
    args = ActivationOffloadArgs(ckpt_offload_keep_last=0, ckpt_offload_host_memory_limit=1 << 30)
    assert args.ckpt_offload_keep_last == 0
    with pytest.raises(ValueError, match="ckpt_offload_prefetch_depth"):
        ActivationOffloadArgs(ckpt_offload_prefetch_depth=-1)


# Every OffloadConfig field is a key; any other ckpt_offload_* key is an error.

# A valid value other than the default for every OffloadConfig field.
NON_DEFAULT = dict(keep_last=3, prefetch_depth=2, min_offload_bytes=7, host_memory_limit="3GiB",
                   backend="host", scope="all", max_inflight_d2h_groups=4, offload_head=False,
                   memory_budget="auto")

# The documented keys (README.md, hf_integration/README.md).
DOCUMENTED_KEYS = {
    "ckpt_offload_keep_last": "keep_last", "ckpt_offload_prefetch_depth": "prefetch_depth",
    "ckpt_offload_min_offload_bytes": "min_offload_bytes",
    "ckpt_offload_host_memory_limit": "host_memory_limit",
    "ckpt_offload_backend": "backend", "ckpt_offload_scope": "scope",
    "ckpt_offload_max_inflight_d2h_groups": "max_inflight_d2h_groups",
    "ckpt_offload_head": "offload_head",
    "ckpt_offload_memory_budget": "memory_budget",
}


def loaded(assets, tmp_path, **extra):
    """The config as `axolotl train config.yml` loads it (axolotl.cli.config.load_cfg:
    YAML, plugin registration, schema validation, normalization)."""
    from axolotl.cli.config import load_cfg

    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump(axolotl_config(assets, tmp_path / "out", **extra)))
    return load_cfg(str(path))


def test_every_config_field_is_a_documented_key_with_its_help():
    fields = dataclasses.fields(OffloadConfig)
    # A new OffloadConfig field fails here until it has a documented key and a test value.
    assert {f.name for f in fields} == set(NON_DEFAULT) == set(DOCUMENTED_KEYS.values())
    assert CONFIG_FIELDS == DOCUMENTED_KEYS
    schema = ActivationOffloadArgs.model_fields
    assert list(schema) == list(CONFIG_FIELDS)
    for key, name in CONFIG_FIELDS.items():
        config_field = next(f for f in fields if f.name == name)
        assert config_field.metadata["help"] in schema[key].json_schema_extra["description"]
        assert schema[key].default is None  # unset: OffloadConfig's default


def test_every_config_field_set_from_yaml(assets, tmp_path):
    keys = {key: NON_DEFAULT[name] for key, name in CONFIG_FIELDS.items()}
    cfg = loaded(assets, tmp_path, activation_offloading=True, **keys)
    plugin = ActivationOffloadPlugin()
    plugin.pre_model_load(cfg)
    assert plugin.offload_config == OffloadConfig(**NON_DEFAULT)


def test_scope_and_inflight_groups_from_yaml(assets, tmp_path):
    cfg = loaded(assets, tmp_path, activation_offloading=True, ckpt_offload_scope="all",
                 ckpt_offload_max_inflight_d2h_groups=3)
    plugin = ActivationOffloadPlugin()
    plugin.pre_model_load(cfg)
    assert plugin.offload_config == OffloadConfig(scope="all", max_inflight_d2h_groups=3)
    with pytest.raises(ValueError, match="ckpt_offload_scope: must be one of"):
        loaded(assets, tmp_path, activation_offloading=True, ckpt_offload_scope="layers")
    with pytest.raises(ValueError, match="ckpt_offload_max_inflight_d2h_groups: must be an int"):
        loaded(assets, tmp_path, activation_offloading=True,
               ckpt_offload_max_inflight_d2h_groups=0)


@pytest.mark.parametrize("key, suggestion", [
    ("ckpt_offload_keep_lats", "ckpt_offload_keep_last"),
    ("ckpt_offload_offload_head", "ckpt_offload_head"),
    ("ckpt_offload_min_bytes", "ckpt_offload_min_offload_bytes"),
    ("ckpt_offload_inflight", None),
])
def test_unknown_key_is_rejected_by_name(assets, tmp_path, key, suggestion):
    with pytest.raises(ValueError) as caught:
        loaded(assets, tmp_path, activation_offloading=True, **{key: 1})
    message = str(caught.value)
    assert f"{key}: not a ckpt_offload setting" in message
    if suggestion:
        assert f"did you mean {suggestion}?" in message
    assert "ckpt_offload_max_inflight_d2h_groups" in message  # the keys are listed
    # Also when offloading is off: a misspelled key is a mistake either way.
    with pytest.raises(ValueError, match=key):
        validated(assets, tmp_path, **{key: 1})


# What each activation_offloading mode does.


def test_true_is_taken_over_with_the_configured_settings(assets, tmp_path, caplog):
    cfg = validated(assets, tmp_path, activation_offloading=True, ckpt_offload_keep_last=2,
                    ckpt_offload_host_memory_limit="1GiB")
    plugin = ActivationOffloadPlugin()
    with caplog.at_level(logging.INFO, logger="axolotl.integrations.ckpt_offload"):
        plugin.pre_model_load(cfg)
    assert cfg.activation_offloading is False  # Axolotl's own offloading stays off
    assert plugin.offload_config == OffloadConfig(keep_last=2, host_memory_limit="1GiB")
    assert "done by ckpt_offload" in caplog.text


@pytest.mark.parametrize("mode", ["legacy", "disk", "hidden_states"])
def test_axolotl_modes_are_left_alone(assets, tmp_path, caplog, mode):
    cfg = validated(assets, tmp_path, activation_offloading=mode)
    plugin = ActivationOffloadPlugin()
    with caplog.at_level(logging.INFO, logger="axolotl.integrations.ckpt_offload"):
        plugin.pre_model_load(cfg)
    assert cfg.activation_offloading == mode
    assert plugin.offload_config is None
    assert "left to Axolotl" in caplog.text

    class Trainer:  # post_trainer_create must not touch a trainer it does not own
        pass

    plugin.post_trainer_create(cfg, Trainer())
    assert plugin.callback is None


@pytest.mark.parametrize("mode", [False, None])
def test_off_does_nothing(assets, tmp_path, mode):
    extra = {} if mode is None else {"activation_offloading": mode}
    cfg = validated(assets, tmp_path, **extra)
    before = dict(cfg)
    plugin = ActivationOffloadPlugin()
    plugin.pre_model_load(cfg)
    assert dict(cfg) == before
    assert plugin.offload_config is None


# `axolotl train` end to end.


def axolotl_train(assets, tmp_path, name, env_extra=None, **extra):
    """Runs `axolotl train config.yml` (its default accelerate launcher); returns the printed
    step logs and the trained weights. `env_extra`: more environment for the run."""
    run_dir = tmp_path / name
    run_dir.mkdir()
    config = run_dir / "config.yml"
    config.write_text(yaml.safe_dump(axolotl_config(assets, run_dir / "out", **extra)))
    caches = run_dir / "caches"
    env = dict(os.environ,
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               HF_HOME=str(caches / "hf"), XDG_CACHE_HOME=str(caches),
               TRITON_CACHE_DIR=str(caches / "triton"), WANDB_MODE="disabled",
               WANDB_DIR=str(caches), AXOLOTL_DO_NOT_TRACK="1", DO_NOT_TRACK="1",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false", **(env_extra or {}))
    result = subprocess.run(["axolotl", "train", str(config)], cwd=run_dir, env=env,
                            capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    (run_dir / "output.log").write_text(output)
    assert result.returncode == 0, output[-6000:]
    logs = [ast.literal_eval(match) for match in re.findall(r"\{'loss': .*?\}", output)]
    saved = run_dir / "out" / ("adapter_model.safetensors" if "adapter" in extra
                               else "model.safetensors")
    weights = load_file(str(saved))
    return logs, weights, output


def test_axolotl_train_end_to_end_matches_plain_checkpointing(assets, tmp_path):
    plain_logs, plain_weights, _ = axolotl_train(assets, tmp_path, "plain")
    logs, weights, output = axolotl_train(
        assets, tmp_path, "offload", activation_offloading=True, ckpt_offload_keep_last=1,
        ckpt_offload_backend="host", ckpt_offload_min_offload_bytes=0)

    assert "done by ckpt_offload" in output
    assert "ActivationOffloadCallback registered" in output
    # The peak breakdown, once, through the plugin's logger (Axolotl drops other INFO lines),
    # and its figures in the second step's log.
    assert output.count("where the device-memory peak is") == 1
    assert "axolotl.integrations.ckpt_offload" in output.split(
        "where the device-memory peak is")[0].splitlines()[-1]
    assert ["offload/peak_step_gib" in log for log in logs] == [False, True, False, False]
    assert len(logs) == len(plain_logs) == 4
    assert [log["loss"] for log in logs] == [log["loss"] for log in plain_logs]
    for log in logs:
        # 4 layers, all offloaded: keep_last=1, but the LM head's offloaded tensor restores
        # the last layer ahead (values as Trainer's progress bar prints them).
        assert float(log["offload/offloaded_tensors"]) == LAYERS
        assert float(log["offload/kept_resident_tensors"]) == 0
        assert float(log["offload/offloaded_gib"]) > 0
    assert all("offload/offloaded_tensors" not in log for log in plain_logs)
    assert weights.keys() == plain_weights.keys()
    for name in weights:
        assert torch.equal(weights[name], plain_weights[name]), name


def test_axolotl_train_lora_with_gradient_accumulation(assets, tmp_path):
    logs, adapter_weights, output = axolotl_train(
        assets, tmp_path, "lora", adapter="lora", lora_r=4, lora_alpha=8, lora_dropout=0.0,
        lora_target_linear=True, gradient_accumulation_steps=2, activation_offloading=True,
        # Axolotl's fused LoRA kernels are CUDA-only (Triton); it turns them on by default.
        lora_mlp_kernel=False, lora_qkv_kernel=False, lora_o_kernel=False,
        ckpt_offload_backend="host", ckpt_offload_min_offload_bytes=0)

    assert "done by ckpt_offload" in output
    assert len(logs) == 4
    for log in logs:
        # Two micro-batches per step. With frozen embeddings the first layer's input would be
        # a leaf held by autograd (enable_input_require_grads); the installation swaps that
        # hook. The LM head's offloaded tensor restores the last layer ahead too, so every
        # input moves: 4 of 4 per batch.
        assert float(log["offload/offloaded_tensors"]) == 2 * LAYERS
        assert float(log["offload/kept_resident_tensors"]) == 0
    assert any("lora_A" in name for name in adapter_weights)


def test_axolotl_torch_compile_is_regional_without_graph_breaks(assets, tmp_path):
    """`torch_compile: true` with the plugin: the Trainer's whole-model compile becomes a
    regional one, dynamo logs no graph break, and training is bit-identical to the same
    compiled run in which nothing leaves the device (every layer kept, head not offloaded)."""
    common = dict(torch_compile=True, activation_offloading=True, ckpt_offload_backend="host",
                  ckpt_offload_min_offload_bytes=0, env_extra={"TORCH_LOGS": "graph_breaks"})
    kept_logs, kept_weights, kept_output = axolotl_train(
        assets, tmp_path, "kept", ckpt_offload_keep_last=LAYERS,
        ckpt_offload_head=False, **common)
    logs, weights, output = axolotl_train(assets, tmp_path, "offload",
                                          ckpt_offload_keep_last=1, **common)

    for text in (output, kept_output):
        assert "compiles the model region by region: 4 checkpointed layers" in text
        assert "Graph break" not in text, text[text.find("Graph break") - 2000:][:6000]
    assert len(logs) == len(kept_logs) == 4
    assert [log["loss"] for log in logs] == [log["loss"] for log in kept_logs]
    for log, kept in zip(logs, kept_logs):
        assert float(log["offload/offloaded_tensors"]) == LAYERS
        assert float(kept["offload/offloaded_tensors"]) == 0
        assert float(kept["offload/kept_resident_tensors"]) == LAYERS
    assert weights.keys() == kept_weights.keys()
    for name in weights:
        assert torch.equal(weights[name], kept_weights[name]), name
