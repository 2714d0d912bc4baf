"""The one list of C++ sources, shared by Bazel BUILD files and setup.py (which exec()s this file).

Keep this file to plain list assignments: setup.py reads it as Python.
Paths are relative to the package named in each list's comment. One list per cc_library of
//offload_core; setup.py composes the extensions from them as the BUILD files do.
"""

# //offload_core:arena, the pinned host arena.
ARENA_SRCS = [
    "host_arena.cc",
]

# //offload_core:device, the device interface and the host backend.
DEVICE_SRCS = [
    "host_device.cc",
]

# //offload_core:numa, NUMA placement of host memory.
NUMA_SRCS = [
    "numa.cc",
]

# //offload_core:cuda_device, compiled when a CUDA toolkit is present (Bazel) or torch has
# CUDA (pip); otherwise CUDA_DEVICE_UNAVAILABLE_SRCS reports the backend unavailable.
CUDA_DEVICE_SRCS = [
    "cuda_device.cc",
]

CUDA_DEVICE_UNAVAILABLE_SRCS = [
    "cuda_device_unavailable.cc",
]

# //offload_core:engine, the transfer scheduler.
ENGINE_SRCS = [
    "engine.cc",
]

# //offload_core:simulator, the simulated device: part of the planner and of tests only,
# never of the ckpt_offload._C engine path.
SIMULATOR_SRCS = [
    "sim_device.cc",
]

# //offload_core:planner, the offload planner (no torch, no CUDA).
PLANNER_SRCS = [
    "planner.cc",
]

# //offload_core:fault_injection (testonly), the injector behind fault_hooks.h's hook
# points. Never compiled into an extension that ships.
FAULT_INJECTION_SRCS = [
    "fault_injection.cc",
]

# //torch_plugin, the ckpt_offload._C extension and the C++ API for LibTorch loops.
PLUGIN_SRCS = [
    "csrc/head_policy.cc",
    "csrc/tensor_offloader.cc",
    "csrc/session.cc",
]

PLUGIN_PYBIND_SRCS = [
    "csrc/bindings.cc",
]

# //torch_plugin, the ckpt_offload._plan extension: the planner for Python (pybind11 only,
# no torch), built with //offload_core:planner and :numa, without CUDA.
PLAN_PYBIND_SRCS = [
    "csrc/plan_module.cc",
]
