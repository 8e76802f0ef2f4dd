"""docs/coming-from.md runs as pasted: every ```python block, in order, in one namespace.

Its tensordict and torchopt blocks import those packages (the ``bench`` extra, which CI
installs): without them this test fails, it does not skip."""

from pathlib import Path

from test_readme import python_blocks

PAGE = Path(__file__).resolve().parent.parent / "docs" / "coming-from.md"


def test_the_page_has_a_block_for_each_library():
    codes = [code for _, code in python_blocks(PAGE)]
    for used in (
        "torch.func.functional_call",
        "torch.func.stack_module_state",
        "TensorDict.from_module",
        "to_module",
        "torchopt.adam",
        "AveragedModel",
    ):
        assert any(used in code for code in codes), f"no block uses {used}"


def test_every_python_block_runs_in_order():
    namespace: dict = {"__name__": "__coming_from__"}
    for line, code in python_blocks(PAGE):
        try:
            exec(compile(code, f"docs/coming-from.md:{line}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"the block at line {line} fails: {error!r}") from error
