"""tests/distributed needs torch.distributed with gloo. A build without it cannot even import
these files, so each of them is then collected as one test that is skipped with that reason (and
the run fails on it unless the skip is allowed: see tests/allowed_skips.toml)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

GLOO_MISSING = "this torch build has no torch.distributed with gloo"


class WithoutGloo(pytest.File):
    """A test file of this folder on a build without gloo: one item, skipped with the reason."""

    def collect(self):
        yield WithoutGlooItem.from_parent(self, name="needs_gloo")


class WithoutGlooItem(pytest.Item):
    def runtest(self) -> None:
        pytest.skip(f"{GLOO_MISSING}: {self.path.name} was not imported")


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.File | None:
    if dist.is_available() and dist.is_gloo_available():
        return None  # pytest's own collection
    return WithoutGloo.from_parent(parent, path=module_path)


@pytest.fixture(scope="session")
def stage_directory(tmp_path_factory):
    """Where the shared launches' stages write (checkpoints, references); one per session."""
    return tmp_path_factory.mktemp("stages")


@pytest.fixture(scope="session")
def two_rank_stages(stage_directory):
    """Every stage registered for 2 ranks, run in one launch (see _ranks.run_stages)."""
    from _ranks import run_stages

    return run_stages(2, str(stage_directory))


@pytest.fixture(scope="session")
def three_rank_stages(stage_directory, two_rank_stages):
    """Every stage registered for 3 ranks, in one launch, after the 2-rank stages."""
    from _ranks import run_stages

    return run_stages(3, str(stage_directory))
