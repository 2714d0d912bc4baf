"""HF Trainer with ActivationOffloadCallback on a Llama-1B-shaped LoRA model, seq 4096, on
the GPU (tag gpu): losses identical with and without the callback, activation peak lower.

    python -m pytest -s tests/gpu/hf_gpu_test.py
"""

import tempfile

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SEQ, STEPS = 4096, 5


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, count, seq, vocab):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (count, seq), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index].clone()}


def train(offload: bool):
    import transformers
    from peft import LoraConfig, get_peft_model

    from ckpt_offload.hf import ActivationOffloadCallback

    config = transformers.LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=SEQ,
        attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                             lora_dropout=0.0, task_type="CAUSAL_LM"))

    peaks = []

    class Peak(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()

        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - self.before)

    log_entries = []

    class Logs(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            log_entries.append(dict(logs or {}))

    callbacks = [Peak(), Logs()]
    if offload:
        callbacks.insert(0, ActivationOffloadCallback(keep_last=1))
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=STEPS, per_device_train_batch_size=1, learning_rate=1e-4,
            logging_steps=1, save_strategy="no", report_to=[], bf16=True, seed=0,
            dataloader_num_workers=0, gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False}, disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, callbacks=callbacks,
                                       train_dataset=TokenDataset(STEPS, SEQ, 32000))
        trainer.train()
    losses = [entry["loss"] for entry in log_entries if "loss" in entry]
    offload_logs = [e for e in log_entries if any(k.startswith("offload/") for k in e)]
    weights = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
    del trainer, model
    torch.cuda.empty_cache()
    return losses, peaks, offload_logs, weights


def test_trainer_llama_1b_lora_seq4096_losses_equal_and_peak_lower():
    reference, reference_peaks, _, reference_weights = train(offload=False)
    again, _, _, again_weights = train(offload=False)
    if reference != again or any(not torch.equal(v, again_weights[k])
                                 for k, v in reference_weights.items()):
        pytest.skip(f"plain training is not reproducible on this GPU: {reference} vs {again}")
    losses, peaks, offload_logs, weights = train(offload=True)
    print(f"losses without offload {reference}")
    print(f"losses with offload    {losses}")
    print(f"activation peak GiB without {[round(p / 2**30, 3) for p in reference_peaks]}")
    print(f"activation peak GiB with    {[round(p / 2**30, 3) for p in peaks]}")
    print(f"offload logs (last): {offload_logs[-1] if offload_logs else None}")
    assert losses == reference
    different = [k for k, v in reference_weights.items() if not torch.equal(v, weights[k])]
    assert not different, f"{len(different)} trained tensors differ, e.g. {different[:3]}"
    assert offload_logs, "no offload/ keys reached the Trainer's logs"
    assert max(peaks[1:]) < max(reference_peaks[1:])
