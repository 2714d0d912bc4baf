"""Repository rules that find, on this machine, what Bazel cannot download.

Each rule asks the machine (Python, pkg-config, the file system) and writes a small
BUILD file. Nothing is fetched from the network.
"""

_PYTHON_ENV = "CKPT_OFFLOAD_PYTHON"

def _python(repository_ctx):
    """The interpreter the project uses: $CKPT_OFFLOAD_PYTHON, else python3 on PATH."""
    explicit = repository_ctx.os.environ.get(_PYTHON_ENV, "")
    if explicit:
        return explicit
    found = repository_ctx.which("python3")
    if not found:
        fail("ckpt_offload: no python3 on PATH and %s unset; run scripts/setup.sh first" % _PYTHON_ENV)
    return str(found)

def _ask_python(repository_ctx, python, code):
    result = repository_ctx.execute([python, "-c", code])
    if result.return_code != 0:
        fail("ckpt_offload: %s failed:\n%s" % (python, result.stderr))
    return result.stdout.strip()

def _local_python_impl(repository_ctx):
    python = _python(repository_ctx)
    info = _ask_python(repository_ctx, python, "\n".join([
        "import sys, sysconfig",
        "print(sys.executable)",
        "print(sysconfig.get_paths()['include'])",
    ])).split("\n")
    executable, include = info[0], info[1]
    repository_ctx.symlink(include, "include")
    repository_ctx.file("BUILD", """
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

package(default_visibility = ["//visibility:public"])

cc_library(
    name = "python_headers",
    hdrs = glob(["include/**/*.h"]),
    includes = ["include"],
)

py_runtime(
    name = "py3_runtime",
    interpreter_path = "{executable}",
    python_version = "PY3",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "python_toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
""".format(executable = executable))
    repository_ctx.file("python.bzl", "PYTHON = \"%s\"\n" % executable)

local_python = repository_rule(
    implementation = _local_python_impl,
    environ = [_PYTHON_ENV, "PATH", "VIRTUAL_ENV"],
    local = True,
)

def _local_torch_impl(repository_ctx):
    python = _python(repository_ctx)

    # The project's one list of tested torch releases and its reading of the C++ standard
    # torch's headers require (the pip build uses the same file).
    versions = repository_ctx.path(Label("//torch_plugin:ckpt_offload/versions.py"))
    info = _ask_python(repository_ctx, python, "\n".join([
        "import os, sys, importlib.util",
        "spec = importlib.util.spec_from_file_location('versions', %r)" % str(versions),
        "versions = importlib.util.module_from_spec(spec)",
        "spec.loader.exec_module(versions)",
        "import torch",
        "untested = versions.untested_torch(torch.__version__)",
        "if untested: sys.exit(untested)",
        "from torch.utils import cpp_extension",
        "print(os.path.dirname(torch.__file__))",
        "print(int(torch._C._GLIBCXX_USE_CXX11_ABI))",
        "print(torch.version.cuda or '')",
        "print(torch.__version__)",
        "print(versions.cxx_standard(os.path.join(os.path.dirname(torch.__file__), 'include')))",
        "flags = getattr(cpp_extension, '_get_pybind11_abi_build_flags', lambda: [])()",
        "print(' '.join(flags))",
    ])).split("\n")
    torch_dir, abi, cuda_version, version, cxx_std = info[0], info[1], info[2], info[3], info[4]
    pybind_flags = info[5].split(" ") if len(info) > 5 and info[5] else []
    repository_ctx.symlink(torch_dir + "/include", "include")
    repository_ctx.symlink(torch_dir + "/lib", "lib")
    has_cuda_libs = repository_ctx.path(torch_dir + "/lib/libtorch_cuda.so").exists
    lib_dir = torch_dir + "/lib"
    repository_ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

ABI_DEFINES = ["_GLIBCXX_USE_CXX11_ABI={abi}"]

cc_library(
    name = "headers",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.cuh"]),
    includes = ["include", "include/torch/csrc/api/include"],
    defines = ABI_DEFINES,
)

cc_library(
    name = "pybind11",
    hdrs = glob(["include/pybind11/**/*.h"]),
    includes = ["include"],
    copts = {pybind_flags},
)

cc_import(name = "c10_so", shared_library = "lib/libc10.so")
cc_import(name = "torch_so", shared_library = "lib/libtorch.so")
cc_import(name = "torch_cpu_so", shared_library = "lib/libtorch_cpu.so")
cc_import(name = "torch_python_so", shared_library = "lib/libtorch_python.so")

cc_library(
    name = "libtorch",
    deps = [":headers", ":c10_so", ":torch_so", ":torch_cpu_so"],
    # RPATH (not RUNPATH) so libtorch.so finds its own siblings (libtorch_cuda.so, ...)
    # when loaded through Bazel's symlinked library directory.
    linkopts = ["-Wl,-rpath,{lib_dir}", "-Wl,--disable-new-dtags"],
)

# Present only in CUDA builds of torch (TORCH_HAS_CUDA_LIBS); c10_cuda holds the stream API.
cc_import(name = "c10_cuda_so", shared_library = "lib/libc10_cuda.so")

cc_library(
    name = "libtorch_cuda",
    deps = [":libtorch", ":c10_cuda_so"],
)

cc_library(
    name = "torch_python",
    deps = [":libtorch", ":torch_python_so", ":pybind11"],
    defines = {pybind_defines},
)
""".format(abi = abi, lib_dir = lib_dir, pybind_flags = repr(pybind_flags),
           pybind_defines = repr([f[2:].replace('"', '') for f in pybind_flags if f.startswith("-D")])))
    repository_ctx.file("torch_config.bzl", "\n".join([
        "TORCH_VERSION = \"%s\"" % version,
        "TORCH_CUDA_VERSION = \"%s\"" % cuda_version,
        "TORCH_CXX11_ABI = %s" % abi,
        "TORCH_HAS_CUDA_LIBS = %s" % has_cuda_libs,
        "# For every target that compiles against torch's headers: after .bazelrc's",
        "# -std=c++17 (offload_core's own), the standard this torch requires.",
        "TORCH_COPTS = [\"-std=%s\"]" % cxx_std,
        "",
    ]))

local_torch = repository_rule(
    implementation = _local_torch_impl,
    environ = [_PYTHON_ENV, "PATH", "VIRTUAL_ENV", "CKPT_OFFLOAD_ALLOW_UNTESTED_TORCH"],
    local = True,
)

def _pkg_config_libs(repository_ctx, modules):
    result = repository_ctx.execute(["pkg-config", "--libs"] + modules)
    if result.return_code != 0:
        fail("ckpt_offload: pkg-config %s failed (install the Debian -dev packages listed in scripts/setup.sh):\n%s" %
             (" ".join(modules), result.stderr))
    return result.stdout.strip().split(" ")

def _require_header(repository_ctx, header, package):
    if not repository_ctx.path("/usr/include/" + header).exists:
        fail("ckpt_offload: /usr/include/%s missing; apt-get install %s" % (header, package))

def _system_libs_impl(repository_ctx):
    _require_header(repository_ctx, "absl/status/status.h", "libabsl-dev")
    _require_header(repository_ctx, "gtest/gtest.h", "libgtest-dev")
    _require_header(repository_ctx, "gmock/gmock.h", "libgmock-dev")
    _require_header(repository_ctx, "benchmark/benchmark.h", "libbenchmark-dev")
    absl = _pkg_config_libs(repository_ctx, [
        "absl_status",
        "absl_statusor",
        "absl_strings",
        "absl_str_format",
        "absl_synchronization",
        "absl_flags",
        "absl_flags_parse",
        "absl_time",
        "absl_random_random",
    ])
    repository_ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

# Debian's abseil: headers in /usr/include, libraries found by pkg-config.
cc_library(name = "absl", linkopts = {absl})

cc_library(name = "gtest", linkopts = ["-lgtest", "-pthread"])

cc_library(name = "gtest_main", deps = [":gtest"], linkopts = ["-lgtest_main"])

cc_library(name = "gmock", deps = [":gtest"], linkopts = ["-lgmock"])

cc_library(name = "benchmark", linkopts = ["-lbenchmark", "-pthread"])

cc_library(name = "benchmark_main", deps = [":benchmark"], linkopts = ["-lbenchmark_main"])
""".format(absl = repr(absl)))

system_libs = repository_rule(
    implementation = _system_libs_impl,
    local = True,
)

_CUDA_ENV = "CKPT_OFFLOAD_CUDA_HOME"

def _local_cuda_impl(repository_ctx):
    cuda_home = repository_ctx.os.environ.get(_CUDA_ENV, "/usr/local/cuda")
    present = repository_ctx.path(cuda_home + "/include/cuda_runtime.h").exists
    if present:
        repository_ctx.symlink(cuda_home + "/include", "include")
        lib_dir = cuda_home + "/lib64"
        repository_ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "cudart",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp"]),
    includes = ["include"],
    linkopts = ["-L{lib_dir}", "-lcudart", "-Wl,-rpath,{lib_dir}"],
)
""".format(lib_dir = lib_dir))
    else:
        repository_ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

# No CUDA toolkit on this machine: an empty library keeps labels valid.
cc_library(name = "cudart")
""")
    repository_ctx.file("cuda_config.bzl", "HAS_CUDA = %s\nCUDA_HOME = \"%s\"\n" % (present, cuda_home))

local_cuda = repository_rule(
    implementation = _local_cuda_impl,
    environ = [_CUDA_ENV],
    local = True,
)

def ckpt_offload_dependencies():
    local_python(name = "local_python")
    local_torch(name = "local_torch")
    system_libs(name = "system_libs")
    local_cuda(name = "local_cuda")
