"""Functional calls on modules sharded with FSDP2 and tensor parallel, on real gloo groups.

One 2-rank stage (run with the folder's other 2-rank stages) checks every layout (FSDP2 on the root only, per layer plus
root, nested blocks; tensor parallel colwise/rowwise): a stateless call with a tree of DTensors
laid out like the module's own computes what the unsharded module computes with the full tree,
``torch.func.grad`` through it gives the unsharded gradients as DTensors laid out like the tree,
the module is left as it was (same objects, same hooks) and trains normally afterwards, also when
the call came before its first forward (FSDP's lazy initialisation).
"""

from __future__ import annotations

import pytest
import torch
from _ranks import stage
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import modstate as ms
import modstate.tree  # ms.tree

from zoo import forward_with

pytestmark = pytest.mark.distributed

TOLERANCE = {"atol": 1e-6, "rtol": 1e-5}


def mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3))


def nested(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU()),
        nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3)),
    )


def fsdp_root_only(mesh):
    return fully_shard(mlp(0), mesh=mesh), mlp(0)


def fsdp_per_layer(mesh):
    model = mlp(0)
    for index in (0, 2, 4):
        fully_shard(model[index], mesh=mesh)
    return fully_shard(model, mesh=mesh), mlp(0)


def fsdp_nested(mesh):
    model = nested(0)
    fully_shard(model[1][0], mesh=mesh)
    fully_shard(model[1], mesh=mesh)
    return fully_shard(model, mesh=mesh), nested(0)


def tensor_parallel(mesh):
    # The last layer alone returns its output as a DTensor sharded by columns, which the tests
    # gather; a stateless call returns what the unsharded module returns, the full output.
    plan = {
        "0": ColwiseParallel(),
        "2": RowwiseParallel(),
        "4": ColwiseParallel(use_local_output=False),
    }
    return parallelize_module(mlp(0), mesh, plan), mlp(0)


LAYOUTS = {
    "fsdp2 root only": fsdp_root_only,
    "fsdp2 per layer": fsdp_per_layer,
    "fsdp2 nested": fsdp_nested,
    "tensor parallel": tensor_parallel,
}


def batch(seed: int, rows: int = 5) -> torch.Tensor:
    torch.manual_seed(seed)  # the same batch on every rank
    return torch.randn(rows, 4)


def sgd_step(model: nn.Module, x: torch.Tensor) -> None:
    out = model(x)
    out = out.full_tensor() if isinstance(out, DTensor) else out
    out.pow(2).mean().backward()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter -= 0.1 * parameter.grad
            parameter.grad = None


def full(tree: dict) -> dict:
    return ms.tree.map(lambda t: t.full_tensor() if isinstance(t, DTensor) else t, tree)


def perturbed(tree: dict) -> dict:
    return ms.tree.map(lambda t: t.detach() * 1.5 + 0.25, tree)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, **TOLERANCE)


def hook_tables(model: nn.Module) -> list:
    return [
        (path, name, list(vars(m)[name].items()))
        for path, m in model.named_modules()
        for name in ("_forward_pre_hooks", "_forward_hooks")
    ]


def local_output(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's own forward, gathered; an FSDP root keeps its parameters gathered after a
    forward without backward, so it is resharded as a training loop's backward would."""
    with torch.no_grad():
        out = model(x)
    if isinstance(model, FSDPModule):
        model.reshard()
    return out.full_tensor() if isinstance(out, DTensor) else out


def check_layout(name: str, build, mesh) -> None:
    # 1. A module that never ran: a call comes first, then training works as usual.
    sharded, reference = build(mesh)
    fresh_tree = perturbed(ms.extract(sharded))
    x = batch(1)
    out = ms.call(sharded, fresh_tree, x)
    assert close(out, forward_with(reference, full(fresh_tree), x)), name
    sgd_step(sharded, batch(2))
    sgd_step(reference, batch(2))

    # 2. After training, a tree of DTensors with changed values.
    tree = ms.extract(sharded)
    objects = list(ms.flatten(tree).values())
    hooks = hook_tables(sharded)
    flags = [p.requires_grad for p in sharded.parameters()]
    assert close(local_output(sharded, x), reference(x)), name
    changed = perturbed(tree)
    want = forward_with(reference, full(changed), x)
    assert not close(want, reference(x))  # the check below can fail
    assert close(ms.call(sharded, changed, x), want), name
    with ms.inject(sharded, changed):
        assert close(sharded(x), want), name

    # torch.func.grad through call: DTensor gradients laid out like the tree, values unsharded.
    def loss(params, model, inputs):
        return ms.call(model, params, inputs).pow(2).sum()

    grads = torch.func.grad(loss)(changed, sharded, x)
    want_grads = torch.func.grad(loss)(full(changed), reference, x)
    assert ms.flatten(grads).keys() == ms.flatten(changed).keys(), name
    for path, g in ms.flatten(grads).items():
        leaf = ms.flatten(changed)[path]
        assert isinstance(g, DTensor), (name, path)
        assert g.placements == leaf.placements, (name, path)
        assert close(g.full_tensor(), ms.flatten(want_grads)[path]), (name, path)
    # ... and through plain autograd into the tree's own leaves.
    leaves = ms.tree.map(lambda t: t.detach().requires_grad_(), changed)
    ms.call(sharded, leaves, x).pow(2).sum().backward()
    for path, leaf in ms.flatten(leaves).items():
        assert isinstance(leaf.grad, DTensor), (name, path)
        assert close(leaf.grad.full_tensor(), ms.flatten(want_grads)[path]), (name, path)

    # vmap_call over a stack of such trees.
    other = ms.tree.map(lambda t: t * 0.5, changed)
    stacked_out = ms.vmap_call(sharded, ms.stack([changed, other]), x)
    assert close(stacked_out[0], want), name
    assert close(stacked_out[1], forward_with(reference, full(other), x)), name

    # The module is left exactly as it was, and trains on as before.
    assert all(
        a is b for a, b in zip(ms.flatten(ms.extract(sharded)).values(), objects, strict=True)
    ), name
    assert hook_tables(sharded) == hooks, name
    assert [p.requires_grad for p in sharded.parameters()] == flags, name
    sgd_step(sharded, batch(3))
    sgd_step(reference, batch(3))
    assert close(local_output(sharded, x), reference(x)), name

    # A refused call changes nothing: a shape that does not fit.
    wrong = dict(ms.flatten(changed))
    wrong["0.bias" if "0.bias" in wrong else "0.0.bias"] = torch.zeros(3)
    try:
        ms.call(sharded, ms.unflatten(wrong), x)
    except ValueError as error:
        assert "bias" in str(error) and "shape" in str(error), error
    else:
        raise AssertionError(f"{name}: a wrongly shaped leaf was accepted")
    assert hook_tables(sharded) == hooks, name
    # ... nor does the state_dict route, whose tensors the forward hooks would not see.
    try:
        with ms.inject(sharded, changed, use_state_dict=True):
            raise AssertionError(f"{name}: inject(use_state_dict=True) was accepted")
    except ValueError as error:
        assert "use_state_dict" in str(error), error
    with ms.inject(sharded, changed):  # the fix named
        assert close(sharded(x), want), name
    # ... nor does a pending sum (Partial), which the message says how to redistribute.
    flat = dict(ms.flatten(changed))
    path = next(iter(flat))
    leaf = flat[path]
    pieces = leaf.full_tensor() / leaf.device_mesh.size()  # they sum to the leaf
    flat[path] = DTensor.from_local(pieces, leaf.device_mesh, [Partial()])
    try:
        ms.call(sharded, ms.unflatten(flat), x)
    except ValueError as error:
        assert path in str(error) and "Partial" in str(error), error
    else:
        raise AssertionError(f"{name}: a Partial leaf was accepted")
    flat[path] = flat[path].redistribute(placements=leaf.placements)  # the fix named
    assert close(ms.call(sharded, ms.unflatten(flat), x), want), name
    assert hook_tables(sharded) == hooks, name

    # load copies in place (identity kept), from DTensors or from full tensors.
    tree = ms.extract(sharded)
    objects = list(ms.flatten(tree).values())
    ms.load(sharded, changed)
    assert close(local_output(sharded, x), want), name
    ms.load(sharded, full(other))
    assert close(local_output(sharded, x), forward_with(reference, full(other), x)), name
    assert all(
        a is b for a, b in zip(ms.flatten(ms.extract(sharded)).values(), objects, strict=True)
    ), name
    ms.load(reference, full(other))
    if name == "fsdp2 root only":
        # A root keeps its parameters gathered after a forward without backward: FSDP reshards
        # from its own shards later, so a load then would be lost; it is refused.
        with torch.no_grad():
            sharded(x)
        try:
            ms.load(sharded, full(other))
        except ValueError as error:
            assert "reshard()" in str(error), error
        else:
            raise AssertionError("a load into FSDP's gathered parameters was accepted")
        sharded.reshard()  # the fix named
        ms.load(sharded, full(other))
    sgd_step(sharded, batch(4))
    sgd_step(reference, batch(4))
    assert close(local_output(sharded, x), reference(x)), name

    # swap: refused where FSDP2 owns the parameters (it would put its own back), fine otherwise.
    if name.startswith("fsdp2"):
        try:
            ms.swap(sharded, changed)
        except ValueError as error:
            assert "FSDP2" in str(error) and "ms.load" in str(error), error
        else:
            raise AssertionError(f"{name}: swap on FSDP-owned parameters was accepted")
        assert all(
            a is b for a, b in zip(ms.flatten(ms.extract(sharded)).values(), objects, strict=True)
        )
        ms.load(sharded, changed)  # the fix the message names
        assert close(local_output(sharded, x), want), name
    else:
        old = ms.swap(sharded, ms.tree.map(nn.Parameter, changed))
        assert close(local_output(sharded, x), forward_with(reference, full(changed), x)), name
        ms.swap(sharded, old)
        assert all(
            a is b for a, b in zip(ms.flatten(ms.extract(sharded)).values(), objects, strict=True)
        )


def with_batchnorm(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def check_apply_in_train_mode(mesh) -> None:
    """apply (the pure stateful call) on FSDP2 per layer, BatchNorm in train mode: outputs, new
    statistics and torch.func.grad gradients of the unsharded model; nothing passed in mutated."""
    sharded, reference = with_batchnorm(0), with_batchnorm(0)
    fully_shard(sharded[0], mesh=mesh)
    fully_shard(sharded[3], mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    params, state = ms.split(sharded, detach=True)
    params = perturbed(params)
    assert all(isinstance(leaf, DTensor) for leaf in ms.flatten(params).values())
    before = ms.tree.clone(state)
    x = batch(7, rows=6)

    def loss(params, state, model):
        out, new_state = ms.apply(model, params, state, x)
        return out.pow(2).sum(), new_state

    grads, new_state = torch.func.grad(loss, has_aux=True)(params, state, sharded)
    want_grads, want_state = torch.func.grad(loss, has_aux=True)(full(params), state, reference)
    assert ms.flatten(grads).keys() == ms.flatten(params).keys()
    for path, g in ms.flatten(grads).items():
        assert g.placements == ms.flatten(params)[path].placements, path
        assert close(g.full_tensor(), ms.flatten(want_grads)[path]), path
    for path, value in ms.flatten(want_state).items():
        assert torch.allclose(ms.flatten(new_state)[path].double(), value.double()), path
    assert not close(new_state["1"]["running_mean"], before["1"]["running_mean"])
    for path, value in ms.flatten(before).items():  # nothing passed in was mutated
        assert torch.equal(ms.flatten(state)[path], value), path
        assert torch.equal(ms.flatten(ms.extract(sharded))[path], value), path
    sgd_step(sharded, batch(8, rows=6))  # trains as usual afterwards
    sgd_step(reference, batch(8, rows=6))
    sharded.eval(), reference.eval()
    assert close(local_output(sharded, x), reference(x))


@stage(2)
def every_layout(rank: int, world_size: int, directory: str) -> list[str]:
    mesh = init_device_mesh("cpu", (world_size,))
    for name, build in LAYOUTS.items():
        check_layout(name, build, mesh)
    check_apply_in_train_mode(mesh)
    return list(LAYOUTS)


def test_calls_on_sharded_modules_compute_the_unsharded_model(two_rank_stages):
    # every_layout ran in the shared launch of every 2-rank stage (conftest.py).
    assert two_rank_stages["every_layout"] == [list(LAYOUTS)] * 2
