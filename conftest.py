"""The checkout's rule on skips, for every pytest run in it (tests/ and benchmarks/ alike).

pytest counts a skipped test as green, so a missing extra, a broken install or an upstream release
that breaks a zoo model would hide among the passes. Each skip this checkout may show is listed in
tests/allowed_skips.toml with the reason it is expected; any other skip (or expected failure) fails
the run, and the summary names it with its reason. ``MODSTATE_ALLOW_SKIPS=1`` lifts the rule, for a
platform that lacks what some tests need (``os.fork``, ``/proc``); CI never sets it.
"""

from __future__ import annotations

import fnmatch
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ALLOWED_SKIPS = Path("tests", "allowed_skips.toml")
LIFT_THE_RULE = "MODSTATE_ALLOW_SKIPS"

pytest_plugins = ("pytester",)  # tests/test_skip_rule.py runs this rule on a scratch project


@dataclass(frozen=True)
class AllowedSkip:
    """A skip that may show: ``test`` is a node id or a glob over node ids, and the skip's
    message must contain ``reason``."""

    test: str
    reason: str

    def allows(self, test: str, message: str) -> bool:
        return fnmatch.fnmatchcase(test, self.test) and self.reason in message


def read_allowed(path: Path) -> list[AllowedSkip]:
    """The ``[[skip]]`` entries of ``path`` (none when it does not exist)."""
    if not path.exists():
        return []
    entries = tomllib.loads(path.read_text()).get("skip", [])
    return [AllowedSkip(entry["test"], entry["reason"]) for entry in entries]


def skip_message(report: pytest.TestReport | pytest.CollectReport) -> str:
    if isinstance(report, pytest.TestReport) and hasattr(report, "wasxfail"):
        return f"expected failure: {report.wasxfail}"
    if isinstance(report.longrepr, tuple):  # (file, line, "Skipped: <reason>")
        return report.longrepr[2].removeprefix("Skipped: ")
    return str(report.longrepr)


class SkipRule:
    """Records each skip that no entry allows; fails the session on any."""

    def __init__(self, allowed: list[AllowedSkip]) -> None:
        self.allowed = allowed
        self.unexpected: list[str] = []

    def _check(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if not report.skipped:
            return
        message = skip_message(report)
        if not any(entry.allows(report.nodeid, message) for entry in self.allowed):
            self.unexpected.append(f"{report.nodeid}: {message}")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._check(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._check(report)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.unexpected and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.unexpected:
            return
        terminalreporter.section("unexpected skips", red=True)
        for line in self.unexpected:
            terminalreporter.line(line)
        terminalreporter.line(
            f"{len(self.unexpected)} skip(s) not allowed by {ALLOWED_SKIPS}: the run fails. Install"
            " what is missing (README's test command installs every extra), or, if the skip is"
            f" expected, add it there with its reason. {LIFT_THE_RULE}=1 lifts the rule.",
            red=True,
        )


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(LIFT_THE_RULE) == "1":
        return
    rule = SkipRule(read_allowed(config.rootpath / ALLOWED_SKIPS))
    config.pluginmanager.register(rule, "modstate-skip-rule")
