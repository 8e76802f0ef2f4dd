"""Docs pages with runnable blocks run as pasted: every ```python block of a page, in order, in one
namespace (the README's are in test_readme.py, whose block reader this reuses).

docs/coming-from.md's tensordict and torchopt blocks import those packages (the ``bench`` extra,
which CI installs): without them its test fails, it does not skip."""

from pathlib import Path

import pytest

from test_readme import python_blocks

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = ["coming-from.md", "randomness.md"]


def test_coming_from_has_a_block_for_each_library():
    codes = [code for _, code in python_blocks(DOCS / "coming-from.md")]
    for used in (
        "torch.func.functional_call",
        "torch.func.stack_module_state",
        "TensorDict.from_module",
        "to_module",
        "torchopt.adam",
        "AveragedModel",
    ):
        assert any(used in code for code in codes), f"no block uses {used}"


@pytest.mark.parametrize("page", PAGES)
def test_every_python_block_runs_in_order(page):
    blocks = python_blocks(DOCS / page)
    assert blocks, f"docs/{page} has no python block"
    namespace: dict = {"__name__": "__docs__"}
    for line, code in blocks:
        try:
            exec(compile(code, f"docs/{page}:{line}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"the block at docs/{page}:{line} fails: {error!r}") from error
