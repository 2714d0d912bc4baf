"""Fixtures of the GPU tests."""

import pytest


@pytest.fixture
def llama_module_restored():
    """Liger's patch replaces functions of transformers' Llama module and methods of its
    classes, for every model built after it: they are put back after the test."""
    from transformers.models.llama import modeling_llama as module

    functions = dict(vars(module))
    methods = {cls: dict(vars(cls)) for cls in functions.values()
               if isinstance(cls, type) and cls.__module__ == module.__name__}
    yield
    for name, value in functions.items():
        setattr(module, name, value)
    for cls, attributes in methods.items():
        for name, value in attributes.items():
            if name not in ("__dict__", "__weakref__") and vars(cls).get(name) is not value:
                setattr(cls, name, value)
