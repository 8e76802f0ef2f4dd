"""Printing a suite's ratio table once its module has run, shown even without ``-s``."""

from __future__ import annotations

from typing import Any


def show(request: Any, lines: list[str]) -> None:
    """Print `lines` past pytest's output capture (``request`` is a fixture's)."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\n".join(lines))


def us(seconds: float) -> str:
    """A time as µs, or ms from 1 ms on."""
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} µs"
