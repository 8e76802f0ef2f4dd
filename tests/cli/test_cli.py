import subprocess
import sys

import pytest

from modstate.cli import main


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "modstate", *args], capture_output=True, text=True, timeout=300
    )


def test_help_lists_the_commands():
    result = run("--help")
    assert result.returncode == 0
    assert "demo" in result.stdout and "bench" in result.stdout


def test_demo_trains_an_ensemble_and_prints_the_table():
    result = run("demo", "--members", "3", "--steps", "40", "--seed", "1", "--no-progress")
    assert result.returncode == 0, result.stderr
    for line in ("member 0", "member 2", "ensemble mean", "EMA weights", "same predictions"):
        assert line in result.stdout
    assert "member 3" not in result.stdout
    # It says why the EMA row scores as it does, and where its code is (issue 22, item 11).
    assert "EMA weights (an average over about the last 20 steps) score" in result.stdout
    assert "read what just ran: src/modstate/cli/_demo.py" in result.stdout


def test_the_ema_verdict_follows_the_numbers():
    from modstate.cli._demo import ema_verdict

    assert "score worse here" in ema_verdict(plain_mse=0.02, ema_mse=0.03)
    assert "score better here" in ema_verdict(plain_mse=0.03, ema_mse=0.02)


@pytest.mark.parametrize(
    "argv",
    [["frobnicate"], ["demo", "--steps", "-3"], ["demo", "--members", "many"], ["demo", "--bogus"]],
)
def test_bad_usage_gives_a_usage_message_and_no_traceback(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: modstate" in err and "Traceback" not in err


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "usage: modstate" in capsys.readouterr().out


def test_version_names_the_package_version():
    import modstate

    result = run("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"modstate {modstate.__version__}"


def test_bench_help_says_it_needs_a_source_checkout():
    assert "source checkout" in run("--help").stdout


def test_demo_states_its_task_first():
    result = run("demo", "--members", "2", "--steps", "5", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith("task: fit y = sin(2x) + 0.3x")


def test_demo_with_one_member_reads_right_and_measures_no_spread():
    result = run("demo", "--members", "1", "--steps", "300", "--no-progress")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "1 member x 300 steps" in out and "1 members" not in out
    assert "nan" not in out and "spread (std)" not in out
    assert "ensemble mean" not in out
    assert "one member has no spread to measure" in out


def test_a_short_run_makes_no_claim_about_where_the_data_is():
    result = run("demo", "--members", "4", "--steps", "20", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "not fitted yet" in result.stdout
    assert "disagree" not in result.stdout and "spread (std)" not in result.stdout


def test_verdicts_follow_the_numbers():
    from modstate.cli._demo import verdicts

    assert "not fitted yet" in verdicts(8, fit_mse=0.2, spread_in=0.1, spread_out=0.5)[0]
    fitted = verdicts(8, fit_mse=0.02, spread_in=0.05, spread_out=0.15)
    assert fitted[0].startswith("fitted") and "disagree where there is no data" in fitted[1]
    flat = verdicts(8, fit_mse=0.02, spread_in=0.05, spread_out=0.06)
    assert "no clear sign" in flat[1] and "disagree" not in flat[1]
    assert "no spread" in verdicts(1, fit_mse=0.02, spread_in=0.0, spread_out=0.0)[1]
