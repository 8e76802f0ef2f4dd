"""The checkout's rule on skips (conftest.py at the repository root), run on a scratch project:
a skip that tests/allowed_skips.toml does not allow fails the run and is named with its reason."""

from __future__ import annotations

from pathlib import Path

import pytest

RULE = (Path(__file__).resolve().parent.parent / "conftest.py").read_text()

TESTS = """
import pytest

def test_runs():
    assert 1 + 1 == 2

def test_needs_a_gpu():
    pytest.skip("no GPU here")

@pytest.mark.parametrize("model", ["bert", "t5"])
def test_zoo(model):
    if model == "t5":
        pytest.skip("torch limit: no derivative")
"""


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(RULE)
    pytester.makepyfile(test_sample=TESTS)
    pytester.mkdir("tests")
    return pytester


def allow(project: pytest.Pytester, *entries: tuple[str, str]) -> None:
    text = "".join(f'[[skip]]\ntest = "{test}"\nreason = "{reason}"\n' for test, reason in entries)
    (project.path / "tests" / "allowed_skips.toml").write_text(text)


def test_a_skip_not_on_the_list_fails_the_run_and_is_named(project):
    allow(project, ("test_sample.py::test_zoo[[]t5[]]", "torch limit"))
    result = project.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*= unexpected skips =*",
            "test_sample.py::test_needs_a_gpu: no GPU here",
            "1 skip(s) not allowed by tests*allowed_skips.toml*",
        ]
    )
    result.assert_outcomes(passed=2, skipped=2)


def test_skips_on_the_list_keep_the_run_green(project):
    allow(
        project,
        ("test_sample.py::test_zoo[[]t5[]]", "torch limit"),
        ("test_sample.py::test_needs_a_gpu", "no GPU"),
    )
    result = project.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.OK
    assert "unexpected skips" not in result.stdout.str()


def test_an_entry_must_match_the_reason_too(project):
    allow(project, ("test_sample.py::*", "torch limit"))
    result = project.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["test_sample.py::test_needs_a_gpu: no GPU here"])
    assert "test_zoo[t5]:" not in result.stdout.str()


def test_a_module_skipped_at_import_counts_too(project):
    project.makepyfile(test_optional='pytest = __import__("pytest")\npytest.importorskip("nope")\n')
    allow(project, ("test_sample.py::*", ""))
    result = project.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["test_optional.py: could not import 'nope'*"])


def test_the_environment_variable_lifts_the_rule(project, monkeypatch):
    monkeypatch.setenv("MODSTATE_ALLOW_SKIPS", "1")
    result = project.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=2, skipped=2)
