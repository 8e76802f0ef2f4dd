"""``python -m modstate bench``: run every benchmark suite and show modstate beside its peers.

The suites in the repository's ``benchmarks/`` directory run under pytest-benchmark in a
subprocess. Each benchmark names its case in ``benchmark.group`` and its implementation in
``benchmark.extra_info["impl"]`` (``"modstate"``, or the peer's name; an impl starting with
``"baseline"`` is the work every implementation does anyway, such as the plain forward). The
report pairs the ``modstate`` entry of each group with every peer and prints, per case, the median
time of each and the ratio modstate / peer (below 1: modstate is faster). With a baseline in the
group it also gives the ratio of overheads, (modstate - baseline) / (peer - baseline).

Written to ``--out`` (default ``bench-results/``): ``bench.json`` (every figure and ratio, plus
each benchmark's statistics) and ``bench.png`` (the ratios as bars, a line at 1.0; needs
matplotlib). Peers that are not installed skip their tests; they are listed as notes.
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


@dataclass
class CaseResult:
    case: str
    modstate_s: float | None
    modstate_test: str | None
    peers: list[PeerResult] = field(default_factory=list)
    baseline: str | None = None
    baseline_s: float | None = None


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
        )
        if baselines:
            case.baseline = baselines[0]
            case.baseline_s = _median(entries[baselines[0]])
        if own is None:
            notes.append(f"{group}: no modstate entry ran, nothing to compare")
        for impl, bench in entries.items():
            if impl == MODSTATE or impl.startswith(BASELINE_PREFIX):
                continue
            peer_s = _median(bench)
            ratio = None if case.modstate_s is None else case.modstate_s / peer_s
            peer = PeerResult(impl, peer_s, ratio, bench["name"])
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


def format_table(report: Report) -> str:
    """The side-by-side table: one line per (case, peer), then the notes."""
    header = ("case", "modstate", "peer", "peer time", "ratio")
    has_overheads = any(p.overhead_ratio is not None for c in report.cases for p in c.peers)
    if has_overheads:
        header += ("overhead ratio",)
    rows: list[tuple[str, ...]] = []
    for case in report.cases:
        own = "-" if case.modstate_s is None else format_seconds(case.modstate_s)
        lines: list[tuple[str, ...]] = []
        if case.baseline is not None and case.baseline_s is not None:
            lines.append(("", "", case.baseline, format_seconds(case.baseline_s), ""))
        for peer in case.peers:
            line: tuple[str, ...] = (
                "",
                "",
                peer.impl,
                format_seconds(peer.median_s),
                "-" if peer.ratio is None else f"{peer.ratio:.2f}",
            )
            if has_overheads:
                line += ("-" if peer.overhead_ratio is None else f"{peer.overhead_ratio:.2f}",)
            lines.append(line)
        if not lines:
            lines.append(("", "", "(no peer ran)", "", ""))
        lines[0] = (case.case, own, *lines[0][2:])
        rows.extend(lines)
    rows = [row + ("",) * (len(header) - len(row)) for row in rows]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = {1, 3, 4, 5}

    def render(row: tuple[str, ...]) -> str:
        cells = [
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths))
        ]
        return "  ".join(cells).rstrip()

    title = "Median time per call; ratio = modstate / peer (below 1.00: modstate is faster)."
    if has_overheads:
        title += "\nOverhead ratio = (modstate - baseline) / (peer - baseline)."
    rule = "-" * len(render(header))
    out = [title, "", render(header), rule, *map(render, rows)]
    notes = [skip.note for skip in report.skipped] + report.notes
    if notes:
        out += ["", "Notes:", *(f"  {note}" for note in notes)]
    return "\n".join(out)


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


def plot_ratios(report: Report, path: Path) -> str | None:
    """Write the bar chart of ratios; returns why not when it cannot (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "bench.png not written: matplotlib is not installed (pip install 'modstate[bench]')"
    bars = [
        (f"{case.case}  vs {peer.impl}", peer.ratio)
        for case in report.cases
        for peer in case.peers
        if peer.ratio is not None
    ]
    if not bars:
        return "bench.png not written: no case has both modstate and a peer"
    labels, ratios = zip(*reversed(bars))
    figure, axes = plt.subplots(figsize=(13, 1.4 + 0.32 * len(bars)))
    colors = ["tab:green" if ratio <= 1 else "tab:red" for ratio in ratios]
    axes.barh(range(len(ratios)), ratios, color=colors)
    axes.set_yticks(range(len(ratios)), labels, fontsize=8)
    axes.axvline(1.0, color="black", linewidth=1)
    axes.set_xscale("log")
    low = min(min(ratios), 1.0) / 1.5
    high = max(max(ratios), 1.0) * 1.5
    axes.set_xlim(low, high)
    ticks = [t for t in (0.1, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5, 10) if low <= t <= high]
    axes.minorticks_off()
    axes.set_xticks(ticks, [f"{t:g}" for t in ticks])
    for index, ratio in enumerate(ratios):
        axes.text(ratio, index, f" {ratio:.2f}", va="center", fontsize=7)
    axes.set_xlabel("modstate time / peer time (median, log scale)\nleft of 1: modstate is faster")
    axes.set_title("modstate vs peers")
    figure.tight_layout()
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return None


# ---------------------------------------------------------------------------------------------
# the command


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m modstate bench",
        description="Run the benchmark suites and print modstate beside each peer.",
    )
    parser.add_argument("--quick", action="store_true", help="few rounds per benchmark")
    parser.add_argument("--out", default="bench-results", help="where bench.json and bench.png go")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression to run only some cases")
    parser.add_argument(
        "--benchmarks-dir", type=Path, help="the suites' directory (default: found automatically)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the suites, print the table, write ``bench.json`` and ``bench.png``; 0 on success."""
    args = _parser().parse_args(argv)
    bench_dir = args.benchmarks_dir or find_benchmarks_dir()
    if bench_dir is None or not bench_dir.is_dir():
        print(
            "modstate bench: no benchmarks/ directory found next to the modstate sources or in "
            f"the current directory ({Path.cwd()}); run it from a modstate checkout.",
            file=sys.stderr,
        )
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    suites = ", ".join(path.name for path in _suites(bench_dir))
    print(f"running {suites} ({'quick' if args.quick else 'full'} run) ...", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        json_path = Path(scratch) / "pytest-benchmark.json"
        junit_path = Path(scratch) / "junit.xml"
        command = pytest_command(
            bench_dir, json_path, junit_path, quick=args.quick, keyword=args.keyword
        )
        done = subprocess.run(
            command,
            cwd=bench_dir.parent,
            env=_subprocess_env(args.quick),
            capture_output=True,
            text=True,
            check=False,
        )
        if not json_path.exists():
            print(done.stdout[-4000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
            print(
                f"modstate bench: pytest exited with {done.returncode} and wrote no results",
                file=sys.stderr,
            )
            return done.returncode or 1
        data = json.loads(json_path.read_text())
        skips = read_skips(junit_path)
    report = build_report(data, skips)
    if done.returncode not in (0, 5):
        failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        report.notes.append(
            f"pytest exited with {done.returncode}: {len(failed)} benchmarks failed"
        )
        report.notes.extend(failed[:20])
    print(format_table(report))
    (out_dir / "bench.json").write_text(
        json.dumps(report_json(report, data, quick=args.quick), indent=2)
    )
    why_no_plot = plot_ratios(report, out_dir / "bench.png")
    written = "bench.json" if why_no_plot else "bench.json and bench.png"
    print(f"\nwrote {written} to {out_dir}/")
    if why_no_plot:
        print(why_no_plot)
    if not report.cases:
        print("modstate bench: no benchmark ran (check -k)", file=sys.stderr)
        return 1
    return 0 if done.returncode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
