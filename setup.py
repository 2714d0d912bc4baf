"""pip build of ckpt_offload: `pip install --no-build-isolation .`

Compiles ckpt_offload._C from the same sources Bazel builds (sources.bzl is the one list)
against the installed torch, with the CUDA backend when torch has CUDA.
"""

import os
import pathlib

from setuptools import setup

ROOT = pathlib.Path(__file__).parent.resolve()

# Import name -> source directory: ckpt_offload comes from torch_plugin/, its hf and axolotl
# subpackages from hf_integration/.
PACKAGE_DIRS = {
    name: path for name, path in {
        "ckpt_offload": "torch_plugin/ckpt_offload",
        "ckpt_offload.hf": "hf_integration/ckpt_offload/hf",
        "ckpt_offload.axolotl": "hf_integration/ckpt_offload/axolotl",
    }.items() if (ROOT / path / "__init__.py").exists()
}


def load_sources():
    lists = {}
    exec((ROOT / "sources.bzl").read_text(), {}, lists)  # plain list assignments
    return lists


def extension():
    import torch
    from torch.utils import cpp_extension

    lists = load_sources()
    with_cuda = torch.version.cuda is not None and os.environ.get("CKPT_OFFLOAD_NO_CUDA") != "1"
    sources = [f"offload_core/{s}" for s in lists["CORE_SRCS"]]
    sources += [f"offload_core/{s}" for s in
                (lists["CORE_CUDA_SRCS"] if with_cuda else ["cuda_device_unavailable.cc"])]
    sources += [f"torch_plugin/{s}" for s in lists["PLUGIN_SRCS"] + lists["PLUGIN_PYBIND_SRCS"]]
    absl_libs = [
        "absl_statusor", "absl_status", "absl_strerror", "absl_cord", "absl_cordz_info",
        "absl_cord_internal", "absl_cordz_functions", "absl_cordz_handle", "absl_hash",
        "absl_city", "absl_low_level_hash", "absl_raw_hash_set", "absl_bad_optional_access",
        "absl_bad_variant_access", "absl_hashtablez_sampler", "absl_exponential_biased",
        "absl_synchronization", "absl_graphcycles_internal", "absl_stacktrace",
        "absl_symbolize", "absl_debugging_internal", "absl_demangle_internal",
        "absl_malloc_internal", "absl_time", "absl_civil_time", "absl_time_zone",
        "absl_str_format_internal", "absl_strings", "absl_strings_internal", "absl_int128",
        "absl_throw_delegate", "absl_base", "absl_spinlock_wait", "absl_raw_logging_internal",
        "absl_log_severity",
    ]
    kwargs = dict(
        name="ckpt_offload._C",
        sources=sources,
        include_dirs=[str(ROOT)],
        define_macros=[("CKPT_OFFLOAD_WITH_CUDA", None)] if with_cuda else [],
        extra_compile_args={"cxx": ["-O2", "-std=c++17"]},
    )
    kwargs["libraries"] = absl_libs + ["numa"]  # mbind / set_mempolicy (offload_core/numa.cc)
    prefix = os.environ.get("CKPT_OFFLOAD_ABSL_PREFIX")
    if prefix:
        # A copy of Debian's abseil brought to a machine without it (scripts/gpu_deps.sh).
        kwargs["include_dirs"].append(f"{prefix}/include")
        kwargs["library_dirs"] = [f"{prefix}/lib"]
        # RPATH, not RUNPATH: abseil's libraries find each other through it too.
        kwargs["extra_link_args"] = [f"-Wl,-rpath,{prefix}/lib", "-Wl,--disable-new-dtags"]
    if with_cuda:
        return cpp_extension.CUDAExtension(**kwargs)
    return cpp_extension.CppExtension(**kwargs)


def main():
    from torch.utils import cpp_extension

    setup(
        name="ckpt_offload",
        version="0.1.0",
        description="Activation offload for non-reentrant activation checkpointing",
        package_dir=PACKAGE_DIRS,
        packages=list(PACKAGE_DIRS),
        ext_modules=[extension()],
        cmdclass={"build_ext": cpp_extension.BuildExtension},
        python_requires=">=3.10",
        install_requires=["torch"],
    )


if __name__ == "__main__":
    main()
