"""Sizing the host pool up front (CPU, host backend): with a token count (given, or TRL's
max_length x batch size) no step up to that size allocates pool memory after the first
(one reservation from an estimate, one from the first step's measure), whatever the order
of lengths; without one, rising lengths grow the pool step by step."""

import dataclasses
import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from ckpt_offload.hf import ActivationOffloadCallback, enable_activation_offload
from tiny import HOST, SEQ, TokenDataset, tiny_llama, train, training_args

BATCH = 2
# Wide enough that the step's offloaded bytes (up to 20 MiB) outgrow the pool's slab
# granularity: lengths rising step by step would grow it.
HIDDEN = 512
RISING = (128, 256, 384, 512, 640, 768, 896, 1024)


def pool_allocations_per_step(model, handle, lengths):
    """The pool's cumulative allocations after each training step of `lengths`."""
    counts = []
    for length in lengths:
        ids = torch.randint(3, 128, (BATCH, length), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        counts.append(handle.stats()["pinned_allocations"])
    return counts


def checkpointed_model():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=max(RISING),
        attn_implementation="sdpa"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


@pytest.mark.parametrize("order", ["rising", "falling"])
def test_reserved_pool_allocates_nothing_after_the_first_step(order):
    lengths = RISING if order == "rising" else tuple(reversed(RISING))
    # Settings apart from every other test's: the thread's pool is shared per settings.
    model = checkpointed_model()
    handle = enable_activation_offload(model, keep_last=1, prefetch_depth=2, **HOST)
    reserved = handle.reserve_for_tokens(BATCH * max(lengths))
    # 4 layers and the head's input, HIDDEN floats per token.
    assert reserved == 5 * BATCH * max(lengths) * HIDDEN * 4
    counts = pool_allocations_per_step(model, handle, lengths)
    # The estimate before the first step, what that step measured per token before the
    # second; nothing after.
    assert counts[0] >= 1 and counts[1:] == [counts[1]] * (len(lengths) - 1), counts
    assert counts[1] <= counts[0] + 1
    stats = handle.stats()
    assert stats["host_reserved_bytes"] >= reserved
    assert stats["host_peak_bytes"] <= stats["host_reserved_bytes"]
    handle.disable()


def test_without_a_reservation_rising_lengths_grow_the_pool():
    model = checkpointed_model()
    handle = enable_activation_offload(model, keep_last=1, prefetch_depth=3, **HOST)
    counts = pool_allocations_per_step(model, handle, RISING)
    assert counts[-1] > counts[0], counts
    handle.disable()


@pytest.mark.parametrize("tokens", [0, -5, 1.5, True, "64"])
def test_bad_token_count_names_the_field(tokens):
    model = checkpointed_model()
    handle = enable_activation_offload(model, keep_last=1, prefetch_depth=4, **HOST)
    with pytest.raises(ValueError, match="^tokens: "):
        handle.reserve_for_tokens(tokens)
    handle.disable()
    with pytest.raises(ValueError, match="^tokens_hint: "):
        ActivationOffloadCallback(tokens_hint=tokens, **HOST)


def test_reservation_over_the_host_limit_is_an_error_that_names_the_pool():
    model = checkpointed_model()
    handle = enable_activation_offload(model, keep_last=1, prefetch_depth=5,
                                       host_memory_limit=4096, **HOST)
    handle.reserve_for_tokens(1 << 20)  # kept until the engine starts: nothing to refuse yet
    ids = torch.randint(3, 128, (BATCH, 16), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="host pool was not reserved up front"):
        model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match="host pool"):
        handle.reserve_for_tokens(1 << 20)  # the engine exists now: refused at once
    handle.disable()


@dataclasses.dataclass
class ArgsWithMaxLength(TrainingArguments):
    """TrainingArguments with a max_length field, as TRL's SFTConfig has."""

    max_length: int = 1024


def test_callback_sizes_the_pool_from_max_length(tmp_path, caplog):
    callback = ActivationOffloadCallback(keep_last=1, prefetch_depth=6, **HOST)
    args = training_args(tmp_path, args_class=ArgsWithMaxLength, max_length=SEQ)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(),
                      callbacks=[callback])
    with caplog.at_level(logging.INFO, logger="ckpt_offload.hf"):
        trainer.train()
    notes = [r.message for r in caplog.records if "sized up front" in r.message]
    assert len(notes) == 1 and f"{SEQ * BATCH} tokens" in notes[0]
    assert "max_length x per_device_train_batch_size" in notes[0]
    totals = callback.final_totals
    assert totals["host_reserved_bytes"] >= 5 * SEQ * BATCH * 64 * 4  # the estimate
    assert totals["host_peak_bytes"] <= totals["host_reserved_bytes"]


def test_plain_trainer_arguments_size_nothing_up_front(tmp_path, caplog):
    callback = ActivationOffloadCallback(keep_last=1, prefetch_depth=7, **HOST)
    with caplog.at_level(logging.INFO, logger="ckpt_offload.hf"):
        train(tiny_llama(), tmp_path, callbacks=[callback])
    assert not [r for r in caplog.records if "sized up front" in r.message]
