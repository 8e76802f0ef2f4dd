"""The benchmark report (``python -m modstate bench``, harness in ``benchmarks/report``): pairing,
table, JSON, chart, the docs page's tables, and a real run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import modstate.cli

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import chart, cli, page, results, suites  # noqa: E402
from report import text as table  # noqa: E402


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
    built = results.build_report(SYNTHETIC)
    cases = {case.case: case for case in built.cases}
    add = cases["add (small)"]
    assert add.modstate_s == 8e-6 and add.modstate_test == "test_add_modstate[small]"
    ratios = {peer.impl: peer.ratio for peer in add.peers}
    assert ratios == pytest.approx({"torch.utils._pytree": 0.5, "tensordict": 0.4})
    assert all(peer.overhead_ratio is None for peer in add.peers)


def test_build_report_subtracts_a_baseline_for_overhead_ratios():
    call = {case.case: case for case in results.build_report(SYNTHETIC).cases}["call"]
    assert call.baseline == "baseline: plain forward" and call.baseline_s == 10e-6
    (peer,) = call.peers  # the baseline is not a peer
    assert peer.impl == "torch.func.functional_call"
    assert peer.ratio == pytest.approx(14 / 30)
    assert peer.overhead_ratio == pytest.approx(4 / 20)


def test_build_report_notes_what_it_cannot_pair():
    built = results.build_report(SYNTHETIC)
    assert any("orphan: no modstate entry" in note for note in built.notes)
    orphan = {case.case: case for case in built.cases}["orphan"]
    assert orphan.modstate_s is None and orphan.peers[0].ratio is None  # shown, not compared
    assert "orphan" in table.format_table(built)
    assert any("test_untagged: no extra_info['impl']" in note for note in built.notes)
    duplicate = {"benchmarks": [bench("a", "g", "modstate", 1.0), bench("b", "g", "modstate", 2.0)]}
    assert "two entries for 'modstate'" in results.build_report(duplicate).notes[0]


def test_format_table_puts_each_case_over_its_implementations_in_100_columns():
    skips = [
        results.Skip("pytree_benchmarks_test::test_add_td[small]", "could not import 'tensordict'")
    ]
    long_case = {
        "benchmarks": [
            bench("a", "x" * 150, "modstate", 1e-3),
            bench("b", "x" * 150, "a peer with a very long name " * 3, 2e-3),
        ]
    }
    for data in (SYNTHETIC, long_case):
        text = table.format_table(results.build_report(data, skips))
        assert max(map(len, text.splitlines())) <= 100, text
    text = table.format_table(results.build_report(SYNTHETIC, skips))
    lines = text.splitlines()
    assert "Median" in lines[0] and "modstate / peer" in lines[1]
    assert "overhead = (modstate - baseline)" in lines[2]
    start = lines.index("add (small)")
    assert lines[start + 1].split() == ["modstate", "8", "us", "-"]  # no quartiles given
    assert lines[start + 2].split() == ["torch.utils._pytree", "16", "us", "-", "0.50", "-"]
    assert lines[start + 3].split()[:2] == ["tensordict", "20"] and "0.40" in lines[start + 3]
    call = lines.index("call")
    assert lines[call + 2].strip().startswith("baseline: plain forward")  # after modstate
    assert lines[call + 3].split()[-2:] == ["0.47", "0.20"]
    assert "test_add_td[small]: skipped (not installed: could not import 'tensordict')" in text


def test_wide_table_keeps_one_line_per_case_and_peer():
    text = table.format_table(results.build_report(SYNTHETIC), wide=True)
    add_line = next(line for line in text.splitlines() if line.startswith("add (small)"))
    assert "8 us" in add_line and "torch.utils._pytree" in add_line and "0.50" in add_line


def test_spread_is_half_the_interquartile_range():
    data = {
        "benchmarks": [
            {
                "name": "t",
                "group": "g",
                "extra_info": {
                    "impl": "modstate",
                    "interleaved": {
                        "modstate": {"median": 1.0, "q1": 0.9, "q3": 1.1},
                        "peer": {"median": 2.0, "q1": 1.8, "q3": 2.4},
                    },
                },
                "stats": {"median": 1.0},
            }
        ]
    }
    (case,) = results.build_report(data).cases
    (peer,) = case.peers
    assert case.modstate_spread == pytest.approx(0.1) and peer.spread == pytest.approx(0.15)
    assert (peer.ratio_low, peer.ratio_high) == pytest.approx((0.9 / 2.4, 1.1 / 1.8))
    assert table.format_spread(0.1) == "±10%" and table.format_spread(None) == "-"


def test_peers_the_suites_could_not_import_are_noted():
    data = {"benchmarks": [bench("t", "add (small)", "modstate", 1e-6, missing=["tensordict"])]}
    assert results.build_report(data).notes == [
        "add (small): tensordict is not installed, left out"
    ]


def test_format_seconds_picks_a_unit():
    assert table.format_seconds(1.5e-6) == "1.5 us"
    assert table.format_seconds(0.0123) == "12.3 ms"
    assert table.format_seconds(999.96e-6) == "1000 us"
    assert table.format_seconds(2.0) == "2 s"
    assert table.format_seconds(5e-10) == "0.5 ns"


def test_report_json_holds_figures_ratios_and_raw_stats():
    built = results.build_report(SYNTHETIC)
    data = json.loads(json.dumps(results.report_json(built, SYNTHETIC, quick=True)))
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
    (skip,) = results.read_skips(junit)
    assert skip.test == "pytree_benchmarks_test::test_add_td[small]"
    assert skip.note.startswith(
        "pytree_benchmarks_test::test_add_td[small]: skipped (not installed"
    )
    assert results.read_skips(tmp_path / "missing.xml") == []


def test_footer_says_what_the_figures_come_from():
    import datetime

    import torch

    when = datetime.datetime(2026, 12, 2, tzinfo=datetime.UTC)
    data = {"machine_info": {"cpu": {"brand_raw": "Some CPU", "count": 2}}}
    assert table.footer_line(data, quick=True, when=when) == (
        f"quick run · torch {torch.__version__} · Some CPU, 2 CPUs · 2026-12-02"
    )
    assert table.footer_line(data, quick=False, when=when).startswith("full run")


def test_plot_ratios_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    assert chart.plot_ratios(results.build_report(SYNTHETIC), path, footer="full run") is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = results.Report([], [], [])
    assert "no case" in chart.plot_ratios(empty, tmp_path / "none.png")


def test_main_without_suites_says_where_it_looked_in_one_line(tmp_path, capsys):
    code = cli.main(["--benchmarks-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path)])
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        f"modstate bench: no benchmark suites in {tmp_path / 'nowhere'}\n"
    )


def test_help_says_it_needs_a_source_checkout(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "needs a source checkout" in " ".join(capsys.readouterr().out.split())


def test_modstate_bench_forwards_to_the_checkout_harness(tmp_path):
    assert modstate.cli.find_harness() == ROOT / "benchmarks" / "report"
    target = tmp_path / "page.md"
    target.write_text(f"# B\n\n{page.BEGIN}\nold\n{page.END}\n\nafter\n")
    source = ROOT / "docs" / "bench" / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "modstate", "bench", "--from", str(source), "--page", str(target)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    written = target.read_text()
    assert written.startswith(f"# B\n\n{page.BEGIN}\n\n## Headline")
    assert written.endswith(f"{page.END}\n\nafter\n") and "old" not in written


def test_modstate_bench_without_a_checkout_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(modstate.cli, "find_harness", lambda cwd=None: None)
    assert modstate.cli.main(["bench", "--quick"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == modstate.cli.NEEDS_CHECKOUT + "\n"


def test_an_unwritable_out_is_one_line_and_exit_2(tmp_path, pytree_suite, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = cli.main(["--out", str(blocker / "out"), "--benchmarks-dir", str(pytree_suite)])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.count("\n") == 1 and "cannot write to --out" in captured.err


def test_a_keyword_that_matches_nothing_is_one_line_and_exit_2(tmp_path, pytree_suite, capsys):
    code = cli.main(
        ["-k", "nomatch", "--out", str(tmp_path), "--benchmarks-dir", str(pytree_suite)]
    )
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err == "modstate bench: no benchmark matches -k 'nomatch'\n"


def test_the_benchmarks_dir_of_this_checkout_is_found():
    found = suites.find_benchmarks_dir()
    assert found is not None and (found / "pytree_benchmarks_test.py").exists()


def test_quick_command_uses_few_rounds_and_json(tmp_path):
    command = suites.pytest_command(
        Path("benchmarks"), tmp_path / "b.json", tmp_path / "j.xml", quick=True, keyword="add"
    )
    assert "--benchmark-min-rounds=3" in command and "--benchmark-only" in command
    assert f"--benchmark-json={tmp_path / 'b.json'}" in command
    assert command[-2:] == ["-k", "add"]


@pytest.fixture
def pytree_suite(tmp_path):
    """A benchmarks/ directory holding the real pytree suite alone (other suites may be slow)."""
    pytest.importorskip("pytest_benchmark")
    source = suites.find_benchmarks_dir()
    target = tmp_path / "suite" / "benchmarks"
    target.mkdir(parents=True)
    for name in ("conftest.py", "_timing.py", "pytree_benchmarks_test.py"):
        shutil.copy(source / name, target / name)
    return target


def test_main_end_to_end_on_the_pytree_suite(tmp_path, pytree_suite, capsys):
    code = cli.main(
        ["--quick", "-k", "add", "--out", str(tmp_path), "--benchmarks-dir", str(pytree_suite)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "add (small)" in out and "add (large)" in out and "torch.utils._pytree" in out
    assert "[1/1] pytree_benchmarks_test.py (2) ... done in" in out  # progress per suite
    assert "quick run · torch" in out
    assert (tmp_path / "bench.txt").read_text().startswith("Median time per call")
    data = json.loads((tmp_path / "bench.json").read_text())
    cases = {case["case"]: case for case in data["cases"]}
    assert set(cases) == {"add (small)", "add (large)"}
    for case in cases.values():
        assert case["modstate_s"] > 0
        assert case["peers"] and all(peer["ratio"] > 0 for peer in case["peers"])
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
    code = cli.main(
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
    assert "add (small): tensordict is not installed, left out" in out
    (case,) = json.loads((out_dir / "bench.json").read_text())["cases"]
    assert [peer["impl"] for peer in case["peers"]] == ["torch.utils._pytree"]


# ---------------------------------------------------------------------------------------------
# families and the docs page


def test_each_case_belongs_to_the_family_of_its_suite():
    assert results.family_of("benchmarks/pytree_benchmarks_test.py::test_add[small]") == (
        "Tree operations"
    )
    # a new suite is a new family, with no edit of the harness
    assert results.family_of("benchmarks/checkpoint_memory_benchmarks_test.py::t") == (
        "Checkpoint memory"
    )
    assert results.family_of("benchmarks/x_test.py::t", {"family": "Threads"}) == "Threads"
    cases = {case.case: case for case in results.build_report(SYNTHETIC).cases}
    assert cases["add (small)"].family == "X"  # SYNTHETIC's benchmarks come from x_test.py


def test_speed_words_read_a_range_of_ratios():
    assert page.speed_words([0.5, 0.25]) == "2–4x faster"
    assert page.speed_words([0.08]) == "12x faster"
    assert page.speed_words([0.13, 1.0]) == "1–7.7x faster"  # within 5% of 1: on par
    assert page.speed_words([1.3, 1.6]) == "1.3–1.6x slower"
    assert page.speed_words([0.98, 1.02]) == "on par"
    assert page.speed_words([0.5, 1.5]) == "2x faster to 1.5x slower"


def test_the_page_puts_the_headline_first_then_a_table_per_family_with_the_ratio():
    data = results.report_json(results.build_report(SYNTHETIC), SYNTHETIC, quick=False)
    data["cases"][0]["family"] = "Tree operations"
    data["cases"][1]["family"] = "Calls"
    markdown = page.render(data)
    lines = markdown.splitlines()
    assert lines[0] == "## Headline"
    assert lines.index("## Calls") < lines.index("## Tree operations")  # the families' order
    assert (
        "- Tree operations (1 case): **2x faster** than torch.utils._pytree; "
        "**2.5x faster** than tensordict.\n" in markdown
    )
    tree_table = lines[lines.index("## Tree operations") + 2 :]
    assert tree_table[0] == "| case | peer | modstate / peer | modstate | peer |"
    assert tree_table[2] == (
        "| add (small) | torch.utils._pytree | **0.50** (2x faster) | 8 us | 16 us |"
    )
    calls = lines[lines.index("## Calls") + 2 :]
    assert calls[0].endswith("| overhead ratio |")  # only where a case has a baseline
    assert calls[3].startswith("|  | baseline: plain forward | – |  | 10 us |")


def test_the_headline_leaves_out_modstates_own_configurations_and_references():
    case = {
        "case": "optim step: adam, donated",
        "family": "Optimizers",
        "peers": [
            {"impl": "torch.optim (fused=True)", "ratio": 0.9, "median_s": 1e-3},
            {"impl": "modstate (foreach=True)", "ratio": 0.3, "median_s": 3e-3},
            {"impl": "allocation floor (empty_like + fill)", "ratio": 3.0, "median_s": 3e-4},
            {"impl": "reference: copy + fused kernel, by hand", "ratio": 1.1, "median_s": 9e-4},
        ],
    }
    line = page._headline([case])
    assert line == "**1.1x faster** than torch.optim (fused=True)"


def test_the_docs_page_shows_the_figures_of_docs_bench_json():
    """docs/benchmarks.md's tables are what the generator makes of docs/bench/bench.json: refresh
    them with ``python benchmarks/report --from docs/bench/bench.json --page docs/benchmarks.md``."""
    data = json.loads((ROOT / "docs" / "bench" / "bench.json").read_text())
    shown = page.generated_region((ROOT / "docs" / "benchmarks.md").read_text())
    assert shown == page.render(data)
    # the families the issue asks for, each with its table
    for family in ("Ensembles", "Calls", "Tree operations", "Optimizers", "Training steps"):
        assert f"\n## {family}\n" in shown


def test_update_page_refuses_a_page_without_the_markers(tmp_path):
    target = tmp_path / "page.md"
    target.write_text("# no markers\n")
    with pytest.raises(ValueError, match="no generated region"):
        page.update_page(target, {"cases": []})
