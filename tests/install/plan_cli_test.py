"""`python -m ckpt_offload.plan`: offload_plan's output from Python, a Hugging Face config.json
for the shape, and errors that name the flag or key."""

import contextlib
import io
import json
import os
import pathlib
import subprocess
import sys

import pytest

# Llama-3-8B's shape as its config.json states it (the llama-8b preset).
LLAMA_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "torch_dtype": "bfloat16", "vocab_size": 128256,
}


def offload_plan_binary():
    roots = [os.environ.get(v) for v in ("TEST_SRCDIR", "RUNFILES_DIR")]
    for candidate in [pathlib.Path(r) / "ckpt_offload/offload_core/offload_plan"
                      for r in roots if r] + [
            pathlib.Path(__file__).parents[2] / "offload_core/offload_plan"]:
        if candidate.is_file():
            return str(candidate)
    pytest.fail("offload_plan binary not in the runfiles")


def run(*args, check=True):
    """`python -m ckpt_offload.plan ARGS` in this process: (exit status, stdout, stderr)."""
    from ckpt_offload import plan

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = plan.main(list(args))
    result = subprocess.CompletedProcess(args, status, out.getvalue(), err.getvalue())
    if check:
        assert result.returncode == 0, result.stderr
    return result


def run_module(*args):
    """The same as a separate process, the way users run it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run([sys.executable, "-m", "ckpt_offload.plan", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def write_config(tmp_path, config, name="Llama-3-8B"):
    model_dir = tmp_path / name
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.mark.parametrize("flags", [
    ["--preset=llama-70b", "--seq=131072", "--host_ram=2TiB"],
    ["--preset=llama-8b", "--seq", "32768", "--batch=2", "--gpus_per_node=4", "--json"],
    ["--layers=4", "--hidden=256", "--ffn=1024", "--heads=4", "--kv_heads=2", "--keep_last=0"],
    ["--help"],
])
def test_output_is_offload_plans(flags):
    expected = subprocess.run([offload_plan_binary(), *flags], capture_output=True, text=True,
                              check=True).stdout
    got = run(*flags).stdout
    if flags == ["--help"]:
        assert got.startswith(expected) and "--config=PATH" in got[len(expected):]
    else:
        assert got == expected


def test_config_json_gives_the_presets_figures(tmp_path):
    model_dir = write_config(tmp_path, LLAMA_8B_CONFIG)
    common = ["--seq=32768", "--gpus_per_node=8", "--host_ram=1TiB", "--json"]
    from_config = json.loads(run(f"--config={model_dir / 'config.json'}", *common).stdout)
    from_dir = json.loads(run("--config", str(model_dir), *common).stdout)
    preset = json.loads(run("--preset=llama-8b", *common).stdout)
    assert from_config == from_dir
    assert from_config.pop("model") == "Llama-3-8B"  # the config's directory names it
    preset.pop("model")
    assert from_config == preset
    assert preset["host_limit_per_gpu"] == 2**40 // 2 // 8
    table = run(f"--config={model_dir}", "--seq=32768", "--host_ram=1TiB").stdout
    for row in ("Llama-3-8B: 32 layers, hidden 4096, ffn 14336, 32 heads (8 kv)",
                "host bytes per GPU", "host bytes per node (8 GPUs)", "PCIe per step",
                "exposed transfer per step", "host limit per GPU"):
        assert row in table, (row, table)


def test_flags_override_the_config_and_its_dtype_is_used(tmp_path):
    config = dict(LLAMA_8B_CONFIG, torch_dtype="float32", _name_or_path="org/model")
    model_dir = write_config(tmp_path, config)
    plan = json.loads(run(f"--config={model_dir}", "--layers=8", "--json").stdout)
    assert (plan["layers"], plan["dtype"], plan["model"]) == (8, "fp32", "org/model")
    plan = json.loads(run(f"--config={model_dir}", "--dtype=bf16", "--name=x", "--json").stdout)
    assert (plan["layers"], plan["dtype"], plan["model"]) == (32, "bf16", "x")


def test_multimodal_text_config_and_missing_kv_heads(tmp_path):
    text = {k: v for k, v in LLAMA_8B_CONFIG.items() if k != "num_key_value_heads"}
    model_dir = write_config(tmp_path, {"model_type": "llava", "text_config": text})
    plan = json.loads(run(f"--config={model_dir}", "--json").stdout)
    assert (plan["layers"], plan["heads"], plan["kv_heads"]) == (32, 32, 32)


def test_as_a_module_with_exit_statuses():
    result = run_module("--preset=llama-70b", "--seq=131072", "--host_ram=2TiB")
    assert result.returncode == 0, result.stderr
    assert result.stdout == subprocess.run(
        [offload_plan_binary(), "--preset=llama-70b", "--seq=131072", "--host_ram=2TiB"],
        capture_output=True, text=True, check=True).stdout
    result = run_module("--preset=llama-8b", "--seq=abc")
    assert result.returncode == 2 and result.stdout == ""
    assert "ckpt_offload.plan: --seq must be a positive integer, got 'abc'" in result.stderr


@pytest.mark.parametrize("args,message", [
    (["--preset=llama-8b", "--seq=abc"], "--seq must be a positive integer, got 'abc'"),
    (["--preset=llama-8b", "--host_ram=lots"], "--host_ram must be a byte count"),
    (["--preset=llama-8b", "--bogus=1"], "unknown flag --bogus"),
    (["--config"], "--config needs a value"),
    (["--config=/nonexistent/config.json"], "--config: cannot read /nonexistent/config.json"),
])
def test_bad_flags_exit_2_naming_the_flag(args, message):
    result = run(*args, check=False)
    assert result.returncode == 2
    assert message in result.stderr, result.stderr
    assert result.stdout == ""


def test_config_errors_name_the_file_and_key_gpt2_defaults(tmp_path):
    no_ffn = {k: v for k, v in LLAMA_8B_CONFIG.items() if k != "intermediate_size"}
    gpt2 = {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_inner": None}
    cases = [
        (no_ffn, "has none of intermediate_size, n_inner, ffn_dim (needed for --ffn)"),
        (dict(LLAMA_8B_CONFIG, hidden_size="4096"), "hidden_size must be a positive integer"),
        (dict(LLAMA_8B_CONFIG, num_hidden_layers=0), "num_hidden_layers must be a positive"),
    ]
    for i, (config, message) in enumerate(cases):
        model_dir = write_config(tmp_path, config, name=f"m{i}")
        result = run(f"--config={model_dir}", check=False)
        assert result.returncode == 2
        assert str(model_dir / "config.json") in result.stderr and message in result.stderr, \
            result.stderr
    plan = json.loads(run(f"--config={write_config(tmp_path, gpt2, 'gpt2')}", "--json").stdout)
    assert (plan["layers"], plan["ffn"], plan["kv_heads"]) == (12, 4 * 768, 12)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    result = run(f"--config={broken}", check=False)
    assert result.returncode == 2 and "is not JSON" in result.stderr


def test_planner_module_needs_no_torch():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    code = ("import importlib.util, sys, os\n"
            "spec = importlib.util.find_spec('ckpt_offload')\n"
            "path = [p for p in spec.submodule_search_locations "
            "if any(n.startswith('_plan') for n in os.listdir(p))][0]\n"
            "sys.path.insert(0, path)\n"
            "import _plan\n"
            "assert 'torch' not in sys.modules\n"
            "print(_plan.run(['--preset=llama-1b', '--json']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout
    assert json.loads(out)["model"] == "llama-1b"


def test_default_host_limit_is_the_engines_rule(monkeypatch):
    """The planner's default limit per GPU (C++) and config.parse_host_memory_limit(None)
    (what the engine uses) agree for the memory this process may use (RAM, or a lower
    cgroup limit)."""
    from ckpt_offload.config import parse_host_memory_limit, usable_host_memory_bytes

    for ranks in (1, 3, 8):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
        plan = json.loads(run("--preset=llama-1b", f"--host_ram={usable_host_memory_bytes()}",
                              f"--gpus_per_node={ranks}", "--json").stdout)
        assert plan["host_limit_per_gpu"] == parse_host_memory_limit(None), ranks


# `import torch` raises ModuleNotFoundError in the child, as on a machine without torch.
WITHOUT_TORCH = "import sys; sys.modules['torch'] = None; "


def run_without_torch(code):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH + code], capture_output=True,
                          text=True, env=env, timeout=120)


def test_planner_runs_where_torch_cannot_be_imported():
    result = run_without_torch(
        "import runpy; sys.argv = ['plan', '--preset=llama-8b', '--seq=8192']; "
        "runpy.run_module('ckpt_offload.plan', run_name='__main__')")
    assert result.returncode == 0, result.stderr
    assert "exposed transfer per step" in result.stdout


def test_the_api_without_torch_names_what_to_install():
    result = run_without_torch("import ckpt_offload; ckpt_offload.checkpoint")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: ckpt_offload needs torch"), result.stderr
    assert "pip install 'torch>=" in last and "--no-build-isolation" in last


# --memory_budget: the budget policy on the planner's shape.


# Layers that keep no op outputs: the plans of the H200 runs measured so far.
RESIDENT_ONLY = ("--kept_gib=0", "--kept_ms=0")


def test_memory_budget_plan_from_measured_figures():
    """The H200 run at an 80 GiB cap (benchmarks/results/2026-12-04_h200_budget): the step's
    checkpointed peak 27.5 GiB, 2.25 GiB and 12.1 ms per layer, layers resident or
    checkpointed; that run's 21 resident layers stepped in 1099.6 ms of checkpointing's
    1351.5 (12.0 ms per layer). Each kept byte now counts 15 % more for the allocator's
    stranded pieces: 18 layers fit."""
    out = run("--preset=llama-8b", "--seq=8192", "--memory_budget=auto", "--device_gib=80",
              "--step_peak_gib=27.5", "--layer_gib=2.25", "--layer_ms=12.1",
              "--step_ms=1351.5", *RESIDENT_ONLY).stdout
    assert "memory budget 76.00 GiB" in out
    assert "18 layers without checkpointing, 0 keeping 0.00 GiB of op outputs, 14 " \
           "checkpointed" in out
    figures = json.loads(run("--preset=llama-8b", "--seq=8192", "--memory-budget=auto",
                             "--device-gib=80", "--step_peak_gib=27.5", "--layer_gib=2.25",
                             "--layer_ms=12.1", "--step_ms=1351.5", "--json",
                             *RESIDENT_ONLY).stdout)
    budget = figures["memory_budget"]
    assert budget["resident_layers"] == 18 and figures["layers"] == 32
    from ckpt_offload.budget import FRAGMENTATION_MARGIN

    predicted_gib = 27.5 + 18 * 2.25 * (1 + FRAGMENTATION_MARGIN)
    assert abs(budget["predicted_peak_bytes"] / 2**30 - predicted_gib) < 0.1
    assert budget["predicted_peak_bytes"] <= 76 * 2**30
    saved_per_layer = (1351.5 - budget["predicted_step_ms"]) / 18
    assert abs(saved_per_layer / ((1351.5 - 1099.6) / 21) - 1) < 0.05


def test_memory_budget_estimates_a_layer_from_the_shape():
    figures = json.loads(run("--preset=llama-8b", "--seq=8192", "--memory_budget=200GiB",
                             "--step_peak_gib=27.5", "--json").stdout)["memory_budget"]
    assert figures["layer_bytes_estimated"]
    assert abs(figures["layer_bytes"] / 2**30 - 2.25) < 0.01
    assert figures["resident_layers"] == 32
    small = json.loads(run("--preset=llama-8b", "--seq=8192", "--memory_budget=20GiB",
                           "--step_peak_gib=27.5", "--json").stdout)["memory_budget"]
    assert small["resident_layers"] == 0 and not small["fits"]


def budget_figures(*args):
    return json.loads(run("--preset=llama-8b", "--seq=8192", "--step_peak_gib=27.5",
                          "--layer_gib=2.25", "--layer_ms=12.1", "--step_ms=1351.5",
                          "--json", *args).stdout)["memory_budget"]


@pytest.mark.parametrize("budget", ["29GiB", "40GiB", "60GiB", "80GiB"])
def test_kept_outputs_from_the_shape_buy_more_than_resident_layers_alone(budget):
    """Below the whole card, layers keep projection and attention outputs (per byte worth
    more than whole layers): a faster predicted step than resident layers alone, within
    the budget."""
    kept = budget_figures(f"--memory_budget={budget}")
    plain = budget_figures(f"--memory_budget={budget}", *RESIDENT_ONLY)
    assert kept["kept_outputs_estimated"] and not plain["kept_outputs_estimated"]
    assert kept["selective_layers"] > 0 and plain["selective_layers"] == 0
    assert kept["kept_output_bytes"] > 0 == plain["kept_output_bytes"]
    assert kept["predicted_step_ms"] < plain["predicted_step_ms"]
    assert kept["predicted_peak_bytes"] <= kept["budget_bytes"]
    assert (kept["resident_layers"] + kept["selective_layers"]
            + kept["checkpointed_layers"]) == 32


def test_kept_outputs_given_as_one_set():
    """--kept_gib/--kept_ms: the set a run measured. Worth less per byte than a whole
    layer, it is never kept; worth more, it is kept by every layer a tight budget allows."""
    poor = budget_figures("--memory_budget=40GiB", "--kept_gib=1", "--kept_ms=1")
    assert poor["selective_layers"] == 0 and not poor["kept_outputs_estimated"]
    rich = budget_figures("--memory_budget=40GiB", "--kept_gib=0.3", "--kept_ms=6")
    # Each layer keeps the set, offloads it (it fits a layer's copy window), or is resident.
    assert rich["selective_layers"] + rich["resident_layers"] + rich["offloading_layers"] == 32
    assert rich["predicted_step_ms"] < 1351.5 - 32 * 6 + 1


def test_at_the_checkpointed_peak_layers_offload_outputs_that_fit_their_copy_window():
    """A budget of the checkpointed step's peak and 1 GiB: room for the outputs in transit
    (two layers' sets, counted above the step's peak, the layers' own backward peak not
    known here) and not for one more kept on the device. Every layer except the last
    keep_last + max_inflight_d2h_groups offloads the outputs that its forward's copy window
    holds (its input and its outputs at the planner's D2H rate in its forward's time)."""
    at_peak = budget_figures("--memory_budget=28.5GiB", "--kept_gib=0.3", "--kept_ms=6",
                             "--max_inflight_d2h_groups=2", "--keep_last=1")
    assert at_peak["offloading_layers"] == 32 - 3
    assert at_peak["resident_layers"] == at_peak["selective_layers"] == 0
    assert at_peak["offloaded_output_bytes"] == pytest.approx(29 * 0.3 * 2**30, rel=1e-6)
    assert at_peak["predicted_step_ms"] == pytest.approx(1351.5 - 29 * 6)
    # A set larger than the window (0.9 x 12.1 ms x 55 GB/s, less the 64 MiB input) is not.
    large = budget_figures("--memory_budget=28.5GiB", "--kept_gib=0.5", "--kept_ms=6")
    assert large["offloading_layers"] == 0
    assert large["predicted_step_ms"] > at_peak["predicted_step_ms"]
    # A slower copy rate shrinks the window below the set.
    slow = budget_figures("--memory_budget=28.5GiB", "--kept_gib=0.3", "--kept_ms=6",
                          "--d2h_gbps=20")
    assert slow["offloading_layers"] == 0
    text = run("--preset=llama-8b", "--seq=8192", "--step_peak_gib=27.5", "--layer_gib=2.25",
               "--layer_ms=12.1", "--step_ms=1351.5", "--memory_budget=28.5GiB",
               "--kept_gib=0.3", "--kept_ms=6").stdout
    assert "29 layers offload 8.70 GiB of op outputs" in text


def test_offloaded_outputs_stay_within_the_host_memory_limit():
    """The layers' inputs (32 x 64 MiB) and offloaded outputs share the host pool, whose
    limit bounds what it reserves (1.15 x its live bytes): 8 GiB holds 16 layers' sets."""
    args = ("--memory_budget=28.5GiB", "--kept_gib=0.3", "--kept_ms=6",
            "--max_inflight_d2h_groups=2", "--keep_last=1")
    roomy = budget_figures(*args, "--host_memory_limit=16GiB")
    assert roomy["offloading_layers"] == 29 and roomy["host_limited_bytes"] == 0
    limited = budget_figures(*args, "--host_memory_limit=8GiB")
    assert limited["offloading_layers"] == 16
    assert (2 + limited["offloaded_output_bytes"] / 2**30) * 1.15 <= 8
    assert limited["host_limited_bytes"] == pytest.approx(13 * 0.3 * 2**30, rel=1e-6)
    assert limited["predicted_step_ms"] == pytest.approx(1351.5 - 16 * 6)
    text = run("--preset=llama-8b", "--seq=8192", "--step_peak_gib=27.5", "--layer_gib=2.25",
               "--layer_ms=12.1", "--step_ms=1351.5", *args, "--host_memory_limit=8GiB").stdout
    assert "16 layers offload 4.80 GiB" in text
    assert "3.90 GiB more fit the windows but not the host limit" in text


def test_resident_layers_offload_saved_tensors_in_the_planner(monkeypatch):
    """The planner's layers name their saved storages (the shape's op outputs, then the
    rest): with resident layers' offloads on, at 80 GiB resident layers offload some within
    the bytes their offloaded outputs would take; layers that keep no outputs (compiled
    ones) plan no window, so none; off (the default), none."""
    from ckpt_offload import budget

    args = ("--memory_budget=auto", "--device_gib=80")
    assert budget_figures(*args)["resident_offloaded_bytes"] == 0
    text = run("--preset=llama-8b", "--seq=8192", "--step_peak_gib=27.5", "--layer_gib=2.25",
               "--layer_ms=12.1", *args).stdout
    assert "resident layers' offloads" not in text
    monkeypatch.setattr(budget, "RESIDENT_STORAGE_OFFLOAD", True)
    section = budget_figures(*args)
    assert section["resident_offloaded_bytes"] > 0
    one_piece = budget_figures(*args, "--kept_gib=0", "--kept_ms=0")
    assert one_piece["resident_offloaded_bytes"] == 0  # nothing is offloaded without outputs
    text = run("--preset=llama-8b", "--seq=8192", "--step_peak_gib=27.5", "--layer_gib=2.25",
               "--layer_ms=12.1", *args).stdout
    assert "resident layers' offloads" in text


def test_stranded_pieces_count_in_the_checkpointed_peak():
    """--stranded_gib (the measured step's free pieces as its head began) is reserved memory
    the plan counts: the checkpointed peak and every prediction rise by it, and a budget
    they no longer fit keeps every layer checkpointed."""
    args = ("--memory_budget=40GiB", "--kept_gib=0.3", "--kept_ms=6")
    plain = budget_figures(*args)
    stranded = budget_figures(*args, "--stranded_gib=1.5")
    assert plain["checkpointed_peak_bytes"] == int(27.5 * 2**30)
    assert stranded["checkpointed_peak_bytes"] == plain["checkpointed_peak_bytes"] + 1.5 * 2**30
    assert stranded["predicted_peak_bytes"] <= 40 * 2**30
    assert stranded["predicted_step_ms"] >= plain["predicted_step_ms"]
    over = budget_figures("--memory_budget=28.5GiB", "--stranded_gib=1.5")
    assert not over["fits"] and over["resident_layers"] == over["selective_layers"] == 0
    # Allocations leave the stranded pieces out: the checkpointed step's own peak.
    assert over["predicted_allocated_bytes"] == int(27.5 * 2**30)
    text = run("--preset=llama-8b", "--seq=8192", "--step_peak_gib=27.5", "--layer_gib=2.25",
               "--layer_ms=12.1", "--memory_budget=28.5GiB", "--stranded_gib=1.5").stdout
    assert "(checkpointed step 29.00 GiB)" in text and "every layer stays" in text


def test_a_fused_losss_phases_let_more_layers_stay_resident():
    """The Trainer log's figures for Liger's fused loss at s8k (H100): the step peaks in the
    layers' backward (18.77 GiB), its forward and head at 17.31, the head rising 0.5. Given
    them, the plan counts what it keeps where it is live and bounds the allocator's margin
    by the head: more resident layers and a faster step than from the step's peak alone,
    within the budget. Allocations: everything kept on top of the forward and head's peak,
    or beside the layers' backward without one resident layer (its saved tensors are in
    that peak), whichever is higher."""
    def liger(*phases):
        return json.loads(run(
            "--preset=llama-8b", "--seq=8192", "--step_peak_gib=18.77", "--layer_gib=2.25",
            "--layer_ms=13.3", "--step_ms=1458", "--stranded_gib=1.04",
            "--memory_budget=74.5GiB", "--json", *RESIDENT_ONLY, *phases).stdout)["memory_budget"]

    blind = liger()
    phased = liger("--head_peak_gib=17.31", "--layer_phase_peak_gib=18.77",
                   "--head_rise_gib=0.5")
    assert phased["resident_layers"] > blind["resident_layers"]
    assert phased["predicted_step_ms"] < blind["predicted_step_ms"]
    assert phased["predicted_peak_bytes"] <= 74.5 * 2**30
    resident = phased["resident_layers"]
    assert phased["predicted_allocated_bytes"] == pytest.approx(
        max(17.31 + resident * 2.25, 18.77 + (resident - 1) * 2.25) * 2**30, abs=2**20)


def test_the_forward_and_the_heads_peaks_apart():
    """The Trainer log's figures measured apart (H100, Liger, s8k: the forward at 17.15 GiB,
    the head at 16.15): the predicted allocations count all that is kept on top of the
    head's peak and the resident layers' forward as their backward; the plan, held to the
    budget by its reserved peak, is the same as with the two together."""
    def liger(*phases):
        return json.loads(run(
            "--preset=llama-8b", "--seq=8192", "--step_peak_gib=18.62", "--layer_gib=2.25",
            "--layer_ms=13.3", "--step_ms=1458", "--stranded_gib=1.04",
            "--memory_budget=74.5GiB", "--json", "--layer_phase_peak_gib=18.62",
            "--head_rise_gib=0.5", *RESIDENT_ONLY, *phases).stdout)["memory_budget"]

    together = liger("--head_peak_gib=17.15")
    apart = liger("--forward_peak_gib=17.15", "--head_peak_gib=16.15")
    assert apart["resident_layers"] == together["resident_layers"]
    assert apart["predicted_peak_bytes"] == together["predicted_peak_bytes"]
    resident = apart["resident_layers"]
    assert apart["predicted_allocated_bytes"] == pytest.approx(
        max(16.15 + resident * 2.25, 18.62 + (resident - 1) * 2.25) * 2**30, abs=2**20)
    assert together["predicted_allocated_bytes"] == pytest.approx(
        (17.15 + resident * 2.25) * 2**30, abs=2**20)


@pytest.mark.parametrize("args, flag", [
    (["--memory_budget=80GiB", "--step_peak_gib=27", "--head_peak_gib=28"], "--head_peak_gib"),
    (["--memory_budget=80GiB", "--step_peak_gib=27", "--forward_peak_gib=17"],
     "--forward_peak_gib"),
    (["--memory_budget=80GiB", "--step_peak_gib=27", "--forward_peak_gib=28",
      "--head_peak_gib=17"], "--forward_peak_gib"),
    (["--memory_budget=80GiB", "--step_peak_gib=27", "--layer_phase_peak_gib=0"],
     "--layer_phase_peak_gib"),
    (["--memory_budget=80GiB", "--step_peak_gib=27", "--head_rise_gib=x"], "--head_rise_gib"),
    (["--memory_budget=80GiB"], "--step_peak_gib"),
    (["--memory_budget=80GiB", "--step_peak_gib=27", "--stranded_gib=-1"], "--stranded_gib"),
    (["--memory_budget=auto", "--step_peak_gib=27"], "--device_gib"),
    (["--memory_budget=0.5", "--step_peak_gib=27"], "--device_gib"),
    (["--memory_budget=lots", "--step_peak_gib=27"], "--memory_budget"),
    (["--memory_budget=80GiB", "--step_peak_gib=-1"], "--step_peak_gib"),
    (["--layer_gib=2"], "--memory_budget"),
    (["--memory_budget=80GiB", "--step_peak_gib=27", "--kept_gib=1"], "--kept_gib"),
    (["--memory_budget=80GiB", "--step_peak_gib=27", "--kept_ms=-1", "--kept_gib=1"],
     "--kept_ms"),
])
def test_memory_budget_flags_are_checked_naming_the_flag(args, flag):
    result = run("--preset=llama-8b", "--seq=8192", *args, check=False)
    assert result.returncode == 2
    assert flag in result.stderr
