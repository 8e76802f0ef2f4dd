"""README.md runs as pasted: every ```python block, in order, in one namespace, and leaves nothing
behind in the directory it runs in."""

import re
import tempfile
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: Path = README) -> list[tuple[int, str]]:
    """``(line number, code)`` of every ```python block of ``page`` (README.md), in order."""
    text = page.read_text()
    return [
        (text.count("\n", 0, match.start()) + 2, match.group(1)) for match in BLOCK.finditer(text)
    ]


def test_the_readme_has_python_blocks():
    assert len(python_blocks()) >= 10


@pytest.mark.distributed  # one block starts two gloo ranks
def test_every_python_block_runs_in_order_and_leaves_nothing_behind(tmp_path, monkeypatch):
    workdir, scratch = tmp_path / "workdir", tmp_path / "scratch"
    workdir.mkdir()
    scratch.mkdir()
    monkeypatch.chdir(workdir)
    # where the blocks' tempfile.mkdtemp() directories go (and pytest removes them)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    namespace: dict = {"__name__": "__readme__"}
    for line, code in python_blocks():
        try:
            exec(compile(code, f"README.md:{line}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"the README block at line {line} fails: {error!r}") from error
    left = sorted(path.name for path in workdir.iterdir())
    assert left == [], f"the README's blocks left files in the working directory: {left}"
    assert any(scratch.iterdir())  # the checkpoints went to temporary directories
