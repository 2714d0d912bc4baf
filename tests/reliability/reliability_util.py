"""Shared helpers of the reliability tests (CPU, host backend).

Offloaders are shared by every engine with the same settings in a thread (ckpt_offload.engine
caches them by config, per thread), so a test that needs a fresh one (an empty host arena, a
fallback warning not given yet) asks fresh_host_config() for a min_offload_bytes value no
other test used: every saved tensor of these tests is far larger, so the value changes nothing
else.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import threading
import warnings
from typing import Dict, Iterator, List

import torch
import torch.utils.checkpoint

import ckpt_offload
import fault_injector  # test-only: installs the injector in ckpt_offload._C's hook

_FRESH = itertools.count(1)

FALLBACK_WARNING = "host memory pool refused a block"


def fresh_host_config(**overrides) -> Dict:
    """Engine settings (host backend) that map to an offloader nobody created yet."""
    settings = dict(backend="host", min_offload_bytes=next(_FRESH))
    settings.update(overrides)
    return settings


def saved_tensor_hooks_active() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def plain_checkpoint(layer, x):
    return torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)


def grads(model) -> Dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def reference_step(model, x, layer_call=plain_checkpoint):
    """Loss and gradients of plain non-reentrant checkpointing (no offload)."""
    model.zero_grad(set_to_none=True)
    loss = model(x, layer_call)
    loss.backward()
    return loss.detach(), grads(model)


def offload_step(model, x, engine_kwargs, layer_call=None):
    """Loss, gradients and the engine of one step with offload."""
    model.zero_grad(set_to_none=True)
    with ckpt_offload.offload_activations(**engine_kwargs) as engine:
        loss = model(x, layer_call or ckpt_offload.checkpoint)
        loss.backward()
    return loss.detach(), grads(model), engine


def identical(reference, candidate) -> bool:
    """Bit-identical loss and gradients (torch.equal), over the same parameter names."""
    ref_loss, ref_grads = reference[0], reference[1]
    loss, got = candidate[0], candidate[1]
    if not torch.equal(ref_loss, loss) or ref_grads.keys() != got.keys():
        return False
    return all(torch.equal(ref_grads[name], got[name]) for name in ref_grads)


def host_live_bytes(engine) -> int:
    engine.synchronize()
    return engine.stats()["host_live_bytes"]


@contextlib.contextmanager
def captured_warnings() -> Iterator[List[str]]:
    """Every warning text given inside the block, from either channel.

    The plugin's C++ TORCH_WARN becomes a Python warning when it fires inside a torch op
    called from Python (the saved-tensor pack hook) and is printed on stderr by c10 when it
    fires in a direct extension call (begin_group). Both are collected: stderr (fd 2) is
    redirected to a file for the duration of the block.
    """
    texts: List[str] = []
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved_fd = os.dup(2)
        try:
            os.dup2(sink.fileno(), 2)
            with warnings.catch_warnings(record=True) as recorded:
                warnings.simplefilter("always")
                try:
                    yield texts
                finally:
                    texts.extend(str(w.message) for w in recorded)
        finally:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            sink.seek(0)
            stderr = sink.read().decode(errors="replace")
            texts.extend(line for line in stderr.splitlines() if line.strip())
            # Keep what the block printed visible in the test log.
            if stderr:
                os.write(2, stderr.encode())


def count_fallback_warnings(texts: List[str]) -> int:
    return sum(FALLBACK_WARNING in text for text in texts)


@contextlib.contextmanager
def armed_fault(fault: str, count: int = 1):
    """The next `count` operations of `fault` fail while the block runs; cleared after."""
    fault_injector.fail_next(fault, count)
    try:
        yield
    finally:
        fault_injector.clear_faults()


def thread_count() -> int:
    return threading.active_count()


def rss_bytes() -> int:
    """Resident set size of this process."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def ckpt_offload_objects(model) -> list:
    """Objects of ckpt_offload anywhere on the model (forward, checkpoint functions, hooks)."""
    found = []
    for module in model.modules():
        values = [module.__dict__.get("forward"),
                  module.__dict__.get("_gradient_checkpointing_func"),
                  *module._forward_hooks.values()]
        found += [v for v in values if type(v).__module__.startswith("ckpt_offload")]
    return found
