"""setup.py finds abseil where users have it and links what that layout reports; with none,
the build stops before compiling and says what to install."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from setup_loader import copy_build_files, load_setup

SYSTEM_PC_DIR = pathlib.Path("/usr/lib/x86_64-linux-gnu/pkgconfig")
REQUIRED_LIBS = {"absl_status", "absl_statusor", "absl_strings", "absl_str_format_internal"}


setup = load_setup()


def tool_dir(tmp_path, *tools):
    """A PATH directory holding only `tools` (links to the real ones)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in tools:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return str(bin_dir)


def clean_env(tmp_path, *tools, **extra):
    """An environment in which abseil is found only where `extra` says."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("CKPT_OFFLOAD_ABSL_PREFIX", "CONDA_PREFIX", "PKG_CONFIG_PATH",
                        "CMAKE_PREFIX_PATH", "absl_DIR")}
    empty = tmp_path / "empty"
    empty.mkdir(exist_ok=True)
    env.update(PATH=tool_dir(tmp_path, *tools), PKG_CONFIG_LIBDIR=str(empty), **extra)
    return env


def prefix_copy(tmp_path, with_pc=True, with_cmake=False):
    """Debian's abseil copied to a prefix: with .pc files the way tools/gpu_deps.sh makes
    them (lib/), or with Debian's CMake files as they are (lib/x86_64-linux-gnu/, the
    layout those files expect)."""
    prefix = tmp_path / ("absl_cmake" if with_cmake else "absl")
    libdir = prefix / ("lib/x86_64-linux-gnu" if with_cmake else "lib")
    libdir.mkdir(parents=True)
    shutil.copytree("/usr/include/absl", prefix / "include/absl")
    for lib in SYSTEM_PC_DIR.parent.glob("libabsl_*.so*"):
        target = libdir / lib.name
        if lib.is_symlink():
            target.symlink_to(os.readlink(lib))
        else:
            shutil.copy(lib, target)
    if with_pc:
        (libdir / "pkgconfig").mkdir()
        for pc in SYSTEM_PC_DIR.glob("absl_*.pc"):
            lines = pc.read_text().splitlines()
            for key, value in (("prefix", "${pcfiledir}/../.."), ("libdir", "${prefix}/lib"),
                               ("includedir", "${prefix}/include")):
                lines = [f"{key}={value}" if line.startswith(f"{key}=") else line
                         for line in lines]
            (libdir / "pkgconfig" / pc.name).write_text("\n".join(lines) + "\n")
    if with_cmake:
        shutil.copytree(SYSTEM_PC_DIR.parent / "cmake/absl", libdir / "cmake/absl")
    return prefix


def system_pkg_config_libs():
    out = subprocess.run(["pkg-config", "--libs", *setup.ABSL_PKG_CONFIG_MODULES],
                         capture_output=True, text=True, check=True).stdout.split()
    return {t[2:] for t in out if t.startswith("-l")}


def test_system_pkg_config_is_found_and_its_libraries_are_linked(tmp_path):
    env = clean_env(tmp_path, "pkg-config")
    del env["PKG_CONFIG_LIBDIR"]
    flags = setup.find_abseil(env)
    assert flags.source == "pkg-config"
    assert set(flags.libraries) == system_pkg_config_libs()
    assert REQUIRED_LIBS <= set(flags.libraries)
    assert flags.rpath_args() == []  # the system's own directory needs no RPATH
    assert all(t in flags.link_args for t in ("-l" + lib for lib in flags.libraries))


def test_prefix_copy_with_and_without_the_pkg_config_program(tmp_path):
    prefix = prefix_copy(tmp_path)
    want = system_pkg_config_libs()
    for tools in (("pkg-config",), ()):
        env = clean_env(tmp_path, *tools, CKPT_OFFLOAD_ABSL_PREFIX=str(prefix))
        flags = setup.find_abseil(env)
        assert flags.source == f"CKPT_OFFLOAD_ABSL_PREFIX {prefix} (pkg-config)", tools
        assert set(flags.libraries) == want, tools
        assert [os.path.realpath(d) for d in flags.include_dirs] == [str(prefix / "include")]
        assert [os.path.realpath(d) for d in flags.library_dirs] == [str(prefix / "lib")]
        assert flags.rpath_args()[-1] == "-Wl,--disable-new-dtags"
        assert any(os.path.realpath(a.split(",")[-1]) == str(prefix / "lib")
                   for a in flags.rpath_args()[:-1])


def test_conda_environment_is_searched_before_the_system(tmp_path):
    prefix = prefix_copy(tmp_path)
    env = clean_env(tmp_path, "pkg-config", CONDA_PREFIX=str(prefix))
    del env["PKG_CONFIG_LIBDIR"]  # the system's abseil is there too; conda's wins
    flags = setup.find_abseil(env)
    assert flags.source == f"conda environment {prefix} (pkg-config)"
    assert [os.path.realpath(d) for d in flags.library_dirs] == [str(prefix / "lib")]


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed (scripts/setup.sh)")
def test_cmake_config_prefix_without_pkg_config_files(tmp_path):
    prefix = prefix_copy(tmp_path, with_pc=False, with_cmake=True)
    env = clean_env(tmp_path, "pkg-config", "cmake", "c++", "g++", "gcc", "make", "ld", "as",
                    CKPT_OFFLOAD_ABSL_PREFIX=str(prefix))
    flags = setup.find_abseil(env)
    assert flags.source == f"CKPT_OFFLOAD_ABSL_PREFIX {prefix} (CMake config)"
    assert REQUIRED_LIBS <= set(flags.libraries)
    libdir = prefix / "lib/x86_64-linux-gnu"
    assert set(flags.libraries) <= {p.name[3:].split(".so")[0] for p in libdir.glob("libabsl_*")}
    assert [os.path.realpath(d) for d in flags.library_dirs] == [str(libdir)]
    assert [os.path.realpath(d) for d in flags.include_dirs] == [str(prefix / "include")]


def test_no_abseil_anywhere_names_what_to_install(tmp_path):
    env = clean_env(tmp_path, "pkg-config")  # pkg-config sees an empty directory; no cmake
    with pytest.raises(setup.AbseilNotFound) as error:
        setup.find_abseil(env)
    message = str(error.value)
    for expected in ("abseil (C++) not found", "pkg-config", "absl_status was not found",
                     "CMake config: cmake is not installed",
                     "sudo apt-get install libabsl-dev pkg-config",
                     "conda install -c conda-forge libabseil", "abseil-cpp",
                     "CKPT_OFFLOAD_ABSL_PREFIX=<prefix>"):
        assert expected in message, (expected, message)


def test_a_prefix_without_abseil_is_an_error_naming_it(tmp_path):
    empty = tmp_path / "not_abseil"
    (empty / "lib").mkdir(parents=True)
    env = clean_env(tmp_path, "pkg-config", CKPT_OFFLOAD_ABSL_PREFIX=str(empty))
    with pytest.raises(setup.AbseilNotFound, match=f"no abseil under CKPT_OFFLOAD_ABSL_PREFIX="
                                                   f"{empty}: no lib/pkgconfig"):
        setup.find_abseil(env)
    env["CKPT_OFFLOAD_ABSL_PREFIX"] = str(tmp_path / "missing")
    with pytest.raises(setup.AbseilNotFound, match="is not a directory"):
        setup.find_abseil(env)


def test_pip_wheel_stops_before_compiling_when_abseil_is_missing(tmp_path):
    src = tmp_path / "src"
    copy_build_files(src)
    env = clean_env(tmp_path, "pkg-config")
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation",
                             "--no-deps", "--no-index", "-w", str(tmp_path / "wheels"), str(src)],
                            env=env, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "ckpt_offload build: abseil (C++) not found" in output, output
    assert "sudo apt-get install libabsl-dev" in output
    assert "conda install -c conda-forge libabseil" in output
    assert not (src / "build").exists()  # nothing was compiled
