"""One process of a multi-process offload run; started by torchrun (see multiproc_test.py).

    python -m torch.distributed.run --nproc_per_node=2 --master_addr=127.0.0.1 \\
        --master_port=PORT dist_worker.py --mode ddp_trainer --result result.json

Every process trains the same tiny Llama twice, without and then with activation offload
(host backend, CPU, gloo), and compares the two runs: losses and final weights must be
identical, bit for bit. Modes:
- ddp_trainer: transformers.Trainer (DDP through accelerate) + ActivationOffloadCallback.
- fsdp2_loop: torch.distributed.fsdp.fully_shard on each decoder layer and the model, a
  custom loop, enable_activation_offload (accelerate only enables FSDP on accelerators, so
  the Trainer cannot run FSDP2 on CPU); its offloaded run is repeated with scope="all".
- deepspeed_trainer: transformers.Trainer with a DeepSpeed ZeRO config (--zero-stage); only
  where deepspeed is installed and its CPU accelerator works.
- trainer: transformers.Trainer on whatever the launcher configured (`accelerate launch
  --use_fsdp ...` on GPUs, say): CUDA and the cuda backend when a GPU is visible.
Rank 0 writes a JSON report with every rank's figures. The exit status is 0 only when all
ranks matched.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback
from typing import Dict, List

import torch
import torch.distributed as dist

from tiny_llama import LAYERS, SEQ, TokenDataset, tiny_llama

BATCH = 2
HIDDEN = 64
# keep_last=1: every layer has its input hidden states offloaded (the LM head's offloaded
# tensor restores the last one ahead, so it is not kept).
OFFLOADED_PER_STEP = LAYERS  # keep_last=1, released by the LM head's offload
OFFLOADED_BYTES_PER_STEP = OFFLOADED_PER_STEP * BATCH * SEQ * HIDDEN * 4
OFFLOAD = dict(backend="host", min_offload_bytes=0, keep_last=1)
TIMEOUT = datetime.timedelta(seconds=120)


def host_limit_report() -> Dict[str, int]:
    """This rank's default host_memory_limit and what it is derived from."""
    from ckpt_offload import OffloadConfig
    from ckpt_offload.config import local_world_size, total_host_memory_bytes

    return {"local_world_size": local_world_size(), "ram_bytes": total_host_memory_bytes(),
            "host_limit_bytes": OffloadConfig().host_memory_limit_bytes()}


def parameters(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Full (unsharded) copies of the model's parameters, by name."""
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def same_weights(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


# transformers.Trainer (DDP or DeepSpeed through accelerate).

def trainer_run(workdir: str, steps: int, offload: bool, deepspeed=None,
                cpu: bool = True) -> Dict:
    from transformers import Trainer, TrainingArguments

    from ckpt_offload.hf import ActivationOffloadCallback

    model = tiny_llama(seed=0)
    args = TrainingArguments(
        output_dir=os.path.join(workdir, "offload" if offload else "plain"), max_steps=steps,
        per_device_train_batch_size=BATCH, learning_rate=1e-3, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=cpu and deepspeed is None, seed=0,
        dataloader_num_workers=0, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, disable_tqdm=True,
        ddp_timeout=int(TIMEOUT.total_seconds()), deepspeed=deepspeed)
    settings = dict(OFFLOAD, backend="host" if cpu else "cuda")
    callback = ActivationOffloadCallback(**settings) if offload else None
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(),
                      callbacks=[callback] if callback else [])
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    report = {
        "losses": [entry["loss"] for entry in logs],
        "wrapper": type(trainer.model_wrapped).__name__,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "num_processes": trainer.accelerator.num_processes,
        "epoch": trainer.state.epoch,
        "offload_logs": [{k: v for k, v in entry.items() if k.startswith("offload/")}
                         for entry in logs],
    }
    if deepspeed is not None or trainer.is_fsdp_enabled:
        report["weights"] = None  # ZeRO-3 holds partitions; the losses are compared
        report["param_classes"] = sorted({type(p).__name__ for p in model.parameters()})
        report["partitioned_params"] = sum(hasattr(p, "ds_tensor") for p in model.parameters())
    else:
        report["weights"] = parameters(trainer.model)
    if callback is not None:
        report["totals"] = callback.final_totals
    return report


# FSDP2 with a custom loop.

def fsdp2_run(steps: int, offload: bool, scope: str = "checkpoint_inputs",
              shard: bool = True) -> Dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from ckpt_offload.hf import enable_activation_offload

    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_llama(seed=0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if shard:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = enable_activation_offload(model, scope=scope, **OFFLOAD) if offload else None
    data = TokenDataset()
    losses: List[float] = []
    step_stats: List[Dict[str, float]] = []
    for step in range(steps):
        first = ((step * world + rank) * BATCH) % len(data)
        ids = data.ids[first:first + BATCH]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        if shard:
            dist.all_reduce(mean)
        losses.append((mean / world if shard else mean).item())
        if handle is not None:
            step_stats.append(handle.stats())
    report = {
        "losses": losses,
        "weights": parameters(model),
        "wrapper": type(model).__name__,
        "dtensor_params": sum(isinstance(p, DTensor) for p in model.parameters()),
        "params": sum(1 for _ in model.parameters()),
        "local_numel": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                           for p in model.parameters()),
        "full_numel": sum(p.numel() for p in model.parameters()),
    }
    if handle is not None:
        report["step_stats"] = step_stats
        # The measured step (for the budget's advice): per layer, its own saved bytes per
        # token and how many op outputs it could keep.
        measured = handle._budget.measurement
        report["measured_layers"] = [] if measured is None else [
            [cost.saved_bytes_per_token, len(cost.outputs)] for cost in measured.layers]
        report["totals"] = handle.totals()
        handle.disable()
    return report


# Comparing and reporting.

def check_offload_figures(run: Dict, steps: int, from_logs: bool) -> List[str]:
    """Problems with this rank's offload figures: each step offloads this rank's layers only."""
    problems = []
    per_step = run["offload_logs"] if from_logs else run["step_stats"]
    if len(per_step) != steps:
        problems.append(f"{len(per_step)} offload figures for {steps} steps")
    for i, figures in enumerate(per_step):
        tensors = figures["offload/offloaded_tensors" if from_logs else "offloaded_tensors"]
        nbytes = (figures["offload/offloaded_gib"] * (1 << 30) if from_logs
                  else figures["offloaded_bytes"])
        if tensors != OFFLOADED_PER_STEP or round(nbytes) != OFFLOADED_BYTES_PER_STEP:
            problems.append(f"step {i}: offloaded {tensors} tensors / {nbytes} bytes, expected "
                            f"{OFFLOADED_PER_STEP} / {OFFLOADED_BYTES_PER_STEP} (this rank's)")
    totals = run["totals"]
    if totals["restored_tensors"] != totals["offloaded_tensors"] or totals["host_live_bytes"]:
        problems.append(f"not everything came back: {totals}")
    return problems


def compare(name: str, plain: Dict, offloaded: Dict, steps: int) -> List[str]:
    problems = []
    if len(plain["losses"]) != steps:
        problems.append(f"{name}: {len(plain['losses'])} losses for {steps} steps")
    if plain["losses"] != offloaded["losses"]:
        problems.append(f"{name}: losses differ: {plain['losses']} vs {offloaded['losses']}")
    if plain["weights"] is not None and not same_weights(plain["weights"], offloaded["weights"]):
        problems.append(f"{name}: final weights differ")
    return problems


def summary(run: Dict) -> Dict:
    """`run` without the weights, for JSON."""
    return {k: v for k, v in run.items() if k != "weights"}


def run_mode(args) -> Dict:
    rank_report: Dict = {"rank": int(os.environ.get("RANK", 0)),
                         "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
                         **host_limit_report()}
    problems: List[str] = []
    if args.mode in ("ddp_trainer", "trainer"):
        cpu = args.mode == "ddp_trainer" or not torch.cuda.is_available()
        plain = trainer_run(args.workdir, args.steps, offload=False, cpu=cpu)
        offloaded = trainer_run(args.workdir, args.steps, offload=True, cpu=cpu)
        problems += compare(args.mode, plain, offloaded, args.steps)
        problems += check_offload_figures(offloaded, args.steps, from_logs=True)
        rank_report["runs"] = {"plain": summary(plain), "offload": summary(offloaded)}
    elif args.mode == "deepspeed_trainer":
        config = {"zero_optimization": {"stage": args.zero_stage},
                  "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                  "gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {
                      "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto",
                      "torch_adam": True}}}
        plain = trainer_run(args.workdir, args.steps, offload=False, deepspeed=config)
        offloaded = trainer_run(args.workdir, args.steps, offload=True, deepspeed=config)
        problems += compare(f"zero{args.zero_stage}", plain, offloaded, args.steps)
        problems += check_offload_figures(offloaded, args.steps, from_logs=True)
        rank_report["runs"] = {"plain": summary(plain), "offload": summary(offloaded)}
    elif args.mode == "fsdp2_loop":
        dist.init_process_group("gloo", timeout=TIMEOUT)
        plain = fsdp2_run(args.steps, offload=False)
        offloaded = fsdp2_run(args.steps, offload=True)
        offload_all = fsdp2_run(args.steps, offload=True, scope="all")
        unsharded = fsdp2_run(args.steps, offload=True, shard=False)
        problems += compare("fsdp2", plain, offloaded, args.steps)
        problems += compare("fsdp2 scope=all", plain, offload_all, args.steps)
        problems += check_offload_figures(offloaded, args.steps, from_logs=False)
        if plain["dtensor_params"] != plain["params"]:
            problems.append(f"fsdp2: {plain['dtensor_params']} of {plain['params']} "
                            "parameters are DTensors")
        if offload_all["totals"]["skipped_tensors"] == 0:
            problems.append("fsdp2 scope=all: no parameter was skipped")
        rank_report["runs"] = {"plain": summary(plain), "offload": summary(offloaded),
                               "offload_all": summary(offload_all),
                               "unsharded": summary(unsharded)}
    rank_report["problems"] = problems
    return rank_report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", required=True,
                        choices=("ddp_trainer", "fsdp2_loop", "deepspeed_trainer", "trainer"))
    parser.add_argument("--result", required=True, help="JSON report (written by rank 0)")
    parser.add_argument("--workdir", default=None,
                        help="Trainer output dirs (default: beside --result)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--zero-stage", type=int, default=3, choices=(2, 3))
    args = parser.parse_args()
    args.workdir = args.workdir or os.path.dirname(os.path.abspath(args.result))
    try:
        rank_report = run_mode(args)
    except Exception:  # noqa: BLE001 - reported, then a non-zero exit
        traceback.print_exc()
        rank_report = {"rank": int(os.environ.get("RANK", -1)),
                       "problems": ["exception: " + traceback.format_exc(limit=3)]}
        if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return 2  # no process group to tell the other ranks through
    distributed = dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    reports: List[Dict] = [rank_report]
    if distributed:
        reports = [None] * world
        dist.all_gather_object(reports, rank_report)
    ok = all(not report["problems"] for report in reports)
    if not distributed or dist.get_rank() == 0:
        result = {"mode": args.mode, "world_size": world, "steps": args.steps,
                  "ok": ok, "ranks": reports}
        if args.mode == "deepspeed_trainer":
            result["zero_stage"] = args.zero_stage
        with open(args.result, "w") as f:
            json.dump(result, f, indent=1, default=str)
    for report in reports:
        for problem in report["problems"]:
            print(f"rank {report['rank']}: {problem}", file=sys.stderr)
    if distributed:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    # Leave without interpreter finalization: gloo's run-loop threads can still be destroying
    # finished collectives (their tensors' Python references) while the interpreter tears
    # down, and taking the GIL then aborts the process ("terminate called without an active
    # exception"; seen once in ~10 FSDP2 runs, a torch issue, not this worker's). Everything
    # this process had to say is written and flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
