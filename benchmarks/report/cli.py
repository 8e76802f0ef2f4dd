"""``python benchmarks/report`` (or ``python -m modstate bench`` from a checkout): run the suites,
print the table, write bench.txt, bench.json and bench.png, and refresh the docs page's tables."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from .chart import plot_ratios
from .page import update_page
from .results import build_report, report_json
from .suites import collect, find_benchmarks_dir, run_suite, suites_in
from .text import footer_line, format_table


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m modstate bench",
        description="Run the benchmark suites of this checkout's benchmarks/ folder and print "
        "modstate beside each peer (the harness is benchmarks/report; it needs a source "
        "checkout and the bench extra: pip install -e '.[bench]').",
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
    parser.add_argument(
        "--page",
        type=Path,
        help="a docs page whose generated headline and tables to rewrite from the results "
        "(docs/benchmarks.md)",
    )
    parser.add_argument(
        "--from",
        dest="from_json",
        type=Path,
        help="run nothing: rewrite --page from this earlier bench.json",
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


def main(argv: list[str] | None = None) -> int:
    """Run the suites, print the table, write ``bench.txt``, ``bench.json`` and ``bench.png``.

    Exit status: 0 when every benchmark ran, 1 when some failed, 2 for a usage error (no suites,
    nothing matching ``-k``, an ``--out`` that cannot be written), each said in one line.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.from_json is not None:
        if args.page is None:
            parser.error("--from rewrites a page: give it with --page")
        update_page(args.page, json.loads(args.from_json.read_text(encoding="utf-8")))
        print(f"wrote the headline and tables of {args.page} from {args.from_json}")
        return 0
    bench_dir = args.benchmarks_dir or find_benchmarks_dir()
    if bench_dir is None or not bench_dir.is_dir() or not suites_in(bench_dir):
        where = bench_dir if bench_dir is not None else Path.cwd() / "benchmarks"
        print(f"modstate bench: no benchmark suites in {where}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    why_not = _writable_dir(out_dir)
    if why_not:
        print(why_not, file=sys.stderr)
        return 2
    counts, broken = collect(bench_dir, args.keyword)
    suites = [
        suite for suite in suites_in(bench_dir) if suite.name in counts or suite.name in broken
    ]
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
    results = report_json(report, data, quick=args.quick)
    (out_dir / "bench.json").write_text(json.dumps(results, indent=2))
    if args.page is not None:
        update_page(args.page, results)
    why_no_plot = plot_ratios(report, out_dir / "bench.png", footer=footer)
    written = "bench.txt and bench.json" if why_no_plot else "bench.txt, bench.json and bench.png"
    print(f"\n{footer}\nwrote {written} to {out_dir}/")
    if why_no_plot:
        print(why_no_plot)
    if args.page is not None:
        print(f"wrote the headline and tables of {args.page}")
    if not report.cases:
        print("modstate bench: no benchmark produced figures", file=sys.stderr)
        return 1
    return 1 if failed else 0
