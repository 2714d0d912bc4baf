"""2-process runs on CPU (gloo, loopback only): a tiny Llama trained with activation offload
under DDP (transformers Trainer) and FSDP2 (fully_shard, custom loop) gives exactly the
losses and weights of the same run without offload; each rank's figures are its own.

Each test launches dist_worker.py with torchrun, bounded in time; the whole process group is
killed when it fails or runs over. The worker compares the runs itself and exits non-zero on
a mismatch; rank 0's JSON report is checked here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_offload.config import total_host_memory_bytes, usable_host_memory_bytes
from ckpt_offload.hf.compile import LAYER_CALL_IS_CHECKPOINTED

HERE = Path(__file__).resolve().parent
WORKER = HERE / "dist_worker.py"
NPROC = 2
TIMEOUT_S = 300
STEPS = 4
LAYERS = 3
OFFLOADED_PER_STEP = LAYERS  # keep_last=1, released by the LM head's offload


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(port: int, *worker_args: str):
    """The launch command (also documented in hf_integration/MULTI_GPU.md)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={NPROC}",
            "--nnodes=1", "--master_addr=127.0.0.1", f"--master_port={port}",
            str(WORKER), *worker_args]


def stop_process_tree(process: subprocess.Popen, grace_s: float = 10) -> None:
    """Ends torchrun and every worker it started. The workers run in sessions of their own
    (torchrun starts them so), so killing torchrun's process group would orphan them: they
    are found as its descendants first, then torchrun is asked to stop them (SIGTERM), and
    whatever is left after `grace_s` is killed."""
    import psutil  # a dependency of accelerate

    try:
        tree = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in tree:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    process.wait()
    psutil.wait_procs(tree, timeout=grace_s)


def run_workers(tmp_path: Path, *worker_args: str, extra_env=None) -> dict:
    """Runs the worker on NPROC local processes; returns rank 0's report."""
    result = tmp_path / "result.json"
    log_path = tmp_path / "torchrun.log"
    env = dict(os.environ)
    env.update({
        # The workers import what this test imports (Bazel's runfiles, or a source tree).
        "PYTHONPATH": os.pathsep.join([str(HERE)] + [p for p in sys.path if p]),
        "GLOO_SOCKET_IFNAME": "lo",  # gloo's sockets on loopback only
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(extra_env or {}),
    })
    env.pop("LOCAL_WORLD_SIZE", None)  # torchrun sets it
    command = torchrun_command(free_port(), "--result", str(result), "--steps", str(STEPS),
                               *worker_args)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   cwd=tmp_path, start_new_session=True)
        try:
            returncode = process.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            stop_process_tree(process)
    output = log_path.read_text()
    tail = "\n".join(output.splitlines()[-60:])
    assert returncode is not None, f"torchrun ran over {TIMEOUT_S} s; log tail:\n{tail}"
    assert returncode == 0, f"torchrun exited {returncode}; log tail:\n{tail}"
    assert result.exists(), f"rank 0 wrote no report; log tail:\n{tail}"
    report = json.loads(result.read_text())
    assert report["ok"] and report["world_size"] == NPROC, report
    assert sorted(r["rank"] for r in report["ranks"]) == list(range(NPROC))
    for rank in report["ranks"]:
        assert rank["problems"] == [], rank["problems"]
    return report


def assert_same_losses(plain, offloaded):
    assert len(plain["losses"]) == STEPS
    assert offloaded["losses"] == plain["losses"]


def assert_split_host_limit(rank):
    """torchrun's LOCAL_WORLD_SIZE split the default host limit between the two ranks."""
    assert rank["local_world_size"] == NPROC
    assert rank["ram_bytes"] == total_host_memory_bytes()
    assert rank["host_limit_bytes"] == usable_host_memory_bytes() // 2 // NPROC


def test_ddp_trainer_with_offload_callback_matches_plain_run(tmp_path):
    report = run_workers(tmp_path, "--mode", "ddp_trainer")
    ranks = report["ranks"]
    for rank in ranks:
        plain, offloaded = rank["runs"]["plain"], rank["runs"]["offload"]
        assert plain["wrapper"] == offloaded["wrapper"] == "DistributedDataParallel"
        assert plain["distributed_type"] == "DistributedType.MULTI_CPU"
        assert plain["num_processes"] == NPROC
        assert_same_losses(plain, offloaded)
        assert_split_host_limit(rank)
        # offload/ figures in this rank's logs count this rank's engine only.
        assert [log["offload/offloaded_tensors"] for log in offloaded["offload_logs"]] == \
            [OFFLOADED_PER_STEP] * STEPS
        assert offloaded["totals"]["offloaded_tensors"] == OFFLOADED_PER_STEP * STEPS
        assert offloaded["totals"]["restored_tensors"] == OFFLOADED_PER_STEP * STEPS
    # The Trainer logs the mean loss over ranks: the same on both.
    assert ranks[0]["runs"]["offload"]["losses"] == ranks[1]["runs"]["offload"]["losses"]


def test_fsdp2_loop_with_offload_matches_plain_run(tmp_path):
    report = run_workers(tmp_path, "--mode", "fsdp2_loop")
    for rank in report["ranks"]:
        runs = rank["runs"]
        plain = runs["plain"]
        # Sharded for real: every parameter a DTensor, each rank holding half the elements.
        assert plain["wrapper"] == "FSDPLlamaForCausalLM"
        assert plain["dtensor_params"] == plain["params"] > 0
        assert plain["local_numel"] * NPROC == plain["full_numel"]
        assert_split_host_limit(rank)
        for name in ("offload", "offload_all"):
            assert_same_losses(plain, runs[name])
        assert [s["offloaded_tensors"] for s in runs["offload"]["step_stats"]] == \
            [OFFLOADED_PER_STEP] * STEPS
        # scope="all" offloads more, and leaves the parameters FSDP2 gathers alone.
        assert runs["offload_all"]["totals"]["offloaded_tensors"] > \
            runs["offload"]["totals"]["offloaded_tensors"]
        assert runs["offload_all"]["totals"]["skipped_tensors"] > 0
        assert runs["offload_all"]["totals"]["host_live_bytes"] == 0
        # The measured step counts a layer's own saved bytes as without FSDP2 (the gathered
        # weights are parameters, not activations). Where FSDP2's gathering hooks run
        # inside the checkpoint (transformers checkpoints the layer's call), the layer offers
        # no kept outputs; where they run before it, the same as without FSDP2.
        sharded = runs["offload"]["measured_layers"]
        unsharded = runs["unsharded"]["measured_layers"]
        assert len(sharded) == len(unsharded) == LAYERS
        assert [bytes_ for bytes_, _ in sharded] == [bytes_ for bytes_, _ in unsharded]
        assert all(candidates > 0 for _, candidates in unsharded)
        if LAYER_CALL_IS_CHECKPOINTED:
            assert all(candidates == 0 for _, candidates in sharded)
        else:
            assert sharded == unsharded


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_trainer_with_offload_callback_matches_plain_run(tmp_path, stage):
    """Only where deepspeed is installed (not a project requirement); DS_ACCELERATOR=cpu."""
    pytest.importorskip("deepspeed")
    report = run_workers(tmp_path, "--mode", "deepspeed_trainer", "--zero-stage", str(stage),
                         extra_env={"DS_ACCELERATOR": "cpu"})
    for rank in report["ranks"]:
        plain, offloaded = rank["runs"]["plain"], rank["runs"]["offload"]
        assert plain["wrapper"] == "DeepSpeedEngine"
        assert_same_losses(plain, offloaded)
        assert offloaded["totals"]["offloaded_tensors"] == OFFLOADED_PER_STEP * STEPS
        # ZeRO-3 partitions every parameter (each carries a ds_tensor); ZeRO-2 none.
        expected = plain["partitioned_params"] if stage == 3 else 0
        assert offloaded["partitioned_params"] == expected
        assert (expected > 0) == (stage == 3)
