"""Finding the suites of a checkout and running each in a pytest subprocess of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .results import Skip, read_skips

QUICK_ENV = "MODSTATE_BENCH_QUICK"
# pytest-benchmark options for a short run: few rounds, little time per benchmark.
QUICK_OPTIONS = ("--benchmark-min-rounds=3", "--benchmark-max-time=0.05", "--benchmark-warmup=off")
CHECKOUT = Path(__file__).resolve().parents[2]  # benchmarks/report/suites.py


def find_benchmarks_dir(cwd: Path | None = None) -> Path | None:
    """The ``benchmarks/`` directory this report belongs to, else the one in ``cwd``."""
    for candidate in (CHECKOUT / "benchmarks", (cwd or Path.cwd()) / "benchmarks"):
        if candidate.is_dir() and suites_in(candidate):
            return candidate
    return None


def suites_in(directory: Path) -> list[Path]:
    return sorted({*directory.glob("*_test.py"), *directory.glob("test_*.py")})


def pytest_command(
    bench_dir: Path, json_path: Path, junit_path: Path, *, quick: bool, keyword: str | None
) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "pytest",
        str(bench_dir),
        "-q",
        "-p",
        "no:cacheprovider",
        "--benchmark-only",
        # one suite that fails to import must not take the others' figures with it
        "--continue-on-collection-errors",
        f"--benchmark-json={json_path}",
        f"--junitxml={junit_path}",
    ]
    if quick:
        command += QUICK_OPTIONS
    if keyword:
        command += ["-k", keyword]
    return command


def subprocess_env(quick: bool) -> dict[str, str]:
    env = dict(os.environ)
    # The suites must import the modstate of this checkout.
    source = str(CHECKOUT / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p)
    # The report names every skipped case with its reason (read_skips), so a skip is not
    # hidden there: the suite's rule that fails a run on an unlisted skip is lifted.
    env["MODSTATE_ALLOW_SKIPS"] = "1"
    if quick:
        env[QUICK_ENV] = "1"
    return env


@dataclass
class SuiteRun:
    suite: Path
    returncode: int
    data: dict[str, Any] | None
    skips: list[Skip]
    output: str
    seconds: float


def _read_json(path: Path) -> dict[str, Any] | None:
    # pytest-benchmark leaves an empty file when no benchmark was selected
    text = path.read_text() if path.exists() else ""
    return json.loads(text) if text.strip() else None


def collect(bench_dir: Path, keyword: str | None) -> tuple[dict[str, int], list[str]]:
    """How many benchmarks each suite holds (those ``-k`` selects), and the suites that fail to
    import, from one ``pytest --collect-only`` run."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        str(bench_dir),
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
        "--continue-on-collection-errors",
    ]
    if keyword:
        command += ["-k", keyword]
    done = subprocess.run(
        command,
        cwd=bench_dir.parent,
        env=subprocess_env(False),
        capture_output=True,
        text=True,
        check=False,
    )
    counts: dict[str, int] = {}
    broken: list[str] = []
    for line in done.stdout.splitlines():
        if "::" in line and not line.startswith(("ERROR", "FAILED")):
            suite = Path(line.split("::", 1)[0]).name
            counts[suite] = counts.get(suite, 0) + 1
        elif line.startswith("ERROR ") and line.split()[1].endswith(".py"):
            broken.append(Path(line.split()[1].split("::")[0]).name)
    return counts, broken


def run_suite(suite: Path, *, quick: bool, keyword: str | None) -> SuiteRun:
    """One suite in a pytest subprocess of its own, with its JSON results and skips."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        json_path = Path(scratch) / "pytest-benchmark.json"
        junit_path = Path(scratch) / "junit.xml"
        command = pytest_command(suite, json_path, junit_path, quick=quick, keyword=keyword)
        done = subprocess.run(
            command,
            cwd=suite.parent.parent,
            env=subprocess_env(quick),
            capture_output=True,
            text=True,
            check=False,
        )
        data = _read_json(json_path)
        skips = read_skips(junit_path)
    return SuiteRun(
        suite,
        done.returncode,
        data,
        skips,
        done.stdout + done.stderr,
        time.perf_counter() - started,
    )
