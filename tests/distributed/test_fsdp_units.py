"""Calls on FSDP2 modules gather one unit at a time and apply the MixedPrecisionPolicy, on real
gloo groups (2 ranks, the folder's shared launch).

- A probe on every unit sees, when the unit starts, that only its own parameters are gathered in
  the slots, and what became of the units before it: without autograd their full tensors are
  gone; with autograd (``torch.func.grad`` or ``.backward()``) autograd still holds them, but
  their memory is released, and the backward gathers them again (the gradients are right).
- ``MixedPrecisionPolicy`` (per unit, nested, ``param_dtype`` / ``reduce_dtype`` /
  ``output_dtype``): a call with the module's own tree equals ``module(x)`` bit for bit, and
  ``torch.func.grad`` through it equals the module's own gradients.
- FSDP2 over tensor parallel (2-D meshes 2x1 and 1x2): calls compute the unsharded model and the
  module trains on.
- Edges: ``register_fsdp_forward_method``, a unit whose output is a view modified in place,
  ``call_partial`` with a partial tree, ``torch.func.grad`` of ``vmap_call`` (``vmap`` of
  ``grad`` refused, naming it), a gradient penalty on the inputs (a second derivative through
  the leaves' gradient pieces refused), a tree modified in place between forward and backward
  (refused).
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from _ranks import stage
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import modstate as ms
import modstate.tree  # ms.tree

from zoo import forward_with

pytestmark = pytest.mark.distributed

TOLERANCE = {"atol": 1e-6, "rtol": 1e-5}
UNITS = 6


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, **TOLERANCE)


def full(tree: dict) -> dict:
    return ms.tree.map(lambda t: t.full_tensor() if isinstance(t, DTensor) else t, tree)


def same_grads(grads: dict, want: dict, like: dict) -> bool:
    """DTensor gradients laid out like ``like``, equal to the unsharded ``want``."""
    flat, wanted, layout = ms.flatten(grads), ms.flatten(want), ms.flatten(like)
    return all(
        isinstance(g, DTensor)
        and g.placements == layout[path].placements
        and close(g.full_tensor(), wanted[path])
        for path, g in flat.items()
    )


def batch(seed: int, rows: int = 5, width: int = 16) -> torch.Tensor:
    torch.manual_seed(seed)  # the same batch on every rank
    return torch.randn(rows, width)


def chain(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(UNITS)])


def innermost(tensor: torch.Tensor) -> torch.Tensor:
    while torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return tensor


class Probe:
    """A forward pre-hook on every unit (it runs after the call's stand-in for FSDP's): which
    units hold gathered parameters, and what became of the earlier units' full tensors."""

    def __init__(self, units: list[nn.Module]) -> None:
        self.units = units
        self.earlier: list[weakref.ref] = []
        self.fates: set[str] = set()
        self.handles = [unit.register_forward_pre_hook(self.pre) for unit in units]

    def pre(self, module: nn.Module, args: tuple) -> None:
        gathered = [
            i for i, u in enumerate(self.units) if not isinstance(innermost(u.weight), DTensor)
        ]
        assert gathered == [self.units.index(module)], gathered
        for ref in self.earlier:
            tensor = ref()
            if tensor is None:
                self.fates.add("gone")
            elif tensor.untyped_storage().nbytes() == 0:
                self.fates.add("released")
            else:
                self.fates.add("held")
        self.earlier += [weakref.ref(innermost(module.weight)), weakref.ref(innermost(module.bias))]

    def run(self, fn):
        self.earlier, self.fates = [], set()
        fn()
        return self.fates

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@stage(2)
def one_unit_at_a_time(rank: int, world_size: int, directory: str) -> list[str]:
    mesh = init_device_mesh("cpu", (world_size,))
    model, reference = chain(0), chain(0)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    tree = ms.tree.map(lambda t: t.detach() * 0.5, ms.extract(model))
    x = batch(1)
    want = forward_with(reference, full(tree), x)
    probe = Probe(list(model))
    fates = []

    def no_grad_call() -> None:
        with torch.no_grad():
            assert close(ms.call(model, tree, x), want)

    def injected() -> None:
        with torch.no_grad(), ms.inject(model, tree):
            assert close(model(x), want)

    def loss(params: dict, module: nn.Module) -> torch.Tensor:
        return ms.call(module, params, x).pow(2).sum()

    want_grads = torch.func.grad(loss)(full(tree), reference)

    def func_grad() -> None:
        assert same_grads(torch.func.grad(loss)(tree, model), want_grads, tree)

    leaves = ms.tree.map(lambda t: t.detach().requires_grad_(), tree)

    def backward() -> None:
        loss(leaves, model).backward()

    fates.append(probe.run(no_grad_call))
    fates.append(probe.run(injected))
    fates.append(probe.run(func_grad))
    fates.append(probe.run(backward))
    probe.remove()
    assert same_grads(ms.tree.map(lambda t: t.grad, leaves), want_grads, tree)
    # Without autograd the earlier units' full tensors are gone; with it autograd holds them,
    # released, until the backward gathers them again.
    assert fates == [{"gone"}, {"gone"}, {"released"}, {"released"}], fates
    with torch.no_grad():  # the module's own forward is FSDP's, as before
        assert close(model(x), forward_with(reference, full(ms.extract(model)), x))
    model.reshard()
    return ["gone", "released"]


def mixed_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.ReLU(),
        nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 5)),
    )


@stage(2)
def mixed_precision(rank: int, world_size: int, directory: str) -> str:
    """Per-unit policies, nested: a call with the module's own tree is the module's forward,
    bit for bit, and its gradients are FSDP's own (every rank has the same batch)."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = mixed_model(0)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fp16 = MixedPrecisionPolicy(
        param_dtype=torch.float16, reduce_dtype=torch.float16, output_dtype=torch.float32
    )
    fully_shard(model[0], mesh=mesh, mp_policy=bf16)
    fully_shard(model[2][2], mesh=mesh, mp_policy=fp16)
    fully_shard(model[2], mesh=mesh, mp_policy=bf16)
    fully_shard(
        model,
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float64),
    )
    x = batch(2, rows=3, width=8)
    tree = ms.extract(model, detach=True)
    out = ms.call(model, tree, x)
    with ms.inject(model, tree):
        injected = model(x)
    own = model(x)
    assert own.dtype == out.dtype == torch.float64
    assert torch.equal(out, own.detach()) and torch.equal(injected, own.detach())
    # Without the policy the call would compute in float32: the check above can fail.
    assert not torch.equal(out, ms.call(mixed_model(0), full(tree), x).double())
    own.pow(2).sum().backward()
    grads = torch.func.grad(lambda t: ms.call(model, t, x).pow(2).sum())(tree)
    for path, parameter in model.named_parameters():
        grad = ms.flatten(grads)[path]
        assert grad.dtype == torch.float32 and grad.placements == parameter.grad.placements
        assert torch.equal(grad.to_local(), parameter.grad.to_local()), path
    return "equal"


def two_dimensional(seed: int, mesh) -> tuple[nn.Module, nn.Module]:
    """FSDP2 over tensor parallel: layers 0 and 2 column- and row-wise over the "tp" dim, every
    layer sharded over "dp"."""
    torch.manual_seed(seed)
    layers = [nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3)]
    model = nn.Sequential(*layers)
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model[0], mesh=mesh["dp"])
    fully_shard(model[2], mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, reference


@stage(2)
def fsdp_over_tensor_parallel(rank: int, world_size: int, directory: str) -> list[str]:
    done = []
    for shape in ((world_size, 1), (1, world_size)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        model, reference = two_dimensional(0, mesh)
        x = batch(3, width=4)
        changed = ms.tree.map(lambda t: t.detach() * 1.5 + 0.25, ms.extract(model))
        want = forward_with(reference, full(changed), x)
        assert close(ms.call(model, changed, x), want), shape

        def loss(params: dict, module: nn.Module, x: torch.Tensor = x) -> torch.Tensor:
            return ms.call(module, params, x).pow(2).sum()

        grads = torch.func.grad(loss)(changed, model)
        assert same_grads(grads, torch.func.grad(loss)(full(changed), reference), changed), shape
        # The module's own forward and a training step are FSDP's and TP's, as before.
        for module in (model, reference):
            out = module(x)
            out = out.full_tensor() if isinstance(out, DTensor) else out
            out.pow(2).mean().backward()
            with torch.no_grad():
                for parameter in module.parameters():
                    parameter -= 0.1 * parameter.grad
                    parameter.grad = None
        with torch.no_grad():
            own = model(x)
        model.reshard()
        own = own.full_tensor() if isinstance(own, DTensor) else own
        assert close(own, reference(x)), shape
        assert close(ms.call(model, ms.extract(model), x), reference(x)), shape
        done.append("x".join(map(str, shape)))
    return done


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 16)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) * 2


class Transposed(nn.Module):
    """A unit whose output is a view (of its last op's result)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).t()


class Edges(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.transposed = Transposed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder.encode(x)  # a method registered with register_fsdp_forward_method
        y = self.transposed(h)
        y.mul_(2)  # in place on a unit's view output
        return y.t()


def edges(seed: int) -> Edges:
    torch.manual_seed(seed)
    return Edges()


@stage(2)
def edge_cases(rank: int, world_size: int, directory: str) -> str:
    mesh = init_device_mesh("cpu", (world_size,))
    model, reference = edges(0), edges(0)
    fully_shard(model.encoder, mesh=mesh)
    register_fsdp_forward_method(model.encoder, "encode")
    fully_shard(model.transposed, mesh=mesh)
    fully_shard(model, mesh=mesh)
    registered = vars(model.encoder)["encode"]
    tree = ms.tree.map(lambda t: t.detach() * 2, ms.extract(model))
    x = batch(4)

    def loss(params: dict, module: nn.Module) -> torch.Tensor:
        return ms.call(module, params, x).pow(2).sum()

    assert close(ms.call(model, tree, x), forward_with(reference, full(tree), x))
    want_grads = torch.func.grad(loss)(full(tree), reference)
    assert same_grads(torch.func.grad(loss)(tree, model), want_grads, tree)
    leaves = ms.tree.map(lambda t: t.detach().requires_grad_(), tree)
    loss(leaves, model).backward()
    assert same_grads(ms.tree.map(lambda t: t.grad, leaves), want_grads, tree)
    assert vars(model.encoder)["encode"] is registered  # FSDP's wrapper is back
    # call_partial: the paths a tree leaves out keep the module's own (gathered with their unit).
    part = {"transposed": tree["transposed"]}
    merged = {**full(ms.extract(model)), "transposed": full(part)["transposed"]}
    assert close(ms.call_partial(model, part, x), forward_with(reference, merged, x))

    # A tree changed in place between the forward and the backward is refused (the backward
    # gathers it again); changing it after the backward is the fix.
    value = loss(leaves, model)
    with torch.no_grad():
        leaves["encoder"]["layer"]["weight"].add_(1.0)
    try:
        value.backward()
    except RuntimeError as error:
        assert "modified in place between the forward and the backward" in str(error), error
    else:
        raise AssertionError("a tree modified before the backward was accepted")
    value = loss(leaves, model)
    value.backward()
    with torch.no_grad():
        leaves["encoder"]["layer"]["weight"].add_(1.0)

    # A second derivative through the leaves' gradient pieces is refused; with respect to the
    # inputs (a gradient penalty) it works, as the message says.
    value = loss(leaves, model)
    try:
        torch.autograd.grad(value, list(ms.flatten(leaves).values()), create_graph=True)
    except NotImplementedError as error:
        assert "with respect to the inputs" in str(error), error
    else:
        raise AssertionError("a second derivative through gradient pieces was accepted")

    def penalized(params: dict, module: nn.Module) -> list[torch.Tensor]:
        params = ms.tree.map(lambda t: t.detach().requires_grad_(), params)
        inputs = x.clone().requires_grad_()
        out = ms.call(module, params, inputs)
        (slope,) = torch.autograd.grad(out.sum(), inputs, create_graph=True)
        (out.pow(2).sum() + slope.pow(2).sum()).backward()
        return [
            leaf.grad.full_tensor() if isinstance(leaf.grad, DTensor) else leaf.grad
            for leaf in ms.flatten(params).values()
        ]

    for got, wanted in zip(penalized(tree, model), penalized(full(tree), reference), strict=True):
        assert close(got, wanted)

    # torch.func.grad of vmap_call over a stack of trees; vmap of grad is refused, naming it.
    stacked = ms.stack([tree, ms.tree.map(lambda t: t * 0.5, tree)])

    def stacked_loss(params: dict, module: nn.Module) -> torch.Tensor:
        return ms.vmap_call(module, params, x).pow(2).sum()

    grads = torch.func.grad(stacked_loss)(stacked, model)
    assert same_grads(grads, torch.func.grad(stacked_loss)(full(stacked), reference), stacked)
    try:
        torch.vmap(torch.func.grad(loss), in_dims=(0, None))(stacked, model)
    except NotImplementedError as error:
        assert "torch.func.grad of ms.vmap_call" in str(error), error
    else:
        raise AssertionError("vmap of grad through a sharded call was accepted")
    with torch.no_grad():
        own = model(x)
    model.reshard()
    assert close(own, forward_with(reference, full(ms.extract(model)), x))
    return "ok"


def test_only_one_unit_is_gathered_at_a_time(two_rank_stages):
    assert two_rank_stages["one_unit_at_a_time"] == [["gone", "released"]] * 2


def test_mixed_precision_policy_applies_as_in_the_modules_own_forward(two_rank_stages):
    assert two_rank_stages["mixed_precision"] == ["equal"] * 2


def test_fsdp_over_tensor_parallel_computes_the_unsharded_model(two_rank_stages):
    assert two_rank_stages["fsdp_over_tensor_parallel"] == [["2x1", "1x2"]] * 2


def test_forward_methods_view_outputs_vmap_and_modified_trees(two_rank_stages):
    assert two_rank_stages["edge_cases"] == ["ok"] * 2
