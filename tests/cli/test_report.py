"""The benchmark report (``python -m modstate bench``): pairing, table, JSON, chart, and a real run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from modstate.cli import _report as report


def bench(name, group, impl, median, **extra):
    return {
        "name": name,
        "fullname": f"benchmarks/x_test.py::{name}",
        "group": group,
        "extra_info": {"impl": impl, **extra} if impl else {},
        "stats": {
            "min": median * 0.9,
            "max": median * 2,
            "mean": median * 1.1,
            "median": median,
            "stddev": median / 10,
            "rounds": 5,
            "iterations": 1,
        },
    }


SYNTHETIC = {
    "machine_info": {"node": "box", "processor": "x86_64", "python_version": "3.11.7", "cpu": {}},
    "benchmarks": [
        bench("test_add_modstate[small]", "add (small)", "modstate", 8e-6),
        bench("test_add_pytree[small]", "add (small)", "torch.utils._pytree", 16e-6),
        bench("test_add_td[small]", "add (small)", "tensordict", 20e-6),
        bench("test_call_forward", "call", "baseline: plain forward", 10e-6),
        bench("test_call_modstate", "call", "modstate", 14e-6),
        bench("test_call_functional_call", "call", "torch.func.functional_call", 30e-6),
        bench("test_orphan_peer", "orphan", "tensordict", 1e-3),
        bench("test_untagged", "misc", None, 1e-3),
    ],
}


def test_build_report_pairs_modstate_with_each_peer_by_median():
    built = report.build_report(SYNTHETIC)
    cases = {case.case: case for case in built.cases}
    add = cases["add (small)"]
    assert add.modstate_s == 8e-6 and add.modstate_test == "test_add_modstate[small]"
    ratios = {peer.impl: peer.ratio for peer in add.peers}
    assert ratios == pytest.approx({"torch.utils._pytree": 0.5, "tensordict": 0.4})
    assert all(peer.overhead_ratio is None for peer in add.peers)


def test_build_report_subtracts_a_baseline_for_overhead_ratios():
    call = {case.case: case for case in report.build_report(SYNTHETIC).cases}["call"]
    assert call.baseline == "baseline: plain forward" and call.baseline_s == 10e-6
    (peer,) = call.peers  # the baseline is not a peer
    assert peer.impl == "torch.func.functional_call"
    assert peer.ratio == pytest.approx(14 / 30)
    assert peer.overhead_ratio == pytest.approx(4 / 20)


def test_build_report_notes_what_it_cannot_pair():
    built = report.build_report(SYNTHETIC)
    assert any("orphan: no modstate entry" in note for note in built.notes)
    orphan = {case.case: case for case in built.cases}["orphan"]
    assert orphan.modstate_s is None and orphan.peers[0].ratio is None  # shown, not compared
    assert "orphan" in report.format_table(built)
    assert any("test_untagged: no extra_info['impl']" in note for note in built.notes)
    duplicate = {"benchmarks": [bench("a", "g", "modstate", 1.0), bench("b", "g", "modstate", 2.0)]}
    assert "two entries for 'modstate'" in report.build_report(duplicate).notes[0]


def test_format_table_is_side_by_side_with_ratios_and_notes():
    skips = [
        report.Skip("pytree_benchmarks_test::test_add_td[small]", "could not import 'tensordict'")
    ]
    text = report.format_table(report.build_report(SYNTHETIC, skips))
    lines = text.splitlines()
    assert "Median" in lines[0] and "modstate / peer" in lines[0]
    assert "Overhead ratio" in lines[1]
    header = next(line for line in lines if line.startswith("case"))
    assert header.split()[:5] == ["case", "modstate", "peer", "peer", "time"]
    add_line = next(line for line in lines if line.startswith("add (small)"))
    assert (
        "8 us" in add_line
        and "torch.utils._pytree" in add_line
        and add_line.split()[-2:] == ["0.50", "-"]
    )
    tensordict_line = lines[lines.index(add_line) + 1]
    assert tensordict_line.split()[:3] == ["tensordict", "20", "us"] and "0.40" in tensordict_line
    assert "test_add_td[small]: skipped (not installed: could not import 'tensordict')" in text
    call_line = next(line for line in lines if line.startswith("call"))
    assert "baseline: plain forward" in call_line  # the baseline is shown first
    assert text.index("functional_call") > text.index("baseline")


def test_format_seconds_picks_a_unit():
    assert report.format_seconds(1.5e-6) == "1.5 us"
    assert report.format_seconds(0.0123) == "12.3 ms"
    assert report.format_seconds(999.96e-6) == "1000 us"
    assert report.format_seconds(2.0) == "2 s"
    assert report.format_seconds(5e-10) == "0.5 ns"


def test_report_json_holds_figures_ratios_and_raw_stats():
    built = report.build_report(SYNTHETIC)
    data = json.loads(json.dumps(report.report_json(built, SYNTHETIC, quick=True)))
    assert data["quick"] is True and data["ratio"] == "modstate / peer"
    assert data["versions"]["torch"] and data["machine"]["node"] == "box"
    add = next(case for case in data["cases"] if case["case"] == "add (small)")
    assert {peer["impl"]: peer["ratio"] for peer in add["peers"]} == pytest.approx(
        {"torch.utils._pytree": 0.5, "tensordict": 0.4}
    )
    assert len(data["benchmarks"]) == len(SYNTHETIC["benchmarks"])
    assert data["benchmarks"][0]["stats"]["median"] == 8e-6


def test_read_skips_from_junit(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<?xml version="1.0"?><testsuites><testsuite>'
        '<testcase classname="benchmarks.pytree_benchmarks_test" name="test_add_td[small]">'
        "<skipped type=\"pytest.skip\" message=\"could not import 'tensordict': No module named 'tensordict'\"/>"
        "</testcase>"
        '<testcase classname="benchmarks.pytree_benchmarks_test" name="test_add_modstate[small]"/>'
        "</testsuite></testsuites>"
    )
    (skip,) = report.read_skips(junit)
    assert skip.test == "pytree_benchmarks_test::test_add_td[small]"
    assert skip.note.startswith(
        "pytree_benchmarks_test::test_add_td[small]: skipped (not installed"
    )
    assert report.read_skips(tmp_path / "missing.xml") == []


def test_plot_ratios_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    assert report.plot_ratios(report.build_report(SYNTHETIC), path) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = report.Report([], [], [])
    assert "no case" in report.plot_ratios(empty, tmp_path / "none.png")


def test_main_without_benchmarks_dir_fails_clearly(tmp_path, capsys):
    code = report.main(["--benchmarks-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path)])
    assert code == 2
    assert "no benchmarks/ directory" in capsys.readouterr().err


def test_the_benchmarks_dir_of_this_checkout_is_found():
    found = report.find_benchmarks_dir()
    assert found is not None and (found / "pytree_benchmarks_test.py").exists()


def test_quick_command_uses_few_rounds_and_json(tmp_path):
    command = report.pytest_command(
        Path("benchmarks"), tmp_path / "b.json", tmp_path / "j.xml", quick=True, keyword="add"
    )
    assert "--benchmark-min-rounds=3" in command and "--benchmark-only" in command
    assert f"--benchmark-json={tmp_path / 'b.json'}" in command
    assert command[-2:] == ["-k", "add"]


@pytest.fixture
def pytree_suite(tmp_path):
    """A benchmarks/ directory holding the real pytree suite alone (other suites may be slow)."""
    pytest.importorskip("pytest_benchmark")
    source = report.find_benchmarks_dir()
    target = tmp_path / "suite" / "benchmarks"
    target.mkdir(parents=True)
    for name in ("conftest.py", "_timing.py", "pytree_benchmarks_test.py"):
        shutil.copy(source / name, target / name)
    return target


def test_main_end_to_end_on_the_pytree_suite(tmp_path, pytree_suite, capsys):
    code = report.main(
        ["--quick", "-k", "add", "--out", str(tmp_path), "--benchmarks-dir", str(pytree_suite)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "add (small)" in out and "add (large)" in out and "torch.utils._pytree" in out
    data = json.loads((tmp_path / "bench.json").read_text())
    cases = {case["case"]: case for case in data["cases"]}
    assert set(cases) == {"add (small)", "add (large)"}
    for case in cases.values():
        assert case["modstate_s"] > 0
        assert all(peer["ratio"] > 0 for peer in case["peers"])
    if (tmp_path / "bench.png").exists():
        assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_main_notes_a_peer_that_is_not_installed(tmp_path, pytree_suite, monkeypatch, capsys):
    hidden = tmp_path / "hide"
    (hidden / "tensordict").mkdir(parents=True)
    (hidden / "tensordict" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'tensordict'\")\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(hidden))
    out_dir = tmp_path / "out"
    code = report.main(
        [
            "--quick",
            "-k",
            "add and small",
            "--out",
            str(out_dir),
            "--benchmarks-dir",
            str(pytree_suite),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "test_add_td[small]: skipped (not installed" in out
    (case,) = json.loads((out_dir / "bench.json").read_text())["cases"]
    assert [peer["impl"] for peer in case["peers"]] == ["torch.utils._pytree"]
