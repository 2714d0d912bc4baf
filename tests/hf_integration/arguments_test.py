"""OffloadArguments through HfArgumentParser: command line, YAML, and errors naming the
argument."""

import dataclasses

import pytest
import yaml
from transformers import HfArgumentParser, TrainingArguments

from ckpt_offload import OffloadConfig
from ckpt_offload.hf import ActivationOffloadCallback, OffloadArguments
from ckpt_offload.hf.arguments import ARGUMENT_FOR_FIELD

# A valid value other than the default for every OffloadConfig field.
NON_DEFAULT = dict(keep_last=3, prefetch_depth=2, min_offload_bytes=7, host_memory_limit="3GiB",
                   backend="host", scope="all", max_inflight_d2h_groups=4, offload_head=False,
                   memory_budget="40GiB")

# The documented argument names (hf_integration/README.md).
DOCUMENTED_ARGUMENTS = {
    "keep_last": "offload_keep_last", "prefetch_depth": "offload_prefetch_depth",
    "min_offload_bytes": "offload_min_bytes", "host_memory_limit": "offload_host_memory_limit",
    "backend": "offload_backend", "scope": "offload_scope",
    "max_inflight_d2h_groups": "offload_max_inflight_d2h_groups", "offload_head": "offload_head",
    "memory_budget": "offload_memory_budget",
}


def parser():
    return HfArgumentParser((TrainingArguments, OffloadArguments))


def test_command_line(tmp_path):
    training, offload = parser().parse_args_into_dataclasses(args=[
        "--output_dir", str(tmp_path), "--use_cpu", "--activation_offloading",
        "--offload_keep_last", "2", "--offload_prefetch_depth", "0",
        "--offload_host_memory_limit", "24GiB", "--offload_min_bytes", "0",
        "--offload_backend", "host",
    ])
    assert training.output_dir == str(tmp_path)
    assert offload.activation_offloading is True
    assert offload.to_config() == OffloadConfig(
        keep_last=2, prefetch_depth=0, host_memory_limit="24GiB", min_offload_bytes=0,
        backend="host")
    callback = ActivationOffloadCallback.from_args(offload)
    assert isinstance(callback, ActivationOffloadCallback)
    assert callback.config == offload.to_config()


@pytest.mark.parametrize("text, value", [
    ("24GiB", "24GiB"), ("512MB", "512MB"), ("0.5", 0.5), ("25769803776", 25769803776)])
def test_host_memory_limit_forms(tmp_path, text, value):
    (_, offload) = parser().parse_args_into_dataclasses(args=[
        "--output_dir", str(tmp_path), "--offload_host_memory_limit", text])
    assert offload.offload_host_memory_limit == value
    assert offload.to_config().host_memory_limit == value


def test_defaults_mean_off(tmp_path):
    (_, offload) = parser().parse_args_into_dataclasses(args=["--output_dir", str(tmp_path)])
    assert offload.activation_offloading is False
    assert offload.to_config() == OffloadConfig()
    assert ActivationOffloadCallback.from_args(offload) is None


def test_yaml_file(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text(f"""\
output_dir: {tmp_path / "out"}
use_cpu: true
gradient_checkpointing: true
activation_offloading: true
offload_keep_last: 1
offload_prefetch_depth: 2
offload_host_memory_limit: 0.25
offload_backend: host
""")
    training, offload = parser().parse_yaml_file(str(config))
    assert training.gradient_checkpointing is True
    assert offload.to_config() == OffloadConfig(
        keep_last=1, prefetch_depth=2, host_memory_limit=0.25, backend="host")
    assert ActivationOffloadCallback.from_args(offload).config.host_memory_limit == 0.25


def test_yaml_size_string_and_bytes(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text(f"output_dir: {tmp_path}\nactivation_offloading: true\n"
                      "offload_host_memory_limit: 24GiB\n")
    (_, offload) = parser().parse_yaml_file(str(config))
    assert offload.to_config().host_memory_limit_bytes() == 24 << 30
    config.write_text(f"output_dir: {tmp_path}\noffload_host_memory_limit: 1073741824\n")
    (_, offload) = parser().parse_yaml_file(str(config))
    assert offload.to_config().host_memory_limit_bytes() == 1 << 30


@pytest.mark.parametrize("argv, name", [
    (["--offload_keep_last", "-1"], "offload_keep_last"),
    (["--offload_prefetch_depth", "-2"], "offload_prefetch_depth"),
    (["--offload_host_memory_limit", "lots"], "offload_host_memory_limit"),
    (["--offload_host_memory_limit", "1.5"], "offload_host_memory_limit"),
    (["--offload_min_bytes", "-1"], "offload_min_bytes"),
    (["--offload_max_inflight_d2h_groups", "0"], "offload_max_inflight_d2h_groups"),
    (["--offload_keep_last", "2147483648"], "offload_keep_last"),
])
def test_bad_values_name_the_argument(tmp_path, argv, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        parser().parse_args_into_dataclasses(args=["--output_dir", str(tmp_path)] + argv)


def test_bad_choice_is_refused_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parser().parse_args_into_dataclasses(
            args=["--output_dir", str(tmp_path), "--offload_backend", "tpu"])
    assert "offload_backend" in capsys.readouterr().err


def test_bad_yaml_value_names_the_argument(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text(f"output_dir: {tmp_path}\noffload_backend: tpu\n")
    with pytest.raises(ValueError, match="^offload_backend:"):
        parser().parse_yaml_file(str(config))


def test_every_config_field_is_an_argument_with_the_documented_name_and_help():
    fields = dataclasses.fields(OffloadConfig)
    # A new OffloadConfig field fails here until it has a documented name and a test value.
    assert {f.name for f in fields} == set(NON_DEFAULT) == set(DOCUMENTED_ARGUMENTS)
    assert ARGUMENT_FOR_FIELD == DOCUMENTED_ARGUMENTS
    arguments = {f.name: f for f in dataclasses.fields(OffloadArguments)}
    assert list(arguments) == ["activation_offloading"] + list(ARGUMENT_FOR_FIELD.values())
    for config_field in fields:
        argument = arguments[ARGUMENT_FOR_FIELD[config_field.name]]
        assert argument.default == config_field.default
        assert argument.metadata["help"] == config_field.metadata["help"] != ""
        assert NON_DEFAULT[config_field.name] != config_field.default


def test_every_config_field_set_from_yaml_and_from_the_command_line(tmp_path):
    config = tmp_path / "train.yaml"
    settings = {"output_dir": str(tmp_path), "activation_offloading": True}
    settings.update((ARGUMENT_FOR_FIELD[name], value) for name, value in NON_DEFAULT.items())
    config.write_text(yaml.safe_dump(settings))
    (_, offload) = parser().parse_yaml_file(str(config))
    assert offload.to_config() == OffloadConfig(**NON_DEFAULT)

    argv = ["--output_dir", str(tmp_path), "--activation_offloading"]
    for name, value in NON_DEFAULT.items():
        argv += [f"--{ARGUMENT_FOR_FIELD[name]}", str(value)]
    (_, offload) = parser().parse_args_into_dataclasses(args=argv)
    assert offload.to_config() == OffloadConfig(**NON_DEFAULT)
    assert ActivationOffloadCallback.from_args(offload).config == OffloadConfig(**NON_DEFAULT)


def test_unknown_yaml_key_is_refused_naming_it(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text(f"output_dir: {tmp_path}\noffload_keep_lats: 2\n")
    with pytest.raises(ValueError, match="offload_keep_lats"):
        parser().parse_yaml_file(str(config))
