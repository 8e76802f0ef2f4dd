"""The examples in the docstrings run and print what they say."""

import doctest
import importlib
import inspect
import pkgutil

import pytest
import torch

import modstate


def _with_examples() -> list[str]:
    names = [
        info.name
        for info in pkgutil.iter_modules(modstate.__path__)
        if info.name not in {"__main__", "tree"}  # tree's examples run in tests/test_tree.py
    ]
    return [
        name for name in ["modstate", *sorted(names)] if ">>>" in inspect.getsource(_module(name))
    ]


def _module(name: str):
    return modstate if name == "modstate" else importlib.import_module(f"modstate.{name}")


@pytest.mark.parametrize("name", _with_examples())
def test_docstring_examples(name):
    module = _module(name)
    results = doctest.testmod(
        module,
        extraglobs={"ms": modstate, "modstate": modstate, "torch": torch},
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        report=False,
    )
    assert results.attempted > 0
    assert results.failed == 0, f"{results.failed} of {results.attempted} examples failed"
