"""For the tests that kill savers: trees that say which save wrote them, and the runner of the
``_crash.py`` program (no side effects on import)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

CRASH = Path(__file__).with_name("_crash.py")


def tree_number(i: int, size: int = 1 << 16) -> dict:
    """A tree whose every value says which save it came from (a mix of two saves would show)."""
    return {
        "layer": {"weight": torch.full((size,), float(i)), "bias": torch.full((size // 4,), -i)},
        "step": torch.tensor(i),
    }


def number_of(tree: dict) -> int:
    """Which ``tree_number`` ``tree`` is; fails unless every leaf agrees."""
    i = int(tree["step"])
    assert torch.equal(tree["layer"]["weight"], torch.full_like(tree["layer"]["weight"], i))
    assert torch.equal(tree["layer"]["bias"], torch.full_like(tree["layer"]["bias"], -i))
    return i


def crash(*scenarios: tuple) -> dict[str, list[dict]]:
    """Run scenarios of ``_crash.py`` in one fresh process (one torch import for all of them):
    ``{scenario: its JSON reports, in order}``."""
    words = [str(word) for scenario in scenarios for word in ("+", *scenario)][1:]
    done = subprocess.run(
        [sys.executable, str(CRASH), *words], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    reports: dict[str, list[dict]] = {}
    current: list[dict] = []
    for line in done.stdout.splitlines():
        report = json.loads(line)
        if "scenario" in report:
            current = reports.setdefault(report["scenario"], [])
        else:
            current.append(report)
    return reports
