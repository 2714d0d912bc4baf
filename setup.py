"""pip build of ckpt_offload: `pip install --no-build-isolation .` (or `pip wheel ...`).

Compiles two extensions from the same sources Bazel builds (sources.bzl is the one list):
- ckpt_offload._C against the installed torch, with the CUDA backend when torch has CUDA;
- ckpt_offload._plan, the offload planner: pybind11 only (torch's copy of its headers), no
  libtorch, no CUDA.

The one C++ dependency outside torch is abseil. It is found the way C++ projects find it,
first match wins:
  1. CKPT_OFFLOAD_ABSL_PREFIX=<prefix>: only that prefix (its pkg-config files, else its
     abseil CMake config);
  2. the active conda environment ($CONDA_PREFIX; conda-forge's libabseil, once abseil-cpp);
  3. pkg-config's own search path (Debian/Ubuntu libabsl-dev; PKG_CONFIG_PATH adds more);
  4. abseil's CMake config (absl_DIR / CMAKE_PREFIX_PATH / the system's), through cmake.
The build links exactly the libraries the match reports (they differ between abseil
releases) and records their directory as RPATH when it is not a system one. When nothing
matches, the build stops before compiling, with the packages to install for apt and conda.
libnuma is not needed: offload_core/numa.cc makes the memory-policy system calls itself.

Before compiling, the build checks what it needs and stops with the command that fixes it:
setuptools able to build a wheel, an importable torch (build isolation hides the installed
one), a tested torch (ckpt_offload/versions.py; CKPT_OFFLOAD_ALLOW_UNTESTED_TORCH=1 to go
on). The C++ standard is the one the installed torch's headers require. Progress lines go to
the terminal, which pip otherwise keeps silent until the build ends.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import util as importlib_util

import setuptools
from setuptools import Extension, setup

ROOT = pathlib.Path(__file__).parent.resolve()


def _load_versions():
    """ckpt_offload/versions.py, without importing the package (which needs torch)."""
    spec = importlib_util.spec_from_file_location(
        "ckpt_offload_versions", ROOT / "torch_plugin/ckpt_offload/versions.py")
    module = importlib_util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


VERSIONS = _load_versions()
# setuptools builds wheels itself from 70.1 on; before that only with the wheel package.
SETUPTOOLS_FOR_WHEELS = (70, 1)
INSTALL_COMMAND = "pip install --no-build-isolation ."

# Import name -> source directory: ckpt_offload comes from torch_plugin/, its hf and axolotl
# subpackages from hf_integration/.
PACKAGE_DIRS = {
    name: path for name, path in {
        "ckpt_offload": "torch_plugin/ckpt_offload",
        "ckpt_offload.hf": "hf_integration/ckpt_offload/hf",
        "ckpt_offload.axolotl": "hf_integration/ckpt_offload/axolotl",
    }.items() if (ROOT / path / "__init__.py").exists()
}

# What the sources include from abseil, as pkg-config modules and as CMake targets.
ABSL_PKG_CONFIG_MODULES = ("absl_status", "absl_statusor", "absl_strings", "absl_str_format",
                           "absl_synchronization")
ABSL_CMAKE_TARGETS = tuple(m.replace("absl_", "absl::", 1) for m in ABSL_PKG_CONFIG_MODULES)
ABSL_PREFIX_ENV = "CKPT_OFFLOAD_ABSL_PREFIX"
INSTALL_HINT = (
    "Install abseil (C++) with its development files, then run pip again:\n"
    "  apt (Debian 12+, Ubuntu 22.04+):  sudo apt-get install libabsl-dev pkg-config\n"
    "  conda:                            conda install -c conda-forge libabseil\n"
    "                                    (the package older channels call abseil-cpp)\n"
    f"  an install prefix of your own:    {ABSL_PREFIX_ENV}=<prefix> pip install ...\n"
    "                                    (<prefix>/lib/pkgconfig/absl_*.pc or\n"
    "                                     <prefix>/lib/cmake/absl/abslConfig.cmake)")
# Directories the dynamic linker searches anyway: no RPATH for them.
SYSTEM_LIB_DIRS = {"/lib", "/lib64", "/usr/lib", "/usr/lib64", "/lib/x86_64-linux-gnu",
                   "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu",
                   "/usr/lib/aarch64-linux-gnu"}
# The compiler's own include directories: an -I for one of them reorders the system headers.
SYSTEM_INCLUDE_DIRS = {"/usr/include", "/usr/local/include"}


class AbseilNotFound(Exception):
    """No abseil in any place searched; the message lists each place and why."""


class AbseilFlags:
    """Compile and link flags for abseil, and where they came from."""

    def __init__(self, source, include_dirs=(), library_dirs=(), libraries=(),
                 compile_args=(), link_args=()):
        self.source = source
        self.include_dirs = list(include_dirs)
        self.library_dirs = list(library_dirs)
        self.libraries = list(libraries)
        self.compile_args = list(compile_args)
        self.link_args = list(link_args)

    def rpath_args(self):
        """RPATH (not RUNPATH) for non-system library directories: abseil's libraries find
        each other through it too."""
        dirs = [d for d in self.library_dirs if os.path.realpath(d) not in SYSTEM_LIB_DIRS]
        if not dirs:
            return []
        return [f"-Wl,-rpath,{d}" for d in dirs] + ["-Wl,--disable-new-dtags"]

    def __repr__(self):
        return (f"AbseilFlags(source={self.source!r}, include_dirs={self.include_dirs}, "
                f"library_dirs={self.library_dirs}, libraries={self.libraries})")


def _flags_from_tokens(source, cflags, libs):
    """An AbseilFlags from pkg-config's tokens. The link tokens stay in their order (some
    come in position-sensitive groups, e.g. -Wl,--push-state,--as-needed -latomic
    -Wl,--pop-state); -L and -l are also noted apart for the RPATH and the log."""
    flags = AbseilFlags(source, link_args=libs)
    for token in cflags:
        if token.startswith("-I"):
            if token[2:] not in SYSTEM_INCLUDE_DIRS:
                flags.include_dirs.append(token[2:])
        elif token:
            flags.compile_args.append(token)
    for token in libs:
        if token.startswith("-L"):
            flags.library_dirs.append(token[2:])
        elif token.startswith("-l"):
            flags.libraries.append(token[2:])
    return flags


# --- pkg-config ---------------------------------------------------------------------------


def _pc_dirs_under(prefix):
    prefix = pathlib.Path(prefix)
    candidates = ["lib/pkgconfig", "lib64/pkgconfig", "lib/x86_64-linux-gnu/pkgconfig",
                  "lib/aarch64-linux-gnu/pkgconfig", "share/pkgconfig"]
    return [str(prefix / c) for c in candidates if (prefix / c).is_dir()]


def _run_pkg_config(pc_dirs, prefix, env):
    """pkg-config's answer for ABSL_PKG_CONFIG_MODULES: (cflags, libs) token lists.
    pc_dirs None: pkg-config's own search path; else only those directories."""
    run_env = dict(env)
    args = ["pkg-config"]
    if pc_dirs is not None:
        run_env["PKG_CONFIG_LIBDIR"] = os.pathsep.join(pc_dirs)
        run_env.pop("PKG_CONFIG_PATH", None)
        if prefix:
            args.append(f"--define-variable=prefix={prefix}")
    answers = []
    for what in ("--cflags", "--libs"):
        result = subprocess.run(args + [what, *ABSL_PKG_CONFIG_MODULES], env=run_env,
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise LookupError(result.stderr.strip().splitlines()[0] if result.stderr.strip()
                              else f"pkg-config exited {result.returncode}")
        answers.append(result.stdout.split())
    return answers[0], answers[1]


def _read_pc_files(pc_dirs, prefix):
    """What pkg-config would answer, read from the .pc files in `pc_dirs` (for machines
    without pkg-config): Cflags and Libs of each module and of everything it Requires."""
    cflags, libs, seen = [], [], set()

    def variables_of(path):
        variables, fields = {"pcfiledir": str(path.parent)}, {}
        if prefix:
            variables["prefix"] = prefix
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            field = re.match(r"^([A-Za-z0-9_.]+)\s*:\s*(.*)$", line)
            assign = re.match(r"^([A-Za-z0-9_.]+)\s*=\s*(.*)$", line)
            if assign and not (field and line.index(":") < line.index("=")):
                if not (prefix and assign.group(1) == "prefix"):
                    variables[assign.group(1)] = assign.group(2)
            elif field:
                fields[field.group(1).lower()] = field.group(2)

        def expand(text):
            for _ in range(20):  # variables refer to variables; no cycles in real files
                new = re.sub(r"\$\{([^}]+)\}", lambda m: variables.get(m.group(1), ""), text)
                if new == text:
                    return new
                text = new
            return text
        return {k: expand(v) for k, v in fields.items()}

    def visit(module):
        if module in seen:
            return
        seen.add(module)
        path = next((pathlib.Path(d) / f"{module}.pc" for d in pc_dirs
                     if (pathlib.Path(d) / f"{module}.pc").is_file()), None)
        if path is None:
            raise LookupError(f"no {module}.pc in {os.pathsep.join(pc_dirs)}")
        fields = variables_of(path)
        cflags.extend(fields.get("cflags", "").split())
        libs.extend(fields.get("libs", "").split())
        requires = re.sub(r"(<=|>=|!=|=|<|>)\s*\S+", " ", fields.get("requires", ""))
        for name in requires.replace(",", " ").split():
            visit(name)

    for module in ABSL_PKG_CONFIG_MODULES:
        visit(module)

    def unique(tokens):  # first -I/-L, last -l (a library after everything that needs it)
        out = []
        for token in tokens:
            if token.startswith("-l") and token in out:
                out.remove(token)
            if not token.startswith(("-I", "-L")) or token not in out:
                out.append(token)
        return out
    return unique(cflags), unique(libs)


def _pkg_config(source, pc_dirs, prefix, env):
    if shutil.which("pkg-config", path=env.get("PATH")):
        cflags, libs = _run_pkg_config(pc_dirs, prefix, env)
    elif pc_dirs is not None:
        cflags, libs = _read_pc_files(pc_dirs, prefix)
    else:
        raise LookupError("pkg-config is not installed")
    return _flags_from_tokens(source, cflags, libs)


# --- CMake config -------------------------------------------------------------------------

_CMAKE_PROBE = """cmake_minimum_required(VERSION 3.16)
project(ckpt_offload_absl_probe CXX)
find_package(absl CONFIG REQUIRED)
add_library(probe SHARED probe.cc)
target_link_libraries(probe PRIVATE {targets})
get_target_property(dirs absl::base INTERFACE_INCLUDE_DIRECTORIES)
file(WRITE "${{CMAKE_BINARY_DIR}}/absl_include_dirs.txt" "${{dirs}}")
"""


def _cmake_config(source, prefix, env):
    """abseil's CMake package, through a configure-only probe project whose link line
    (the Makefile generator's link.txt) lists every abseil library with its full path."""
    cmake = shutil.which("cmake", path=env.get("PATH"))
    if not cmake:
        raise LookupError("cmake is not installed")
    with tempfile.TemporaryDirectory(prefix="ckpt_offload_absl_") as work:
        work = pathlib.Path(work)
        (work / "CMakeLists.txt").write_text(
            _CMAKE_PROBE.format(targets=" ".join(ABSL_CMAKE_TARGETS)))
        (work / "probe.cc").write_text("int probe() { return 0; }\n")
        args = [cmake, "-S", str(work), "-B", str(work / "build"), "-G", "Unix Makefiles",
                "-DCMAKE_BUILD_TYPE=Release"]
        if prefix:
            args += [f"-DCMAKE_PREFIX_PATH={prefix}", "-DCMAKE_FIND_USE_CMAKE_SYSTEM_PATH=OFF",
                     "-DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF"]
        result = subprocess.run(args, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            found = re.search(r"Could not find a package configuration file[^\n]*",
                              result.stderr)
            raise LookupError(found.group(0) if found else "find_package(absl) failed")
        link = (work / "build/CMakeFiles/probe.dir/link.txt").read_text().split()
        includes = (work / "build/absl_include_dirs.txt").read_text().split(";")
    libraries, library_dirs = [], []
    for token in link:
        match = re.match(r"^(.*)/lib(absl_[A-Za-z0-9_]+)\.(so[.0-9]*|a)$", token)
        if match:
            if match.group(1) not in library_dirs:
                library_dirs.append(match.group(1))
            if match.group(2) in libraries:
                libraries.remove(match.group(2))
            libraries.append(match.group(2))
    if not libraries:
        raise LookupError("the CMake probe linked no abseil library")
    return AbseilFlags(source, [d for d in includes if d and d not in SYSTEM_INCLUDE_DIRS],
                       library_dirs, libraries,
                       link_args=[f"-L{d}" for d in library_dirs] + [f"-l{n}" for n in libraries])


# --- The search ---------------------------------------------------------------------------


def _search_prefix(label, prefix, env):
    """pkg-config files under `prefix`, else its CMake config."""
    reasons = []
    pc_dirs = _pc_dirs_under(prefix)
    if pc_dirs:
        try:
            return _pkg_config(f"{label} {prefix} (pkg-config)", pc_dirs, prefix, env), []
        except LookupError as error:
            reasons.append(f"pkg-config files: {error}")
    else:
        reasons.append("no lib/pkgconfig with absl_*.pc")
    if any((pathlib.Path(prefix) / d / "cmake/absl/abslConfig.cmake").is_file()
           for d in ("lib", "lib64", "lib/x86_64-linux-gnu")):
        try:
            return _cmake_config(f"{label} {prefix} (CMake config)", prefix, env), []
        except LookupError as error:
            reasons.append(f"CMake config: {error}")
    else:
        reasons.append("no lib/cmake/absl/abslConfig.cmake")
    return None, reasons


def find_abseil(env=None):
    """AbseilFlags for the first place that has abseil (see the module docstring), else
    AbseilNotFound naming every place searched and what to install."""
    env = dict(os.environ if env is None else env)
    searched = []
    prefix = env.get(ABSL_PREFIX_ENV)
    if prefix:
        if not pathlib.Path(prefix).is_dir():
            raise AbseilNotFound(f"{ABSL_PREFIX_ENV}={prefix} is not a directory.\n"
                                 + INSTALL_HINT)
        flags, reasons = _search_prefix(ABSL_PREFIX_ENV, prefix, env)
        if flags:
            return flags
        raise AbseilNotFound(f"no abseil under {ABSL_PREFIX_ENV}={prefix}: "
                             + "; ".join(reasons) + "\n" + INSTALL_HINT)
    conda = env.get("CONDA_PREFIX")
    if conda and pathlib.Path(conda).is_dir():
        flags, reasons = _search_prefix("conda environment", conda, env)
        if flags:
            return flags
        searched.append(f"conda environment {conda}: " + "; ".join(reasons))
    try:
        return _pkg_config("pkg-config", None, None, env)
    except LookupError as error:
        path = env.get("PKG_CONFIG_PATH")
        searched.append(f"pkg-config{f' (PKG_CONFIG_PATH={path})' if path else ''}: {error}")
    try:
        return _cmake_config("CMake config", None, env)
    except LookupError as error:
        searched.append(f"CMake config: {error}")
    raise AbseilNotFound("abseil (C++) not found. Searched:\n"
                         + "".join(f"  - {s}\n" for s in searched) + INSTALL_HINT)


# --- Extensions ---------------------------------------------------------------------------


# --- Checks before the build ---------------------------------------------------------------


def _progress(message):
    """One line for the person waiting: on the terminal when there is one (pip hides the
    build's own output), else on stderr (logs)."""
    line = f"ckpt_offload build: {message}\n"
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(line)
            return
    except OSError:
        pass
    sys.stderr.write(line)
    sys.stderr.flush()


def _version_tuple(text):
    return tuple(int(p) for p in re.findall(r"\d+", text)[:2])


def check_wheel_support(argv):
    """An error message when this setuptools cannot make the wheel pip asks for, else None."""
    if not {"bdist_wheel", "dist_info"} & set(argv):
        return None
    if _version_tuple(setuptools.__version__) >= SETUPTOOLS_FOR_WHEELS:
        return None
    if importlib_util.find_spec("wheel") is not None:
        return None
    return (f"setuptools {setuptools.__version__} cannot build a wheel without the 'wheel' "
            f"package. Upgrade it in this environment, then run pip again:\n"
            f"  pip install 'setuptools>={'.'.join(map(str, SETUPTOOLS_FOR_WHEELS))}'\n"
            f"  {INSTALL_COMMAND}")


def _torch_outside_build_env(env):
    """(version, path) of the torch this interpreter imports outside pip's build isolation,
    or None."""
    clean = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    run = subprocess.run([sys.executable, "-c",
                          "import torch; print(torch.__version__); print(torch.__file__)"],
                         env=clean, capture_output=True, text=True, cwd="/")
    if run.returncode != 0:
        return None
    lines = run.stdout.split()
    return (lines[0], lines[1]) if len(lines) >= 2 else None


def import_torch(env=None):
    """torch, or SystemExit naming what to do: install it, turn build isolation off, or use
    a tested release."""
    env = dict(os.environ if env is None else env)
    try:
        import torch
    except ModuleNotFoundError as error:
        if error.name != "torch":
            raise
        sys.exit("ckpt_offload build: torch is not importable here. ckpt_offload compiles "
                 "against the torch you train with: install it first "
                 f"(pip install '{VERSIONS.torch_requirement()}'), then build with\n"
                 f"  {INSTALL_COMMAND}\n"
                 "(--no-build-isolation: pip's default isolation hides the installed torch).")
    if "build-env" in torch.__file__:
        # pip's isolation (pip-build-env-*) or pypa/build's (build-env-*) brought a torch of
        # its own: the extension would be built for it, not for the torch that imports it.
        outside = _torch_outside_build_env(env)
        found = (f"this environment imports torch {outside[0]} ({outside[1]})"
                 if outside else "this environment has no torch of its own")
        sys.exit(f"ckpt_offload build: build isolation brought torch {torch.__version__} "
                 f"into a temporary build environment ({os.path.dirname(torch.__file__)}), "
                 f"but {found}. Build against your own torch:\n  {INSTALL_COMMAND}")
    untested = VERSIONS.untested_torch(torch.__version__, env)
    if untested:
        sys.exit(untested.replace("ckpt_offload:", "ckpt_offload build:", 1))
    return torch


def load_sources():
    lists = {}
    exec((ROOT / "sources.bzl").read_text(), {}, lists)  # plain list assignments
    return lists


def extensions(absl, torch):
    from torch.utils import cpp_extension

    lists = load_sources()
    with_cuda = torch.version.cuda is not None and os.environ.get("CKPT_OFFLOAD_NO_CUDA") != "1"
    if with_cuda and cpp_extension.CUDA_HOME is None:
        # Only cuda_runtime.h and cudart are used (no .cu sources, nvcc never runs).
        sys.exit(f"ckpt_offload build: this torch has CUDA {torch.version.cuda}, but no CUDA "
                 "toolkit was found (CUDA_HOME unset, no nvcc on PATH, no /usr/local/cuda).\n"
                 "Install one, or point CUDA_HOME at it:\n"
                 "  apt:    NVIDIA's cuda-toolkit-<major>-<minor> (or Debian/Ubuntu's "
                 "nvidia-cuda-toolkit)\n"
                 "  conda:  conda install -c conda-forge cuda-cudart-dev cuda-nvcc\n"
                 "CKPT_OFFLOAD_NO_CUDA=1 builds without the CUDA backend (host backend only).")

    def core(*names):
        return [f"offload_core/{s}" for name in names for s in lists[name]]

    # The engine path, as //torch_plugin:torch_offloader links it: no simulator, no fault
    # injector (only its hook points).
    engine = core("ARENA_SRCS", "DEVICE_SRCS", "NUMA_SRCS", "ENGINE_SRCS")
    torch_include = os.path.join(os.path.dirname(torch.__file__), "include")
    std = VERSIONS.cxx_standard(torch_include)
    _progress(f"torch {torch.__version__}, {std}, "
              f"{'with' if with_cuda else 'without'} the CUDA backend")
    compile_args = ["-O2", f"-std={std}", *absl.compile_args]
    common = dict(
        include_dirs=[str(ROOT), *absl.include_dirs],
        extra_link_args=absl.link_args + absl.rpath_args(),
    )

    sources = engine + core("CUDA_DEVICE_SRCS" if with_cuda else "CUDA_DEVICE_UNAVAILABLE_SRCS")
    sources += [f"torch_plugin/{s}" for s in lists["PLUGIN_SRCS"] + lists["PLUGIN_PYBIND_SRCS"]]
    c_kwargs = dict(
        common, name="ckpt_offload._C", sources=sources,
        define_macros=[("CKPT_OFFLOAD_WITH_CUDA", None)] if with_cuda else [],
        extra_compile_args={"cxx": compile_args},
    )
    c_ext = (cpp_extension.CUDAExtension if with_cuda else cpp_extension.CppExtension)(**c_kwargs)

    # The planner (with the simulator), as //torch_plugin:_plan links it: pybind11 from
    # torch's headers, no libtorch, no CUDA.
    plan_sources = engine + core("SIMULATOR_SRCS", "PLANNER_SRCS")
    plan_sources += [f"torch_plugin/{s}" for s in lists["PLAN_PYBIND_SRCS"]]
    plan_ext = Extension(
        **dict(common, include_dirs=common["include_dirs"] + [torch_include]),
        name="ckpt_offload._plan", sources=plan_sources, language="c++",
        extra_compile_args=compile_args + ["-fvisibility=hidden"],
    )
    return [c_ext, plan_ext]


def build_ext_class(cpp_extension):
    """torch's BuildExtension, saying what it compiles and how long it took."""

    class BuildExtensionWithProgress(cpp_extension.BuildExtension):
        def build_extensions(self):
            if not cpp_extension.is_ninja_available():
                _progress("ninja not found: compiling one file at a time "
                          "(pip install ninja for a parallel build)")
            super().build_extensions()

        def build_extension(self, ext):
            start = time.monotonic()
            _progress(f"compiling {ext.name}: {len(ext.sources)} sources")
            super().build_extension(ext)
            _progress(f"{ext.name} done in {time.monotonic() - start:.0f} s")

    return BuildExtensionWithProgress


def main():
    wheel_error = check_wheel_support(sys.argv[1:])
    if wheel_error:
        sys.exit(f"ckpt_offload build: {wheel_error}")
    torch = import_torch()
    from torch.utils import cpp_extension

    try:
        absl = find_abseil()
    except AbseilNotFound as error:
        sys.exit(f"ckpt_offload build: {error}")
    print(f"ckpt_offload build: abseil from {absl.source}: {len(absl.libraries)} libraries"
          f" in {', '.join(absl.library_dirs) or 'the default paths'}")
    setup(
        name="ckpt_offload",
        version=VERSIONS.VERSION,
        description="Activation offload for non-reentrant activation checkpointing",
        license="Apache-2.0",
        license_files=["LICENSE"],
        package_dir=PACKAGE_DIRS,
        packages=list(PACKAGE_DIRS),
        ext_modules=extensions(absl, torch),
        cmdclass={"build_ext": build_ext_class(cpp_extension)},
        python_requires=VERSIONS.python_requirement(),
        install_requires=[VERSIONS.torch_requirement()],
        extras_require={name: list(reqs) for name, reqs in VERSIONS.EXTRAS.items()},
    )


if __name__ == "__main__":
    main()
