"""Shared set-up for the benchmark suites.

Run them with ``python -m pytest benchmarks/`` (or ``python -m modstate bench`` for the
side-by-side report). Every benchmark sets ``benchmark.group`` to its case and
``benchmark.extra_info["impl"]`` to ``"modstate"`` or the peer's name, so that the report can pair
them; within a group exactly one impl is ``"modstate"``.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import modstate  # noqa: F401
except ImportError:
    # Running from a source checkout that is not installed: use the package next door.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
