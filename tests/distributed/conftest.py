"""tests/distributed needs torch.distributed with gloo; builds without it skip the whole folder."""

import pytest
import torch.distributed as dist

if not (dist.is_available() and dist.is_gloo_available()):
    collect_ignore_glob = ["test_*.py"]


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
