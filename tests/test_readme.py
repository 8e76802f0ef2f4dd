"""README.md runs as pasted: every ```python block, in order, in one namespace."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks() -> list[tuple[int, str]]:
    """``(line number, code)`` of every ```python block of README.md, in order."""
    text = README.read_text()
    return [
        (text.count("\n", 0, match.start()) + 2, match.group(1)) for match in BLOCK.finditer(text)
    ]


def test_the_readme_has_python_blocks():
    assert len(python_blocks()) >= 10


@pytest.mark.distributed  # one block starts two gloo ranks
def test_every_python_block_runs_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the checkpoint block writes files
    namespace: dict = {"__name__": "__readme__"}
    for line, code in python_blocks():
        try:
            exec(compile(code, f"README.md:{line}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"the README block at line {line} fails: {error!r}") from error
