"""`python -m ckpt_offload.doctor` on a machine without a GPU: what it can check (versions, the
host backend's round trip, NUMA, host memory and the default limits), and that it says what
it skipped."""

import json
import os
import subprocess
import sys

import pytest
import torch

from ckpt_offload.config import total_host_memory_bytes, usable_host_memory_bytes


def doctor(*args, **env_overrides):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.pop("LOCAL_WORLD_SIZE", None)
    env.update(env_overrides)
    return subprocess.run([sys.executable, "-m", "ckpt_offload.doctor", *args],
                          capture_output=True, text=True, env=env, timeout=120)


pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only report")


def test_json_report_on_the_host_backend():
    result = doctor("--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True
    assert report["torch"] == torch.__version__
    assert report["round_trip_host"] is True
    assert "round_trip_cuda" not in report and "d2h_gbps" not in report
    assert report["gpu"] is None and report["gpu_numa_node"] is None
    assert isinstance(report["c_has_cuda"], bool)
    ram = total_host_memory_bytes()
    assert report["host_ram_bytes"] == ram
    assert report["local_ranks"] == 1  # no GPU, no LOCAL_WORLD_SIZE: one process
    assert report["default_limit_per_rank"] == usable_host_memory_bytes() // 2
    assert any("No CUDA device" in line for line in report["advice"])


def test_local_world_size_splits_the_default_limit(monkeypatch, capsys):
    from ckpt_offload import doctor as doctor_module

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert doctor_module.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["local_ranks"] == 4
    assert report["default_limit_per_rank"] == usable_host_memory_bytes() // 2 // 4
    assert os.environ["LOCAL_WORLD_SIZE"] == "4"


def test_text_report_says_what_it_skipped():
    result = doctor()
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for expected in ("Software", "torch", "_C has CUDA", "round trip (host backend)",
                     "ok (offloaded and restored, gradient identical)",
                     "none visible: copy and pinning measurements skipped",
                     "NUMA", "nodes online", "Host memory",
                     "default host_memory_limit per rank", "What to change"):
        assert expected in text, (expected, text)


def test_bad_arguments_name_the_flag(capsys):
    from ckpt_offload import doctor as doctor_module

    with pytest.raises(SystemExit) as exit_info:
        doctor_module.main(["--copy_mib=1"])
    assert exit_info.value.code == 2
    assert "--copy_mib must be at least 16, got 1" in capsys.readouterr().err


def test_default_limit_follows_a_cgroup_limit_below_ram(monkeypatch):
    from ckpt_offload import config
    from ckpt_offload import doctor as doctor_module

    report = doctor_module.Report()
    ram = total_host_memory_bytes()
    monkeypatch.setattr(config, "cgroup_memory_limit", lambda: ram // 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    doctor_module.check_host_memory(report, gpus=2)
    assert report.values["cgroup_limit_bytes"] == ram // 4
    assert report.values["local_ranks"] == 2
    assert report.values["default_limit_per_rank"] == ram // 4 // 2 // 2
    assert "LOCAL_WORLD_SIZE" not in os.environ  # restored after evaluating the rule
    assert any("half of the cgroup limit / 2" in shown for _, _, shown in report.rows)
