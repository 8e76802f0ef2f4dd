"""The figures: pytest-benchmark's results paired into cases, modstate beside each peer.

A benchmark names its case in ``benchmark.group`` and its implementation in
``benchmark.extra_info["impl"]`` (``"modstate"``, or the peer's name; an impl starting with
``"baseline"`` is the work every implementation does anyway, such as the plain forward); suites
using the ``compare`` fixture time all implementations of a case in interleaved rounds and store
them in ``extra_info["interleaved"]``. `build_report` pairs the ``modstate`` entry of each case
with every peer: each one's median time and spread (half the interquartile range, in percent of
the median) and the ratio modstate / peer (below 1: modstate is faster). With a baseline in the
case it also gives the ratio of overheads, (modstate - baseline) / (peer - baseline).

Each case belongs to the family of the suite it comes from (`family_of`), which the docs page
groups its tables by: a new suite is a new family, with no edit here.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MODSTATE = "modstate"
BASELINE_PREFIX = "baseline"

# The families the docs page shows, in its order: suite file stem -> title. A suite not listed
# here is a family of its own, titled from its file name, shown after these.
FAMILIES = {
    "ensemble_benchmarks_test": "Ensembles",
    "functional_benchmarks_test": "Calls",
    "pytree_benchmarks_test": "Tree operations",
    "optim_benchmarks_test": "Optimizers",
    "training_benchmarks_test": "Training steps",
    "distributed_benchmarks_test": "Distributed",
    "thread_benchmarks_test": "Threads",
    "threads_benchmarks_test": "Threads",
}


def family_of(fullname: str | None, extra_info: dict[str, Any] | None = None) -> str:
    """The family of a benchmark: ``extra_info["family"]`` if it names one, else its suite's
    (``"benchmarks/pytree_benchmarks_test.py::test_add[small]"`` -> ``"Tree operations"``)."""
    if extra_info and extra_info.get("family"):
        return str(extra_info["family"])
    stem = Path((fullname or "").split("::", 1)[0]).stem
    if stem in FAMILIES:
        return FAMILIES[stem]
    words = stem.removesuffix("_test").removesuffix("_benchmarks").replace("_", " ").strip()
    return words.capitalize() or "Other"


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
    family: str = "Other"


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
        anyone = own or next(iter(entries.values()))
        case = CaseResult(
            group,
            _median(own) if own else None,
            own["name"] if own else None,
            modstate_spread=_spread(own) if own else None,
            family=family_of(anyone.get("fullname"), anyone.get("extra_info")),
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


def report_json(report: Report, data: dict[str, Any], *, quick: bool) -> dict[str, Any]:
    machine = data.get("machine_info") or {}
    return {
        "generated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "statistic": "median seconds per call",
        "ratio": "modstate / peer",
        "quick": quick,
        "machine": {
            "node": machine.get("node"),
            "python": machine.get("python_version"),
            "cpu": (machine.get("cpu") or {}).get("brand_raw"),
            "cpu_count": (machine.get("cpu") or {}).get("count"),
        },
        "versions": versions("modstate", "torch", "optree", "tensordict", "pytest-benchmark"),
        "cases": [asdict(case) for case in report.cases],
        "skipped": [asdict(skip) for skip in report.skipped],
        "notes": report.notes,
        "benchmarks": [
            {
                "name": bench.get("name"),
                "fullname": bench.get("fullname"),
                "group": bench.get("group"),
                "impl": (bench.get("extra_info") or {}).get("impl"),
                "family": family_of(bench.get("fullname"), bench.get("extra_info")),
                "stats": {
                    key: bench.get("stats", {}).get(key)
                    for key in ("min", "max", "mean", "median", "stddev", "rounds", "iterations")
                },
            }
            for bench in data.get("benchmarks", [])
        ],
    }


def versions(*distributions: str) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in distributions:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found
