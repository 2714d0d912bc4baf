"""The peers ckpt_offload is compared with, as per-step contexts around forward and backward.

Each peer is loaded from its module file in CKPT_OFFLOAD_PEERS_DIR (tools/gpu_peers.sh
fills it from the peers' PyPI wheels and sdists), without its package's __init__, which pulls
in much more (axolotl pins a newer torch; deepspeed builds ops):
- save_on_cpu: torch.autograd.graph.save_on_cpu(pin_memory=True), every saved tensor;
- axolotl_hs: axolotl's hidden-states offload (`activation_offloading: hidden_states`), a
  marker on GradientCheckpointingLayer.__call__ and a saved-tensors context;
- deepspeed_hs: DeepSpeed's CheckpointHiddenStatesOffload (runtime/activation_checkpointing/
  offload_activations.py), the same design; its few accelerator calls are served by a CUDA
  shim registered as `deepspeed.accelerator`;
- trl: TRL's OffloadActivations (trl/models/activation_offloading.py), every saved tensor.
As their trainers do, each peer's context object is made once and entered every step (their
host buffer pools live across steps).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from typing import Callable, ContextManager, Dict

import torch

PEERS = ("save_on_cpu", "axolotl_hs", "deepspeed_hs", "trl")

_FILES = {
    "axolotl_hs": "axolotl/monkeypatch/checkpoint_activation_offload.py",
    "deepspeed_hs": "deepspeed/runtime/activation_checkpointing/offload_activations.py",
    "trl": "trl/models/activation_offloading.py",
}


def load_module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def peer_context(name: str, model, peers_dir: str) -> Callable[[], ContextManager]:
    """A function returning the context one training step of peer `name` runs in."""
    if name == "save_on_cpu":
        return lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)
    if name not in _FILES:
        raise SystemExit(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    path = os.path.join(peers_dir, _FILES[name])
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} (run tools/gpu_peers.sh)")
    if name == "trl":
        peer = load_module("peer_trl_activation_offloading", path)
        offload = peer.get_act_offloading_ctx_manager(model)
        return lambda: offload
    if name == "deepspeed_hs":
        _register_deepspeed_accelerator()
        peer = load_module("peer_deepspeed_offload_activations", path)
        offload = peer.get_checkpoint_hidden_states_offloading_ctx_manager()
        return lambda: offload  # patches the layer marker itself, on enter, until exit
    return _axolotl_context(load_module("peer_axolotl_hs_offload", path))


def _axolotl_context(peer) -> Callable[[], ContextManager]:
    """Axolotl's marker is patched onto the class once for good; here it is set only around
    this peer's steps, so other modes run the class's own __call__."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    original = GradientCheckpointingLayer.__dict__.get("__call__")
    peer.patch_gradient_checkpointing_layer_marker()
    patched = GradientCheckpointingLayer.__call__
    _set_call(GradientCheckpointingLayer, original)
    offload = peer.get_checkpoint_hidden_states_offloading_ctx_manager()

    @contextlib.contextmanager
    def context():
        GradientCheckpointingLayer.__call__ = patched
        try:
            with offload:
                yield
        finally:
            _set_call(GradientCheckpointingLayer, original)

    return context


def _set_call(cls, call) -> None:
    if call is None:
        if "__call__" in cls.__dict__:
            delattr(cls, "__call__")
    else:
        cls.__call__ = call


def _register_deepspeed_accelerator() -> None:
    """`from deepspeed.accelerator import get_accelerator` for the DeepSpeed module alone:
    the CUDA calls it makes, mapped to torch.cuda."""
    if "deepspeed.accelerator" in sys.modules:
        return

    class CudaAccelerator:
        Stream = torch.cuda.Stream

        @staticmethod
        def current_stream(device=None):
            return torch.cuda.current_stream(device)

        @staticmethod
        def stream(stream):
            return torch.cuda.stream(stream)

        @staticmethod
        def is_synchronized_device():
            return False

        @staticmethod
        def on_accelerator(tensor):
            return tensor.is_cuda

        @staticmethod
        def pin_memory(tensor, align_bytes=1, make_copy=True):
            return tensor.pin_memory()

    accelerator = types.ModuleType("deepspeed.accelerator")
    instance = CudaAccelerator()
    accelerator.get_accelerator = lambda: instance
    package = sys.modules.setdefault("deepspeed", types.ModuleType("deepspeed"))
    package.accelerator = accelerator
    sys.modules["deepspeed.accelerator"] = accelerator


def contexts(names, model, peers_dir: str) -> Dict[str, Callable[[], ContextManager]]:
    """Each requested peer's step context; a peer that cannot be loaded is left out with a
    note (one missing peer must not lose the others' figures)."""
    found = {}
    for name in names:
        try:
            found[name] = peer_context(name, model, peers_dir)
        except Exception as error:  # noqa: BLE001 - any failure means "not available"
            print(f"note: peer {name} not available ({type(error).__name__}: {error})")
    return found
