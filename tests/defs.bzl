"""Test macros: pytest files as py_test targets."""

def py_pytest(name, srcs, deps = [], data = [], tags = [], size = "medium", **kwargs):
    """A py_test that runs pytest over `srcs`."""
    native.py_test(
        name = name,
        srcs = srcs + ["//tests:pytest_main.py"],
        main = "//tests:pytest_main.py",
        args = ["$(location %s)" % s for s in srcs],
        deps = deps,
        data = data,
        tags = tags,
        size = size,
        python_version = "PY3",
        **kwargs
    )

# The pip-made test venvs scripts/setup.sh makes (scripts/pip_venv.sh): folder under
# ~/.cache/ckpt_offload, and the lock that pins its packages.
TEST_VENVS = {
    "axolotl": ("axolotl-venv", "//requirements:axolotl-lock.txt"),
    "newest": ("newest-venv", "//requirements:newest-lock.txt"),
}

def venv_pytest(name, venv, srcs, pytest_args = [], data = [], size = "large", **kwargs):
    """An sh_test that runs pytest over `srcs` in the pip-made test venv `venv` (a key of
    TEST_VENVS), one intra-op thread; ckpt_offload is the one pip built in that venv."""
    folder, lock = TEST_VENVS[venv]
    native.sh_test(
        name = name,
        srcs = ["//tests:venv_pytest.sh"],
        args = [folder, "$(location %s)" % lock] + pytest_args + ["$(location %s)" % s for s in srcs],
        data = srcs + data + [lock, "//tests:pytest_main.py"],
        env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
        size = size,
        **kwargs
    )
