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
