"""The tiny Llama and token data of the HF integration tests (tests/hf_integration/tiny.py),
with the multi-process tests' layer count (CPU, offline)."""

from __future__ import annotations

from transformers import LlamaForCausalLM

import tiny
from tiny import SEQ, VOCAB, TokenDataset  # noqa: F401  (re-exported for dist_worker.py)

LAYERS = 3


def tiny_llama(seed: int = 0, layers: int = LAYERS) -> LlamaForCausalLM:
    """A 3-layer Llama (hidden 64) with weights from `seed`: the same on every call and rank."""
    return tiny.tiny_llama(seed=seed, layers=layers)
