"""The README's first command: fine-tune a tiny random-init Llama with HF Trainer, once with
plain non-reentrant checkpointing and once with ckpt_offload, and print what changed.

On a GPU it offloads CUDA activations to pinned host memory; on a CPU-only machine it runs
the same engine through the host backend (CPU tensors through the host pool), which shows
the mechanics and the bit-exactness but cannot save memory (host and device are one RAM).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402

from ckpt_offload.hf import ActivationOffloadCallback  # noqa: E402


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, vocab, seq, count, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (count, seq), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        ids = self.ids[index]
        return {"input_ids": ids, "labels": ids.clone()}


class StepMeter(transformers.TrainerCallback):
    """Wall time and peak device memory of each optimizer step."""

    def __init__(self, on_gpu):
        self.on_gpu = on_gpu
        self.times, self.peaks, self.losses = [], [], []

    def on_step_begin(self, args, state, control, **kwargs):
        if self.on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.on_gpu:
            torch.cuda.synchronize()
            self.peaks.append(torch.cuda.max_memory_allocated() - self.before)
        self.times.append(time.perf_counter() - self.start)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def train(offload, args, on_gpu):
    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=1024,
        max_position_embeddings=args.seq, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if on_gpu:
        model = model.to("cuda", torch.bfloat16)
    meter = StepMeter(on_gpu)
    callbacks = [meter]
    offload_callback = None
    if offload:
        overrides = dict(keep_last=1)
        if not on_gpu:
            overrides.update(backend="host", min_offload_bytes=0)
        offload_callback = ActivationOffloadCallback(**overrides)
        callbacks.append(offload_callback)
    with tempfile.TemporaryDirectory() as out:
        training_args = transformers.TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch,
            learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to=[],
            use_cpu=not on_gpu, bf16=on_gpu, seed=0, dataloader_num_workers=0,
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False},
            disable_tqdm=True, log_level="error")
        trainer = transformers.Trainer(
            model=model, args=training_args,
            train_dataset=TokenDataset(1024, args.seq, args.steps * args.batch),
            callbacks=callbacks)
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # quiet logs
        trainer.train()
    stats = {}
    if offload_callback is not None:
        totals = offload_callback.final_totals  # summed over micro-steps, set at train end
        steps = max(1, totals.get("micro_steps", 1))
        # Layer inputs and the model's head, each way.
        stats = {direction: (totals.get(f"{direction}_bytes", 0)
                             + totals.get(f"head_{direction}_bytes", 0)) / steps
                 for direction in ("offloaded", "restored")}
    return meter, stats


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=0, help="default: 1024 GPU, 128 CPU")
    parser.add_argument("--seq", type=int, default=0, help="default: 4096 GPU, 256 CPU")
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    args.hidden = args.hidden or (1024 if on_gpu else 128)
    args.seq = args.seq or (4096 if on_gpu else 256)
    where = torch.cuda.get_device_name() if on_gpu else "CPU (host backend)"
    print(f"ckpt_offload demo on {where}: Llama {args.layers} layers, hidden {args.hidden}, "
          f"seq {args.seq}, batch {args.batch}, {args.steps} steps")
    rows = []
    results = {}
    for offload in (False, True):
        meter, stats = train(offload, args, on_gpu)
        results[offload] = meter
        timed = meter.times[1:] or meter.times  # the first step warms up
        rows.append((
            "ckpt_offload" if offload else "checkpointing only",
            f"{statistics.median(timed) * 1e3:.1f}",
            f"{max(meter.peaks) / 2**20:.1f}" if meter.peaks else "n/a (CPU)",
            f"{stats.get('offloaded', 0) / 2**20:.1f}",
            f"{stats.get('restored', 0) / 2**20:.1f}",
        ))
    header = ("run", "step ms (median)", "peak act. MiB", "offloaded MiB/step",
              "restored MiB/step")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)))
    same = results[False].losses == results[True].losses
    print(f"losses identical with and without offload: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
