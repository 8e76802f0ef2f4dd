"""Member-parallel ensembles (``Ensemble(..., mesh=...)``) on real gloo process groups.

Two ranks build an 8-member ensemble whose member dim is sharded over them, check it against the
same members in one ordinary ensemble, train it with ``torch.optim`` and ``modstate.optim``, save
it with ``save_distributed`` and record the next training step; three ranks (members split
unevenly), and then this pytest process alone (no process group, an ordinary ensemble), resume from the checkpoint and take the
same next step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _ranks import stage
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import modstate as ms
import modstate.optim  # ms.optim
import modstate.tree  # ms.tree
from modstate import checkpoint

pytestmark = pytest.mark.distributed

MEMBERS = 8
TOLERANCE = {"atol": 1e-6, "rtol": 1e-5}


def factory() -> nn.Module:
    return nn.Sequential(
        nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def built_alone(count: int, seed: int) -> ms.Ensemble:
    """The one-process ensemble that ``from_factory`` builds from global seed ``seed``: a mesh
    ensemble whose first rank's global state came from that seed holds the same members."""
    torch.manual_seed(seed)
    return ms.Ensemble.from_factory(factory, count)


def seeded_members(count: int) -> list[nn.Module]:
    """Member i built under torch.manual_seed(i): models to pass to Ensemble(models)."""
    models = []
    for i in range(count):
        torch.manual_seed(i)
        models.append(factory())
    return models


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)  # the same batch on every rank
    return torch.randn(10, 4, generator=generator), torch.randn(10, 3, generator=generator)


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error; a member-sharded output is gathered first (its backward hands each
    rank the gradient of its own members, without communication)."""
    return (full(out) - target).pow(2).mean()


def full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def full_tree(tree: dict) -> dict:
    return ms.tree.map(full, tree)


def assert_close_trees(actual: dict, expected: dict) -> None:
    actual, expected = ms.flatten(full_tree(actual)), ms.flatten(full_tree(expected))
    assert list(actual) == list(expected)
    for path, want in expected.items():
        assert torch.allclose(actual[path], want, **TOLERANCE), path


def adam_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    x, y = batch(seed)
    loss = loss_of(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def primed_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """A fresh optimizer's state as a ``like`` template (one step with zero gradients, lr 0)."""
    lr = optimizer.param_groups[0]["lr"]
    optimizer.param_groups[0]["lr"] = 0.0
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad()
    optimizer.param_groups[0]["lr"] = lr
    return ms.optim.optimizer_state(optimizer, model)


# --- two ranks: build, compare, train, save -----------------------------------------------------


@stage(2)
def train_and_save_on_two_ranks(rank: int, world_size: int, directory: str) -> list[int]:
    saved = Path(directory)
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(1000 + rank)  # the ranks' random states differ: the first rank's decides
    before = torch.get_rng_state()
    ensemble = ms.Ensemble.from_factory(factory, MEMBERS, mesh=mesh)
    assert not torch.equal(torch.get_rng_state(), before)  # one draw: the next ensemble differs
    reference = built_alone(MEMBERS, seed=1000)
    assert isinstance(ensemble, ms.Ensemble) and len(ensemble) == MEMBERS
    assert f"members=8 over 2 ranks, here {4 * rank}..{4 * rank + 3}" in repr(ensemble)

    # The state: DTensors sharded on the member dim, this rank holding its 4 members.
    for path, leaf in ms.flatten(ensemble.tree()).items():
        assert isinstance(leaf, DTensor) and leaf.placements == (Shard(0),), path
        assert leaf.shape[0] == MEMBERS and leaf.to_local().shape[0] == MEMBERS // world_size
    assert_close_trees(ensemble.tree(), reference.tree())  # member i as on one process

    # Forward on shared inputs: outputs sharded on the member dim.
    x, y = batch(0)
    out = ensemble(x)
    assert isinstance(out, DTensor) and out.placements == (Shard(0),)
    assert torch.allclose(out.full_tensor(), reference(x), **TOLERANCE)

    # Every rank passing all the models builds the same ensemble.
    from_models = ms.Ensemble(seeded_members(MEMBERS), mesh=mesh)
    assert_close_trees(from_models.tree(), ms.Ensemble(seeded_members(MEMBERS)).tree())

    # Seeds given: member i is torch.manual_seed(i); factory() bit for bit, whichever rank
    # builds it, and no rank's random state moves.
    state = torch.get_rng_state()
    seeded = ms.Ensemble.from_factory(factory, MEMBERS, mesh=mesh, seeds=list(range(MEMBERS)))
    assert torch.equal(torch.get_rng_state(), state)
    alone = ms.flatten(ms.stack_modules(seeded_members(MEMBERS)))
    for path, leaf in ms.flatten(seeded.tree()).items():
        assert torch.equal(leaf.full_tensor(), alone[path]), path

    # Per-member inputs (in_dims=0): a full tensor, each rank takes its members' rows.
    per_member = torch.randn(MEMBERS, 5, 4, generator=torch.Generator().manual_seed(5))
    by_member = ms.Ensemble(seeded_members(MEMBERS), mesh=mesh, in_dims=0)
    want = ms.Ensemble(seeded_members(MEMBERS), in_dims=0)(per_member)
    assert torch.allclose(by_member(per_member).full_tensor(), want, **TOLERANCE)

    # Uneven: 3 members over 2 ranks split 2 + 1 (the fix the refusal below names: a count that
    # leaves every rank a member); a rank without members is refused.
    torch.manual_seed(2000 + rank)
    uneven = ms.Ensemble.from_factory(factory, 3, mesh=mesh)
    assert uneven.stacked.get_submodule("0").weight.to_local().shape[0] == (2, 1)[rank]
    assert torch.allclose(uneven(x).full_tensor(), built_alone(3, seed=2000)(x), **TOLERANCE)
    with pytest.raises(ValueError, match="1 members over 2 ranks.*rank.* 1 .*no member"):
        ms.Ensemble.from_factory(factory, 1, mesh=mesh)

    # member(i) gathers member i into an ordinary module (a collective).
    member = ensemble.member(5)
    assert torch.allclose(member(x), reference(x)[5], **TOLERANCE)

    # Training with torch.optim: the same steps as the ordinary ensemble.
    adam = torch.optim.Adam(ensemble.parameters(), lr=1e-2)
    reference_adam = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for step in range(3):
        adam_step(ensemble, adam, step)
        adam_step(reference, reference_adam, step)
    assert_close_trees(ensemble.tree(), reference.tree())

    # Training with modstate.optim: pure steps on trees of DTensors, gradients by autograd
    # through a stateless call.
    torch.manual_seed(3000 + rank)
    functional = ms.Ensemble.from_factory(factory, MEMBERS, mesh=mesh)
    plain = built_alone(MEMBERS, seed=3000)
    optimizer = ms.optim.adam(lr=1e-2)
    trees = {"mesh": ms.tree.detach(functional.tree()), "plain": ms.tree.detach(plain.tree())}
    states = {key: optimizer.init(tree) for key, tree in trees.items()}
    for step in range(2):
        x, y = batch(10 + step)
        for key, module in (("mesh", functional), ("plain", plain)):
            leaves = ms.tree.map(lambda t: t.detach().requires_grad_(), trees[key])
            loss = loss_of(ms.call(module, {"stacked": leaves}, x), y)
            paths = list(ms.flatten(leaves))
            grads = torch.autograd.grad(loss, list(ms.flatten(leaves).values()))
            grads = ms.unflatten(dict(zip(paths, grads, strict=True)))
            trees[key], states[key] = optimizer.step(trees[key], grads, states[key])
    for leaf in ms.flatten(trees["mesh"]).values():
        assert isinstance(leaf, DTensor) and leaf.placements == (Shard(0),)
    assert_close_trees(trees["mesh"], trees["plain"])
    with pytest.raises(NotImplementedError, match="torch.func"):
        torch.func.grad(lambda t: ms.call(functional, {"stacked": t}, x).sum())(trees["mesh"])

    # Save, then record the next step for the resumed runs to compare with.
    training = {
        "model": ms.extract(ensemble),
        "optimizer": ms.optim.optimizer_state(adam, ensemble),
    }
    checkpoint.save_distributed(training, saved / "member-parallel")
    adam_step(ensemble, adam, 99)
    after = full_tree(ensemble.tree())
    if rank == 0:
        torch.save(after, saved / "member-parallel-next-step.pt")
    return list(ensemble.members_here)


@stage(3)
def resume_on_three_ranks(rank: int, world_size: int, directory: str) -> list[int]:
    saved = Path(directory)
    mesh = init_device_mesh("cpu", (world_size,))
    ensemble = ms.Ensemble.from_factory(factory, MEMBERS, mesh=mesh)
    adam = torch.optim.Adam(ensemble.parameters(), lr=1e-2)
    like = {"model": ms.extract(ensemble), "optimizer": primed_optimizer_state(adam, ensemble)}
    training = checkpoint.load_distributed(saved / "member-parallel", like)
    ms.load(ensemble, training["model"])
    ms.optim.load_optimizer_state(adam, ensemble, training["optimizer"])
    adam_step(ensemble, adam, 99)
    assert_close_trees(ensemble.tree(), torch.load(saved / "member-parallel-next-step.pt"))
    return list(ensemble.members_here)


@pytest.fixture(scope="module")
def trained_on_two_ranks(two_rank_stages, stage_directory) -> Path:
    # The stages ran in the shared launches of the folder's 2-rank and 3-rank stages.
    assert two_rank_stages["train_and_save_on_two_ranks"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    return stage_directory


def test_two_ranks_train_their_members_and_save(trained_on_two_ranks):
    assert (trained_on_two_ranks / "member-parallel" / ".metadata").exists()


def test_three_ranks_resume_with_the_same_next_step(three_rank_stages):
    # 8 members over 3 ranks split unevenly, 3 + 3 + 2, as Shard(0) splits the member dim.
    held = three_rank_stages["resume_on_three_ranks"]
    assert held == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_one_process_resumes_with_an_ordinary_ensemble(trained_on_two_ranks):
    ensemble = ms.Ensemble(seeded_members(MEMBERS))
    adam = torch.optim.Adam(ensemble.parameters(), lr=1e-2)
    like = {"model": ms.extract(ensemble), "optimizer": primed_optimizer_state(adam, ensemble)}
    training = checkpoint.load_distributed(trained_on_two_ranks / "member-parallel", like)
    ms.load(ensemble, training["model"])
    ms.optim.load_optimizer_state(adam, ensemble, training["optimizer"])
    adam_step(ensemble, adam, 99)
    assert_close_trees(
        ensemble.tree(), torch.load(trained_on_two_ranks / "member-parallel-next-step.pt")
    )
