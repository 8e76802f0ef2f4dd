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
        for info in pkgutil.walk_packages(modstate.__path__, prefix="modstate.")
        if info.name != "modstate.__main__"
    ]
    return [
        name for name in ["modstate", *sorted(names)] if ">>>" in inspect.getsource(_module(name))
    ]


def _module(name: str):
    return importlib.import_module(name)


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
