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
