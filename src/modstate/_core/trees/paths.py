"""Dotted paths, and the globs that select leaves by them: one join, one glob rule.

A path is the dotted string of a leaf's keys (``"encoder.layers.0.linear1.weight"``), as
``state_dict`` names it. A glob is an ``fnmatch`` pattern on such paths (case-sensitive, ``*``
crosses dots), and a pattern that names a subtree selects all of it: a path matches when it or
one of its enclosing subtrees' paths does. ``modstate.tree.select`` / ``exclude`` and
``modstate.optim.masked`` select leaves by this one rule.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Iterable
from typing import Any

import torch


def dotted(keys: Iterable[Any]) -> str:
    """The dotted path of ``keys`` (``"<root>"`` for none)."""
    return ".".join(str(key) for key in keys) or "<root>"


@functools.lru_cache(maxsize=64)
def _compiled(patterns: tuple[str, ...]) -> re.Pattern[str]:
    if not patterns:
        return re.compile(r"(?!)")  # matches nothing
    return re.compile("|".join(fnmatch.translate(pattern) for pattern in patterns))


# A constant of the trace: torch.compile runs it while tracing (on the constant patterns and
# path) instead of tracing into `re`, which it cannot; the result depends on strings only.
@torch.compiler.assume_constant_result
def glob_matches(patterns: tuple[str, ...], path: str) -> bool:
    """Whether ``path`` itself matches one of ``patterns`` (a tuple of strings, checked by the
    caller, whose message names its own function)."""
    return _compiled(patterns).match(path) is not None


def glob_selects(patterns: tuple[str, ...], path: str) -> bool:
    """Whether ``path`` or one of its enclosing subtrees' paths matches one of ``patterns``."""
    parts = path.split(".")
    return any(glob_matches(patterns, ".".join(parts[:end])) for end in range(1, len(parts) + 1))
