"""The one list of C++ sources, shared by Bazel BUILD files and setup.py (which exec()s this file).

Keep this file to plain list assignments: setup.py reads it as Python.
Paths are relative to the package named in each list's comment.
"""

# //offload_core, compiled everywhere.
CORE_SRCS = [
    "host_arena.cc",
    "host_device.cc",
    "sim_device.cc",
    "fault_injection.cc",
    "engine.cc",
    "numa.cc",
]

# //offload_core:planner_lib, the offload planner (no torch, no CUDA).
PLANNER_SRCS = [
    "planner.cc",
]

# //offload_core, compiled when a CUDA toolkit is present (Bazel) or torch has CUDA (pip).
CORE_CUDA_SRCS = [
    "cuda_device.cc",
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
# no torch), built with //offload_core's sources without CUDA.
PLAN_PYBIND_SRCS = [
    "csrc/plan_module.cc",
]
