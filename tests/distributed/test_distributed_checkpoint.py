"""Sharded trees through torch.distributed.checkpoint, on real gloo process groups.

One group of 2 ranks trains tiny models sharded with FSDP2 (``fully_shard``) and tensor
parallel (``parallelize_module``), checks what ``extract`` sees, and saves them with
``save_distributed``; one group of 3 ranks loads those checkpoints into its own layouts
(2 -> 3); this pytest process loads them without any process group (2 -> 1). The ranks check
themselves (a failed assert fails the test with that rank's traceback) and leave full-tensor
references on disk for the later stages.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from _ranks import stage
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import modstate as ms
import modstate.optim  # ms.optim
import modstate.tree  # ms.tree
from modstate import checkpoint

pytestmark = pytest.mark.distributed


def tiny_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


def shard_fsdp2(model: nn.Module, mesh) -> nn.Module:
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def shard_tensor_parallel(model: nn.Module, mesh) -> nn.Module:
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def train_one_step(model: nn.Module) -> None:
    torch.manual_seed(123)  # the same batch on every rank
    model(torch.randn(6, 4)).pow(2).mean().backward()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter -= 0.1 * parameter.grad
            parameter.grad = None


def adam_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)  # the same batch on every rank
    model(torch.randn(6, 4)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def primed_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """A fresh optimizer's state as a ``like`` template: it has no entries until it steps, so
    take one step with zero gradients and learning rate 0 (what torch's
    ``set_optimizer_state_dict`` does too); the loaded values then replace them."""
    learning_rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad()
    for group, lr in zip(optimizer.param_groups, learning_rates, strict=True):
        group["lr"] = lr
    return ms.optim.optimizer_state(optimizer, model)


def full_tensors(tree: dict) -> dict:
    """The tree with every DTensor gathered (a collective: every rank calls it)."""
    return ms.tree.map(lambda t: t.full_tensor() if isinstance(t, DTensor) else t, tree)


def assert_trees_equal(actual: dict, expected: dict) -> None:
    actual, expected = ms.flatten(actual), ms.flatten(expected)
    assert list(actual) == list(expected)
    for path, want in expected.items():
        assert torch.equal(actual[path], want), path


# --- stage 1: two ranks train, inspect and save -------------------------------------------


@stage(2)
def save_on_two_ranks(rank: int, world_size: int, directory: str) -> str:
    out = Path(directory)
    mesh = init_device_mesh("cpu", (world_size,))

    model = shard_fsdp2(tiny_model(0), mesh)
    train_one_step(model)
    tree = ms.extract(model)
    # extract reads the module's own parameters: FSDP2 keeps them as DTensor shards.
    assert tree["0"]["weight"] is model[0].weight
    assert all(isinstance(leaf, DTensor) for leaf in ms.flatten(tree).values())
    assert tree["0"]["weight"].to_local().shape == (4, 4)  # 8 rows over 2 ranks

    # use_state_dict=True sees exactly what torch's distributed state_dict API sees.
    ours = ms.flatten(ms.extract(model, use_state_dict=True))
    theirs = get_model_state_dict(model)
    assert list(ours) == list(theirs)
    for path, want in theirs.items():
        assert ours[path].placements == want.placements, path
        assert torch.equal(ours[path].to_local(), want.to_local()), path

    # Tree operations keep DTensor leaves sharded.
    doubled = ms.tree.map(lambda t: t * 2, ms.tree.detach(tree))
    copy = ms.tree.clone(tree)
    for path, leaf in ms.flatten(doubled).items():
        original = ms.flatten(tree)[path]
        assert isinstance(leaf, DTensor) and leaf.placements == original.placements, path
        assert torch.equal(leaf.to_local(), 2 * original.to_local()), path
        assert torch.equal(ms.flatten(copy)[path].to_local(), original.to_local()), path

    # A single-file checkpoint refuses shards rather than writing a rank's slice.
    with pytest.raises(TypeError, match=r"'0\.weight'.*DTensor"):
        checkpoint.save(tree, out / f"never-{rank}.safetensors")

    state = {"model": tree, "step": torch.tensor(7), "config": {"_extra_state": {"lr": 0.1}}}
    checkpoint.save_distributed(state, out / "fsdp")
    reference = full_tensors(tree)
    if rank == 0:
        checkpoint.save(reference, out / "fsdp-full.safetensors")

    # load into a sharded model copies into its shards, in place.
    weight = model[0].weight
    ms.load(model, doubled)
    assert model[0].weight is weight
    assert_trees_equal(full_tensors(ms.extract(model)), ms.tree.mul(reference, 2))

    # A checkpoint that torch itself writes from the state_dict loads with load_distributed.
    import torch.distributed.checkpoint as dcp

    dcp.save(get_model_state_dict(model), checkpoint_id=str(out / "torch-written"))

    # Model and Adam state (DTensor moments) in one checkpoint; then the step that follows it.
    trained = shard_fsdp2(tiny_model(2), mesh)
    adam = torch.optim.Adam(trained.parameters(), lr=0.01)
    for seed in (1, 2):
        adam_step(trained, adam, seed)
    optimizer_tree = ms.optim.optimizer_state(adam, trained)
    assert isinstance(optimizer_tree["state"]["0"]["weight"]["exp_avg"], DTensor)
    training = {"model": ms.extract(trained), "optimizer": optimizer_tree}
    checkpoint.save_distributed(training, out / "training")
    adam_step(trained, adam, seed=3)
    after_next_step = full_tensors(ms.extract(trained))
    if rank == 0:
        checkpoint.save(after_next_step, out / "training-next-step.safetensors")

    tensor_parallel = shard_tensor_parallel(tiny_model(1), mesh)
    train_one_step(tensor_parallel)
    tp_tree = ms.extract(tensor_parallel)
    assert tp_tree["0"]["weight"].placements[0].is_shard(0)  # column parallel
    assert tp_tree["2"]["weight"].placements[0].is_shard(1)  # row parallel
    checkpoint.save_distributed(tp_tree, out / "tp")
    tp_reference = full_tensors(tp_tree)
    if rank == 0:
        checkpoint.save(tp_reference, out / "tp-full.safetensors")
    return sorted(os.listdir(out / "fsdp"))[0]


@pytest.fixture(scope="module")
def saved_by_two_ranks(two_rank_stages, stage_directory) -> Path:
    # save_on_two_ranks ran in the shared launch of every 2-rank stage (conftest.py).
    assert len(two_rank_stages["save_on_two_ranks"]) == 2
    return stage_directory


def test_two_ranks_each_write_their_shards(saved_by_two_ranks):
    files = sorted(os.listdir(saved_by_two_ranks / "fsdp"))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]


# --- stage 2: three ranks load into their own layouts -------------------------------------


@stage(3)
def load_on_three_ranks(rank: int, world_size: int, directory: str) -> bool:
    out = Path(directory)
    mesh = init_device_mesh("cpu", (world_size,))
    reference = checkpoint.load(out / "fsdp-full.safetensors")

    model = shard_fsdp2(tiny_model(5), mesh)
    like = {
        "model": ms.extract(model),
        "step": torch.tensor(0),
        "config": {"_extra_state": {}},
    }
    like_before = full_tensors(like["model"])
    loaded = checkpoint.load_distributed(out / "fsdp", like)

    assert_trees_equal(full_tensors(like["model"]), like_before)  # like is only a template
    for path, leaf in ms.flatten(loaded["model"]).items():
        template = ms.flatten(like["model"])[path]
        assert isinstance(leaf, DTensor) and leaf.placements == template.placements, path
        assert leaf.to_local().shape == template.to_local().shape, path  # 3-way shards
    assert_trees_equal(full_tensors(loaded["model"]), reference)
    assert loaded["step"].item() == 7
    assert loaded["config"] == {"_extra_state": {"lr": 0.1}}

    # Into the sharded model: it now computes what the saved model computed.
    ms.load(model, loaded["model"])
    plain = tiny_model(9)
    ms.load(plain, reference)
    x = torch.randn(3, 4)
    assert torch.allclose(model(x), plain(x), atol=1e-6)

    # Tensor parallel on 3 ranks, from tensor parallel on 2 and from FSDP2 on 2.
    tensor_parallel = shard_tensor_parallel(tiny_model(5), mesh)
    tp_like = ms.extract(tensor_parallel)
    from_tp = checkpoint.load_distributed(out / "tp", tp_like)
    assert_trees_equal(full_tensors(from_tp), checkpoint.load(out / "tp-full.safetensors"))
    from_fsdp = checkpoint.load_distributed(out / "fsdp", {"model": tp_like}, strict=False)
    assert from_fsdp["model"]["2"]["weight"].placements == tp_like["2"]["weight"].placements
    assert_trees_equal(full_tensors(from_fsdp["model"]), reference)

    # Training resumes on 3 ranks: the next step is the one the 2 ranks took.
    resumed = shard_fsdp2(tiny_model(5), mesh)
    adam = torch.optim.Adam(resumed.parameters(), lr=0.01)
    like = {"model": ms.extract(resumed), "optimizer": primed_optimizer_state(adam, resumed)}
    training = checkpoint.load_distributed(out / "training", like)
    ms.load(resumed, training["model"])
    ms.optim.load_optimizer_state(adam, resumed, training["optimizer"])
    adam_step(resumed, adam, seed=3)
    expected = checkpoint.load(out / "training-next-step.safetensors")
    for path, leaf in ms.flatten(full_tensors(ms.extract(resumed))).items():
        # Gradients are averaged over 3 ranks instead of 2: equal up to float rounding.
        torch.testing.assert_close(leaf, ms.flatten(expected)[path], rtol=1e-6, atol=1e-7)

    # ... and without a warm-up step: the optimizer's state read as saved (full tensors), laid
    # out like the sharded parameters by load_optimizer_state.
    resumed = shard_fsdp2(tiny_model(5), mesh)
    adam = torch.optim.Adam(resumed.parameters(), lr=0.01)
    training = checkpoint.load_distributed(
        out / "training", {"model": ms.extract(resumed)}, as_saved=["optimizer"]
    )
    ms.load(resumed, training["model"])
    ms.optim.load_optimizer_state(adam, resumed, training["optimizer"])
    assert isinstance(adam.state[resumed[0].weight]["exp_avg"], DTensor)
    adam_step(resumed, adam, seed=3)
    for path, leaf in ms.flatten(full_tensors(ms.extract(resumed))).items():
        torch.testing.assert_close(leaf, ms.flatten(expected)[path], rtol=1e-6, atol=1e-7)

    # What torch's own dcp.save wrote (the doubled model) loads the same way.
    from_torch = checkpoint.load_distributed(out / "torch-written", ms.extract(model))
    assert_trees_equal(full_tensors(from_torch), ms.tree.mul(reference, 2))
    return True


def test_a_checkpoint_written_by_two_ranks_loads_on_three(three_rank_stages):
    assert three_rank_stages["load_on_three_ranks"] == [True] * 3


# --- crafted checkpoints: refused on every rank, before their code runs ------------------


class MakesADirectoryWhenUnpickled:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@stage(2)
def write_crafted_checkpoints_on_two_ranks(rank: int, world_size: int, directory: str) -> bool:
    import torch.distributed.checkpoint as dcp

    out = Path(directory)
    marker = out / "crafted-marker"
    model = shard_fsdp2(tiny_model(0), init_device_mesh("cpu", (world_size,)))
    # torch's own dcp.save pickles any value; save_distributed would refuse this one.
    state = {**get_model_state_dict(model), "payload": MakesADirectoryWhenUnpickled(marker)}
    dcp.save(state, checkpoint_id=str(out / "crafted-value"))
    if rank == 0:  # the tensor-parallel checkpoint, its .metadata hiding a call
        shutil.copytree(out / "tp", out / "crafted-metadata")
        metadata = dcp.FileSystemReader(str(out / "tp")).read_metadata()
        metadata.version = MakesADirectoryWhenUnpickled(marker)
        (out / "crafted-metadata" / ".metadata").write_bytes(pickle.dumps(metadata))
    return not marker.exists()


@stage(3)
def refuse_crafted_checkpoints_on_three_ranks(rank: int, world_size: int, directory: str) -> bool:
    out = Path(directory)
    mesh = init_device_mesh("cpu", (world_size,))
    like = {**ms.extract(shard_fsdp2(tiny_model(5), mesh)), "payload": None}
    before = full_tensors({k: v for k, v in like.items() if k != "payload"})
    with pytest.raises(ValueError, match=r"crafted-value': .*'payload': it calls posix\.mkdir"):
        checkpoint.load_distributed(out / "crafted-value", like)
    tp_like = ms.extract(shard_tensor_parallel(tiny_model(5), mesh))
    with pytest.raises(ValueError, match=r"crafted-metadata': its \.metadata names posix\.mkdir"):
        checkpoint.load_distributed(out / "crafted-metadata", tp_like)
    torch.distributed.barrier()  # every rank has tried both loads
    assert not (out / "crafted-marker").exists()
    assert like["payload"] is None
    assert_trees_equal(full_tensors({k: v for k, v in like.items() if k != "payload"}), before)
    return True


def test_crafted_checkpoints_are_refused_on_every_rank(three_rank_stages, stage_directory):
    assert three_rank_stages["refuse_crafted_checkpoints_on_three_ranks"] == [True] * 3
    assert not (stage_directory / "crafted-marker").exists()


def test_crafted_checkpoints_were_written_without_running_their_payload(two_rank_stages):
    assert two_rank_stages["write_crafted_checkpoints_on_two_ranks"] == [True, True]


# --- stage 3: one process, no process group -----------------------------------------------


def test_loads_in_one_process_without_a_process_group_as_full_tensors(saved_by_two_ranks):
    assert not torch.distributed.is_initialized()
    like = {"model": ms.extract(tiny_model(3)), "step": torch.tensor(0), "config": {}}
    like["config"]["_extra_state"] = None

    loaded = checkpoint.load_distributed(saved_by_two_ranks / "fsdp", like)

    reference = checkpoint.load(saved_by_two_ranks / "fsdp-full.safetensors")
    assert_trees_equal(loaded["model"], reference)
    assert not isinstance(loaded["model"]["0"]["weight"], DTensor)
    assert loaded["step"].item() == 7 and loaded["config"]["_extra_state"] == {"lr": 0.1}
    model = tiny_model(3)
    ms.load(model, loaded["model"])
    assert torch.equal(model[2].bias, reference["2"]["bias"])


def test_training_resumes_in_one_process_with_the_same_next_step(saved_by_two_ranks):
    model = tiny_model(4)
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    like = {"model": ms.extract(model), "optimizer": primed_optimizer_state(adam, model)}

    training = checkpoint.load_distributed(saved_by_two_ranks / "training", like)
    ms.load(model, training["model"])
    ms.optim.load_optimizer_state(adam, model, training["optimizer"])
    assert adam.state[model[0].weight]["step"].item() == 2
    assert adam.param_groups[0]["betas"] == (0.9, 0.999)  # non-tensor leaves come back as saved
    adam_step(model, adam, seed=3)

    expected = checkpoint.load(saved_by_two_ranks / "training-next-step.safetensors")
    for path, leaf in ms.flatten(ms.extract(model)).items():
        torch.testing.assert_close(leaf.detach(), ms.flatten(expected)[path], rtol=1e-6, atol=1e-7)


def test_tensor_parallel_checkpoint_loads_in_one_process(saved_by_two_ranks):
    loaded = checkpoint.load_distributed(saved_by_two_ranks / "tp", ms.extract(tiny_model(3)))
    assert_trees_equal(loaded, checkpoint.load(saved_by_two_ranks / "tp-full.safetensors"))


def test_ties_in_like_come_back_as_one_tensor(tmp_path):
    tied = torch.randn(3)
    checkpoint.save_distributed({"embed": tied, "head": tied}, tmp_path / "tied")
    template = torch.zeros(3)

    loaded = checkpoint.load_distributed(tmp_path / "tied", {"embed": template, "head": template})

    assert loaded["embed"] is loaded["head"]
    assert torch.equal(loaded["head"], tied) and torch.equal(template, torch.zeros(3))


def test_a_mismatched_like_is_refused_naming_the_paths(saved_by_two_ranks):
    saved = saved_by_two_ranks / "tp"
    wrong_shape = ms.extract(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 5)))
    with pytest.raises(ValueError, match=r"'2\.weight' has shape \(4, 8\) in the checkpoint"):
        checkpoint.load_distributed(saved, wrong_shape)

    partial = ms.extract(tiny_model(0))
    del partial["2"]
    with pytest.raises(ValueError, match=r"'2\.weight', .* in the checkpoint but not in like"):
        checkpoint.load_distributed(saved, partial)
    assert list(checkpoint.load_distributed(saved, partial, strict=False)) == ["0"]

    as_double = ms.tree.to(ms.extract(tiny_model(0)), torch.float64)
    with pytest.raises(ValueError, match=r"'0\.weight' has dtype torch\.float32"):
        checkpoint.load_distributed(saved, as_double)
    cast = checkpoint.load_distributed(saved, as_double, strict=False)
    reference = checkpoint.load(saved_by_two_ranks / "tp-full.safetensors")
    assert cast["0"]["weight"].dtype == torch.float64
    assert torch.equal(cast["0"]["weight"], reference["0"]["weight"].double())


def test_an_unfinished_checkpoint_is_refused(saved_by_two_ranks, tmp_path):
    unfinished = tmp_path / "unfinished"
    shutil.copytree(saved_by_two_ranks / "tp", unfinished)
    os.remove(unfinished / ".metadata")
    with pytest.raises(FileNotFoundError, match=r"\.metadata file, written last"):
        checkpoint.load_distributed(unfinished, ms.extract(tiny_model(0)))
    with pytest.raises(FileNotFoundError, match="not a directory"):
        checkpoint.load_distributed(tmp_path / "missing", ms.extract(tiny_model(0)))


def test_save_distributed_refuses_meta_tensors_before_writing(tmp_path):
    tree = {"ok": torch.ones(2), "lazy": {"weight": torch.empty(2, device="meta")}}
    with pytest.raises(ValueError, match=r"'lazy\.weight': it is a meta tensor"):
        checkpoint.save_distributed(tree, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_save_distributed_without_a_process_group_writes_one_process_checkpoint(tmp_path):
    tree = {"model": ms.extract(tiny_model(0)), "step": torch.tensor(3)}
    checkpoint.save_distributed(tree, tmp_path / "single")
    loaded = checkpoint.load_distributed(tmp_path / "single", ms.tree.zeros_like(tree))
    assert_trees_equal(loaded, ms.tree.detach(tree))
