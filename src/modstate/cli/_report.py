"""``python -m modstate bench``: run every benchmark suite and show modstate beside its peers.

The suites live in a source checkout's ``benchmarks/`` folder (a wheel does not ship them); each
runs under pytest-benchmark in a subprocess of its own, with a progress line per suite. Each
benchmark names its case in ``benchmark.group`` and its implementation in
``benchmark.extra_info["impl"]`` (``"modstate"``, or the peer's name; an impl starting with
``"baseline"`` is the work every implementation does anyway, such as the plain forward); suites
using the ``compare`` fixture time all implementations of a case in interleaved rounds and store
them in ``extra_info["interleaved"]``. The report pairs the ``modstate`` entry of each case with
every peer and prints, per case, each one's median time and spread (half the interquartile range,
in percent of the median) and the ratio modstate / peer (below 1: modstate is faster). With a
baseline in the case it also gives the ratio of overheads, (modstate - baseline) / (peer -
baseline). The table fits 100 columns; ``--wide`` puts each peer on one line with its case.

Written to ``--out`` (default ``bench-results/``): ``bench.txt`` (the table), ``bench.json``
(every figure and ratio, plus each benchmark's statistics) and ``bench.png`` (the ratios as bars
drawn from 1.0 on a log axis; needs matplotlib). Peers that are not installed are listed as notes.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MODSTATE = "modstate"
BASELINE_PREFIX = "baseline"
QUICK_ENV = "MODSTATE_BENCH_QUICK"
# pytest-benchmark options for a short run: few rounds, little time per benchmark.
QUICK_OPTIONS = ("--benchmark-min-rounds=3", "--benchmark-max-time=0.05", "--benchmark-warmup=off")


@dataclass
class PeerResult:
    impl: str
    median_s: float
    ratio: float | None  # None when no modstate entry ran in the group
    test: str
    overhead_ratio: float | None = None
    spread: float | None = None  # half the interquartile range, as a fraction of the median
    # the ratio's range from the quartiles: modstate's q1 / peer's q3 .. modstate's q3 / peer's q1
    ratio_low: float | None = None
    ratio_high: float | None = None


@dataclass
class CaseResult:
    case: str
    modstate_s: float | None
    modstate_test: str | None
    peers: list[PeerResult] = field(default_factory=list)
    baseline: str | None = None
    baseline_s: float | None = None
    modstate_spread: float | None = None
    baseline_spread: float | None = None


@dataclass
class Skip:
    test: str
    reason: str

    @property
    def note(self) -> str:
        missing = "could not import" in self.reason or "No module named" in self.reason
        return f"{self.test}: skipped ({'not installed: ' if missing else ''}{self.reason})"


@dataclass
class Report:
    cases: list[CaseResult]
    skipped: list[Skip]
    notes: list[str]


# ---------------------------------------------------------------------------------------------
# finding and running the suites


def find_benchmarks_dir(cwd: Path | None = None) -> Path | None:
    """The ``benchmarks/`` directory of the source checkout modstate runs from, else of ``cwd``."""
    package_root = Path(__file__).resolve().parents[3]  # src/modstate/cli/_report.py
    for candidate in (package_root / "benchmarks", (cwd or Path.cwd()) / "benchmarks"):
        if candidate.is_dir() and _suites(candidate):
            return candidate
    return None


def _suites(directory: Path) -> list[Path]:
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


def _subprocess_env(quick: bool) -> dict[str, str]:
    env = dict(os.environ)
    # The suites must import the modstate this report belongs to.
    source = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p)
    if quick:
        env[QUICK_ENV] = "1"
    return env


# ---------------------------------------------------------------------------------------------
# reading the results


def build_report(data: dict[str, Any], skipped: list[Skip] | None = None) -> Report:
    """Pair each group's modstate entry with its peers, from pytest-benchmark's JSON."""
    groups: dict[str, dict[str, dict[str, Any]]] = {}
    notes: list[str] = []
    for bench in data.get("benchmarks", []):
        for peer in (bench.get("extra_info") or {}).get("missing", []):
            notes.append(f"{bench.get('group')}: {peer} is not installed, left out")
    for bench in _expand_interleaved(data.get("benchmarks", [])):
        group = bench.get("group") or bench.get("name", "?")
        impl = (bench.get("extra_info") or {}).get("impl")
        if not impl:
            notes.append(f"{bench.get('name')}: no extra_info['impl'], left out")
            continue
        if impl in groups.setdefault(group, {}):
            notes.append(f"{group}: two entries for {impl!r}, kept {groups[group][impl]['name']}")
            continue
        groups[group][impl] = bench
    cases = []
    for group, entries in groups.items():
        own = entries.get(MODSTATE)
        baselines = [impl for impl in entries if impl.startswith(BASELINE_PREFIX)]
        case = CaseResult(
            group,
            _median(own) if own else None,
            own["name"] if own else None,
            modstate_spread=_spread(own) if own else None,
        )
        if baselines:
            case.baseline = baselines[0]
            case.baseline_s = _median(entries[baselines[0]])
            case.baseline_spread = _spread(entries[baselines[0]])
        if own is None:
            notes.append(f"{group}: no modstate entry ran, nothing to compare")
        for impl, bench in entries.items():
            if impl == MODSTATE or impl.startswith(BASELINE_PREFIX):
                continue
            peer_s = _median(bench)
            ratio = None if case.modstate_s is None else case.modstate_s / peer_s
            peer = PeerResult(impl, peer_s, ratio, bench["name"], spread=_spread(bench))
            if own is not None:
                low, high = _quartiles(own), _quartiles(bench)
                if low and high and high[0] > 0 and high[1] > 0:
                    peer.ratio_low, peer.ratio_high = low[0] / high[1], low[1] / high[0]
            if (
                case.modstate_s is not None
                and case.baseline_s is not None
                and peer_s > case.baseline_s
            ):
                peer.overhead_ratio = (case.modstate_s - case.baseline_s) / (
                    peer_s - case.baseline_s
                )
            case.peers.append(peer)
        cases.append(case)
    return Report(cases, list(skipped or []), notes)


def _expand_interleaved(benchmarks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per implementation: a ``compare`` benchmark times several, interleaved."""
    entries = []
    for bench in benchmarks:
        timed = (bench.get("extra_info") or {}).get("interleaved")
        if not timed:
            entries.append(bench)
            continue
        for impl, stats in timed.items():
            entries.append(
                {**bench, "extra_info": {**bench["extra_info"], "impl": impl}, "stats": stats}
            )
    return entries


def _median(bench: dict[str, Any]) -> float:
    return float(bench["stats"]["median"])


def _quartiles(bench: dict[str, Any]) -> tuple[float, float] | None:
    stats = bench.get("stats") or {}
    if stats.get("q1") is None or stats.get("q3") is None:
        return None
    return float(stats["q1"]), float(stats["q3"])


def _spread(bench: dict[str, Any]) -> float | None:
    """Half the interquartile range as a fraction of the median (0.03: about ±3%)."""
    quartiles, median = _quartiles(bench), _median(bench)
    if quartiles is None or median <= 0:
        return None
    return (quartiles[1] - quartiles[0]) / 2 / median


def read_skips(junit_path: Path) -> list[Skip]:
    """The skipped tests of a pytest ``--junitxml`` file, with their reasons."""
    if not junit_path.exists():
        return []
    skips = []
    for testcase in ElementTree.parse(junit_path).iter("testcase"):
        skipped = testcase.find("skipped")
        if skipped is not None:
            name = f"{Path(testcase.get('classname', '').replace('.', '/')).name}::{testcase.get('name')}"
            reason = (skipped.get("message") or "").removeprefix("Skipped: ").strip()
            skips.append(Skip(name, reason or "skipped"))
    return skips


# ---------------------------------------------------------------------------------------------
# showing them


def format_seconds(seconds: float) -> str:
    """``1.5e-6 -> "1.5 us"``: three significant digits in ns, us, ms or s."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        if seconds >= scale or unit == "ns":
            value = seconds / scale
            text = f"{value:.3g}"
            return f"{value:.0f} {unit}" if "e" in text else f"{text} {unit}"
    raise AssertionError("unreachable")


TABLE_WIDTH = 100
IMPL_WIDTH = 36


def format_spread(spread: float | None) -> str:
    """``0.034 -> "±3%"``; ``"-"`` when unknown."""
    if spread is None:
        return "-"
    return f"±{spread * 100:.0f}%" if spread >= 0.005 else "±0%"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _title(report: Report, has_overheads: bool) -> list[str]:
    lines = [
        "Median time per call over interleaved rounds; ± is half the interquartile range.",
        "ratio = modstate / peer (below 1.00: modstate is faster).",
    ]
    if has_overheads:
        lines.append("overhead = (modstate - baseline) / (peer - baseline).")
    return lines


def _notes(report: Report) -> list[str]:
    notes = [skip.note for skip in report.skipped] + report.notes
    return ["", "Notes:", *(f"  {note}" for note in notes)] if notes else []


def format_table(report: Report, *, wide: bool = False) -> str:
    """The side-by-side report: each case, then modstate, its baseline and each peer under it,
    in 100 columns; ``wide=True``: one line per (case, peer), however long, then the notes."""
    has_overheads = any(p.overhead_ratio is not None for c in report.cases for p in c.peers)
    if wide:
        return _format_wide(report, has_overheads)
    header = f"  {'implementation':<{IMPL_WIDTH}}  {'time':>9}  {'spread':>6}  {'ratio':>6}"
    if has_overheads:
        header += f"  {'overhead':>8}"
    out = [*_title(report, has_overheads), "", header, "-" * len(header)]

    def line(impl: str, seconds: float | None, spread: float | None, *rest: str) -> str:
        time = "-" if seconds is None else format_seconds(seconds)
        text = f"  {_clip(impl, IMPL_WIDTH):<{IMPL_WIDTH}}  {time:>9}  {format_spread(spread):>6}"
        for cell, width in zip(rest, (6, 8)):
            text += f"  {cell:>{width}}"
        return text.rstrip()

    for case in report.cases:
        out.append(_clip(case.case, TABLE_WIDTH))
        out.append(line("modstate", case.modstate_s, case.modstate_spread))
        if case.baseline is not None:
            out.append(line(case.baseline, case.baseline_s, case.baseline_spread))
        for peer in case.peers:
            ratio = "-" if peer.ratio is None else f"{peer.ratio:.2f}"
            overhead = "-" if peer.overhead_ratio is None else f"{peer.overhead_ratio:.2f}"
            rest = (ratio, overhead) if has_overheads else (ratio,)
            out.append(line(peer.impl, peer.median_s, peer.spread, *rest))
        if not case.peers:
            out.append("  (no peer ran)")
    return "\n".join(out + _notes(report))


def _format_wide(report: Report, has_overheads: bool) -> str:
    header = ("case", "modstate", "±", "peer", "peer time", "±", "ratio")
    if has_overheads:
        header += ("overhead",)
    rows: list[tuple[str, ...]] = []
    for case in report.cases:
        own = "-" if case.modstate_s is None else format_seconds(case.modstate_s)
        lines: list[tuple[str, ...]] = []
        if case.baseline is not None and case.baseline_s is not None:
            lines.append(
                (
                    "",
                    "",
                    "",
                    case.baseline,
                    format_seconds(case.baseline_s),
                    format_spread(case.baseline_spread),
                    "",
                )
            )
        for peer in case.peers:
            line: tuple[str, ...] = (
                "",
                "",
                "",
                peer.impl,
                format_seconds(peer.median_s),
                format_spread(peer.spread),
                "-" if peer.ratio is None else f"{peer.ratio:.2f}",
            )
            if has_overheads:
                line += ("-" if peer.overhead_ratio is None else f"{peer.overhead_ratio:.2f}",)
            lines.append(line)
        if not lines:
            lines.append(("", "", "", "(no peer ran)", "", "", ""))
        lines[0] = (case.case, own, format_spread(case.modstate_spread), *lines[0][3:])
        rows.extend(lines)
    rows = [row + ("",) * (len(header) - len(row)) for row in rows]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = {1, 2, 4, 5, 6, 7}

    def render(row: tuple[str, ...]) -> str:
        cells = [
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths))
        ]
        return "  ".join(cells).rstrip()

    rule = "-" * len(render(header))
    out = [*_title(report, has_overheads), "", render(header), rule, *map(render, rows)]
    return "\n".join(out + _notes(report))


def report_json(report: Report, data: dict[str, Any], *, quick: bool) -> dict[str, Any]:
    machine = data.get("machine_info") or {}
    return {
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "statistic": "median seconds per call",
        "ratio": "modstate / peer",
        "quick": quick,
        "machine": {
            "node": machine.get("node"),
            "python": machine.get("python_version"),
            "cpu": (machine.get("cpu") or {}).get("brand_raw"),
            "cpu_count": (machine.get("cpu") or {}).get("count"),
        },
        "versions": _versions("modstate", "torch", "optree", "tensordict", "pytest-benchmark"),
        "cases": [asdict(case) for case in report.cases],
        "skipped": [asdict(skip) for skip in report.skipped],
        "notes": report.notes,
        "benchmarks": [
            {
                "name": bench.get("name"),
                "fullname": bench.get("fullname"),
                "group": bench.get("group"),
                "impl": (bench.get("extra_info") or {}).get("impl"),
                "stats": {
                    key: bench.get("stats", {}).get(key)
                    for key in ("min", "max", "mean", "median", "stddev", "rounds", "iterations")
                },
            }
            for bench in data.get("benchmarks", [])
        ],
    }


def _versions(*distributions: str) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in distributions:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def footer_line(data: dict[str, Any], *, quick: bool, when: datetime.datetime | None = None) -> str:
    """``"full run · torch 2.13.0 · Intel Xeon, 2 CPUs · 2026-12-02"``: what the figures are from."""
    machine = data.get("machine_info") or {}
    cpu = machine.get("cpu") or {}
    where = cpu.get("brand_raw") or machine.get("processor") or machine.get("machine") or "?"
    if cpu.get("count"):
        where += f", {cpu['count']} CPUs"
    when = when or datetime.datetime.now(datetime.timezone.utc)
    torch_version = _versions("torch")["torch"] or "?"
    return " · ".join(
        (
            "quick run" if quick else "full run",
            f"torch {torch_version}",
            where,
            when.strftime("%Y-%m-%d"),
        )
    )


FASTER, SLOWER = "tab:green", "tab:red"


def plot_ratios(report: Report, path: Path, *, footer: str = "") -> str | None:
    """Write the chart of ratios; returns why not when it cannot (matplotlib missing).

    One bar per (case, peer), drawn from 1.0 to the ratio on a log axis, so that "2x faster" and
    "2x slower" are bars of the same length on either side; green where modstate is faster, red
    where it is slower; a whisker spans the ratio's range from the quartiles of both sides.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return "bench.png not written: matplotlib is not installed (pip install 'modstate[bench]')"
    bars = [
        (f"{case.case}  vs {peer.impl}", peer)
        for case in report.cases
        for peer in case.peers
        if peer.ratio is not None
    ]
    if not bars:
        return "bench.png not written: no case has both modstate and a peer"
    labels = [label for label, _ in reversed(bars)]
    peers = [peer for _, peer in reversed(bars)]
    ratios = [float(peer.ratio or 1.0) for peer in peers]
    figure, axes = plt.subplots(figsize=(13, 1.9 + 0.32 * len(bars)))
    colors = [FASTER if ratio <= 1 else SLOWER for ratio in ratios]
    rows = range(len(ratios))
    axes.barh(rows, [ratio - 1 for ratio in ratios], left=1.0, color=colors, height=0.7)
    for row, peer in zip(rows, peers):
        if peer.ratio_low is not None and peer.ratio_high is not None:
            axes.plot([peer.ratio_low, peer.ratio_high], [row, row], color="black", linewidth=0.8)
    axes.set_yticks(list(rows), labels, fontsize=8)
    axes.axvline(1.0, color="black", linewidth=1)
    axes.set_xscale("log")
    extremes = ratios + [p.ratio_low or 1.0 for p in peers] + [p.ratio_high or 1.0 for p in peers]
    low = min(min(extremes), 1.0) / 1.8
    high = max(max(extremes), 1.0) * 1.8
    axes.set_xlim(low, high)
    ticks = [
        t
        for t in (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5, 10, 20, 50)
        if low <= t <= high
    ]
    axes.minorticks_off()
    axes.set_xticks(ticks, [f"{t:g}" for t in ticks])
    for row, peer, ratio in zip(rows, peers, ratios):
        # the label sits past the bar's end and past its whisker
        if ratio > 1:
            x, align = max(ratio, peer.ratio_high or ratio), "left"
        else:
            x, align = min(ratio, peer.ratio_low or ratio), "right"
        axes.text(x, row, f" {ratio:.2f} ", va="center", ha=align, fontsize=7)
    axes.set_xlabel("modstate time / peer time (median over interleaved rounds, log scale)")
    axes.set_title("modstate vs peers: bars from 1.0; left of the line, modstate is faster")
    axes.legend(
        handles=[
            Patch(color=FASTER, label="modstate faster (ratio < 1)"),
            Patch(color=SLOWER, label="modstate slower (ratio > 1)"),
            plt.Line2D([], [], color="black", linewidth=0.8, label="range from the quartiles"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
    )
    if footer:
        figure.text(0.01, 0.005, footer, fontsize=8, color="dimgray", ha="left", va="bottom")
    figure.tight_layout(rect=(0, 0.03 if footer else 0, 1, 1))
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return None


# ---------------------------------------------------------------------------------------------
# the command


NEEDS_CHECKOUT = (
    "modstate bench needs a source checkout: the suites live in its benchmarks/ folder, which "
    "the installed package does not ship. Run it from a clone of the repository, after "
    "pip install -e '.[bench]'."
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m modstate bench",
        description="Run the benchmark suites and print modstate beside each peer. "
        + NEEDS_CHECKOUT,
    )
    parser.add_argument("--quick", action="store_true", help="few rounds per benchmark")
    parser.add_argument(
        "--out",
        default="bench-results",
        help="where bench.txt, bench.json and bench.png go (default bench-results/)",
    )
    parser.add_argument("-k", dest="keyword", help="pytest -k expression to run only some cases")
    parser.add_argument(
        "--wide", action="store_true", help="one line per case and peer, wider than 100 columns"
    )
    parser.add_argument(
        "--benchmarks-dir", type=Path, help="the suites' directory (default: found automatically)"
    )
    return parser


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _writable_dir(path: Path) -> str | None:
    """Why ``path`` cannot take the results, or None when it can (it is created if needed)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as error:
        return f"modstate bench: cannot write to --out {str(path)!r}: {error.strerror or error}"
    return None


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
        env=_subprocess_env(False),
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
            env=_subprocess_env(quick),
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


def main(argv: list[str] | None = None) -> int:
    """Run the suites, print the table, write ``bench.txt``, ``bench.json`` and ``bench.png``.

    Exit status: 0 when every benchmark ran, 1 when some failed, 2 for a usage error (no suites,
    nothing matching ``-k``, an ``--out`` that cannot be written), each said in one line.
    """
    args = _parser().parse_args(argv)
    bench_dir = args.benchmarks_dir or find_benchmarks_dir()
    if bench_dir is None or not bench_dir.is_dir() or not _suites(bench_dir):
        where = bench_dir if bench_dir is not None else Path.cwd() / "benchmarks"
        print(f"{NEEDS_CHECKOUT} (no benchmark suites in {where})", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    why_not = _writable_dir(out_dir)
    if why_not:
        print(why_not, file=sys.stderr)
        return 2
    counts, broken = collect(bench_dir, args.keyword)
    suites = [suite for suite in _suites(bench_dir) if suite.name in counts or suite.name in broken]
    if not suites:
        selection = f"matches -k {args.keyword!r}" if args.keyword else f"is in {bench_dir}/"
        print(f"modstate bench: no benchmark {selection}", file=sys.stderr)
        return 2
    mode = "quick" if args.quick else "full"
    total = sum(counts.values())
    print(
        f"modstate bench: {_count(total, 'benchmark')} in {_count(len(suites), 'suite')} "
        f"from {bench_dir}/ "
        f"({mode} run)",
        flush=True,
    )
    runs = []
    for index, suite in enumerate(suites, start=1):
        print(
            f"  [{index}/{len(suites)}] {suite.name} ({counts.get(suite.name, 0)}) ...",
            end=" ",
            flush=True,
        )
        run = run_suite(suite, quick=args.quick, keyword=args.keyword)
        status = "done" if run.returncode in (0, 5) else f"pytest exited with {run.returncode}"
        print(f"{status} in {run.seconds:.0f} s", flush=True)
        runs.append(run)
    data: dict[str, Any] = {"benchmarks": []}
    for run in runs:
        if run.data:
            data.setdefault("machine_info", run.data.get("machine_info"))
            data["benchmarks"].extend(run.data.get("benchmarks", []))
    report = build_report(data, [skip for run in runs for skip in run.skips])
    failed = False
    for run in runs:
        if run.returncode in (0, 5):
            continue
        failed = True
        lines = [line for line in run.output.splitlines() if line.startswith(("FAILED", "ERROR"))]
        report.notes.append(f"{run.suite.name}: pytest exited with {run.returncode}")
        report.notes.extend(lines[:20] or run.output.strip().splitlines()[-5:])
    table = format_table(report, wide=args.wide)
    print()
    print(table)
    footer = footer_line(data, quick=args.quick)
    (out_dir / "bench.txt").write_text(
        format_table(report, wide=False) + f"\n\n{footer}\n", encoding="utf-8"
    )
    (out_dir / "bench.json").write_text(
        json.dumps(report_json(report, data, quick=args.quick), indent=2)
    )
    why_no_plot = plot_ratios(report, out_dir / "bench.png", footer=footer)
    written = "bench.txt and bench.json" if why_no_plot else "bench.txt, bench.json and bench.png"
    print(f"\n{footer}\nwrote {written} to {out_dir}/")
    if why_no_plot:
        print(why_no_plot)
    if not report.cases:
        print("modstate bench: no benchmark produced figures", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
