"""Modules sharded with FSDP2 or tensor parallel: the one place that knows their machinery.

FSDP2 (``fully_shard``) keeps each parameter as a sharded ``DTensor`` and, in a forward pre-hook,
all-gathers its *own* copies into the module's slots (initialising itself lazily on the first
forward); a forward hook puts the shards back. Tensor parallel (``parallelize_module``) keeps
``DTensor`` parameters and converts inputs and outputs in forward hooks. Neither sees a tree put
into the slots: FSDP overwrites it, and its lazy initialisation would adopt it.

So a stateless call on such a module computes what the *unsharded* module computes: the tree's
``DTensor`` leaves are gathered into full tensors by `gathered` (differentiable, also under
``torch.func.grad``: the gradient comes back as a ``DTensor`` laid out like the leaf), and the
parallelism's forward hooks are bypassed for the duration (`Sharding.bypass`), so FSDP's
state (lazy init, reshard, all-gather buffers) is never touched. ``swap`` is refused on
FSDP-managed parameters (FSDP would put its own back), and ``load`` copies a full tensor into a
sharded one by taking this rank's piece.

Nothing here imports ``torch.distributed`` unless it was imported already: a module can only be
sharded if it was.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .torch_facts import is_dtensor, unwrapped

# Forward hooks defined in these packages are the parallelism's own: FSDP2's pre-forward
# all-gather / post-forward reshard, and the input/output conversions of tensor-parallel styles.
_PARALLEL_HOOK_PACKAGES = ("torch.distributed.fsdp.", "torch.distributed.tensor.")


def holds_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``DTensor``, or a ``torch.func`` wrapper (``grad``, ``vmap``) of
    one."""
    if not isinstance(value, Tensor) or "torch.distributed.tensor" not in sys.modules:
        return False
    return is_dtensor(unwrapped(value))


def _is_fsdp_module(module: nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def _is_parallel_hook(hook: Any) -> bool:
    owner = getattr(hook, "__module__", None) or ""
    return owner.startswith(_PARALLEL_HOOK_PACKAGES)


class Sharding:
    """How a module is sharded: its parallelism hooks, and which slots FSDP2 owns.

    ``hooks``: ``(module, hook dict name, key)`` of every FSDP2 / tensor-parallel forward hook.
    ``fsdp_owned``: ``id(module._parameters) -> (module path, FSDP module path)`` for the
    parameters that FSDP2 manages (those of an ``fully_shard``-ed module and its submodules).
    """

    __slots__ = ("fsdp_owned", "hooks")

    def __init__(
        self,
        hooks: list[tuple[nn.Module, str, Any]],
        fsdp_owned: dict[int, tuple[str, str]],
    ) -> None:
        self.hooks = hooks
        self.fsdp_owned = fsdp_owned

    def bypass(self) -> Callable[[], None]:
        """Take the parallelism's forward hooks off; return the function that puts them back
        where they were (same order, hooks added meanwhile kept)."""
        saved: dict[int, tuple[dict[Any, Any], dict[Any, Any], set[Any]]] = {}
        for module, name, key in self.hooks:
            table = vars(module)[name]
            entry = saved.get(id(table))
            if entry is None:
                entry = saved[id(table)] = (table, dict(table), set())
            if key in table:
                del table[key]
                entry[2].add(key)

        def restore() -> None:
            for table, before, removed in saved.values():
                now = dict(table)
                table.clear()
                table.update(
                    (key, value) for key, value in before.items() if key in now or key in removed
                )
                table.update((key, value) for key, value in now.items() if key not in before)

        return restore

    def check_swappable(self, tables: list[dict[str, Any]], names: list[str]) -> None:
        """Refuse, naming the path, a permanent swap of a parameter that FSDP2 owns."""
        for table, name in zip(tables, names):
            owner = self.fsdp_owned.get(id(table))
            if owner is not None:
                path = f"{owner[0]}.{name}" if owner[0] else name
                fsdp_path = owner[1] or "the root module"
                raise ValueError(
                    f"{path!r}: {fsdp_path!r} is sharded with FSDP2 (fully_shard), which owns "
                    "this parameter and all-gathers its own copy before every forward, so "
                    "swap cannot replace it; use ms.load to copy values into it (identity "
                    "kept), or ms.inject / ms.call to compute with another tree"
                )

    def check_loadable(self, tables: list[dict[str, Any]], names: list[str]) -> None:
        """Refuse, naming the path, an in-place load into parameters that FSDP2 holds gathered
        (between forward and backward): FSDP reshards from its own shards, so it would be lost."""
        for table, name in zip(tables, names):
            owner = self.fsdp_owned.get(id(table))
            if owner is not None and not is_dtensor(table.get(name)):
                path = f"{owner[0]}.{name}" if owner[0] else name
                fsdp_path = owner[1] or "the root module"
                raise ValueError(
                    f"{path!r}: {fsdp_path!r} (FSDP2) holds its gathered parameters now (after a "
                    "forward whose backward has not run, or with reshard_after_forward=False), "
                    "and reshards from its own shards, so a load into them would be lost; call "
                    "reshard() on that module (or finish the backward) first"
                )

    def refuse_state_dict_route(self, operation: str) -> None:
        """Refuse ``use_state_dict=True`` for a computing swap: that route swaps the tensors in
        as they are, which the parallelism's forward hooks would replace or misread."""
        raise ValueError(
            f"{operation}(..., use_state_dict=True) on a module sharded with FSDP2 or tensor "
            f"parallel is not supported: the module's forward hooks would not compute with the "
            f"tree; use {operation}(...) without use_state_dict (the tree's paths are the "
            "module's own, as extract gives them)"
        )


def sharding_of(modules: list[tuple[str, nn.Module]], tensors: list[Any]) -> Sharding | None:
    """The `Sharding` of a module tree (``(path, module)`` pairs as ``named_modules``
    gives them, and every tensor its slots hold), or None if nothing in it is sharded."""
    if "torch.distributed.tensor" not in sys.modules:
        return None
    if modules and getattr(modules[0][1], "_modstate_computes_with_dtensors", False):
        return None  # a module whose forward takes its DTensors as they are (an Ensemble on a mesh)
    # Only the hooks themselves: the *_with_kwargs / always_called flags of a hook that is not
    # there are never read.
    hooks = [
        (module, name, key)
        for _, module in modules
        for name in ("_forward_pre_hooks", "_forward_hooks")
        for key, hook in vars(module)[name].items()
        if _is_parallel_hook(hook)
    ]
    fsdp_owned: dict[int, tuple[str, str]] = {}
    fsdp_roots: list[str] = []
    for path, module in modules:
        if _is_fsdp_module(module):
            fsdp_roots.append(path)
        root = next((r for r in reversed(fsdp_roots) if _is_under(path, r)), None)
        if root is not None:
            fsdp_owned[id(module._parameters)] = (path, root)
    if not hooks and not fsdp_owned and not any(map(is_dtensor, tensors)):
        return None
    return Sharding(hooks, fsdp_owned)


def _is_under(path: str, prefix: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


# -- gathering -------------------------------------------------------------------------------------


class _Gather(torch.autograd.Function):
    """``dtensor.full_tensor()`` with a backward that hands each rank its piece of the gradient
    (no communication), in the form ``torch.func`` transforms accept (``setup_context``)."""

    @staticmethod
    def forward(tensor: Tensor) -> Tensor:  # type: ignore[override]
        return tensor.full_tensor()  # type: ignore[attr-defined]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        dtensor = unwrapped(inputs[0])  # torch.func hands its wrapper here
        ctx.mesh = dtensor.device_mesh
        ctx.placements = dtensor.placements

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return piece_of(grad, ctx.mesh, ctx.placements)


def piece_of(full: Tensor, mesh: Any, placements: Any) -> Tensor:
    """This rank's piece of ``full`` (the same on every rank) as a ``DTensor`` with
    ``placements``, without communication; differentiable outside ``torch.func`` transforms."""
    local = full
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard():
            pieces = torch.chunk(local, mesh.size(mesh_dim), dim=placement.dim)
            index = mesh.get_local_rank(mesh_dim)
            local = pieces[index] if index < len(pieces) else local.narrow(placement.dim, 0, 0)
        elif placement.is_partial():
            raise ValueError("a Partial placement has no piece of a full tensor")
    if not torch._C._functorch.is_functorch_wrapped_tensor(local):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
        )
    # A gradient inside torch.func.grad is wrapped once per grad level; from_local (an
    # autograd.Function without setup_context) cannot run there, so the DTensor is made around
    # the innermost tensor and wrapped again, level by level.
    levels = []
    while torch._C._functorch.is_functorch_wrapped_tensor(local):
        levels.append(torch._C._functorch.maybe_get_level(local))
        local = torch._C._functorch.get_unwrapped(local)
    piece = _dtensor_around(local, mesh, placements, full.shape, full.stride())
    for level in reversed(levels):
        piece = torch._C._functorch._wrap_for_grad(piece, level)
    return piece


def _dtensor_around(local: Tensor, mesh: Any, placements: Any, shape: Any, stride: Any) -> Tensor:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, tuple(placements), TensorMeta(shape, stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)


def partial_leaf(values: list[Any]) -> int | None:
    """The index of the first value that is a ``DTensor`` with a ``Partial`` placement (a pending
    sum, which has no piece of a gradient to give back), or None."""
    for index, value in enumerate(values):
        if holds_dtensor(value) and any(p.is_partial() for p in unwrapped(value).placements):
            return index
    return None


def gathered(values: list[Any]) -> list[Any]:
    """``values`` with every ``DTensor`` replaced by its full tensor (differentiably); one gather
    per distinct tensor, so tied leaves stay one tensor. The leaves sharded on dim 0 over one
    1-D mesh, FSDP2's layout, are gathered together in one collective."""
    distinct: dict[int, Any] = {}
    for value in values:
        if holds_dtensor(value):
            distinct.setdefault(id(value), value)
    if not distinct:
        return values
    batches: dict[Any, list[Any]] = {}
    singles = []
    for value in distinct.values():
        inner = unwrapped(value)
        placements = inner.placements
        if inner.device_mesh.ndim == 1 and len(placements) == 1 and placements[0].is_shard(0):
            batches.setdefault((id(inner.device_mesh), inner.dtype, inner.device), []).append(value)
        else:
            singles.append(value)
    full: dict[int, Tensor] = {}
    for batch in batches.values():
        if len(batch) == 1:
            singles += batch
            continue
        for value, whole in zip(batch, _GatherRows.apply(*batch)):
            full[id(value)] = whole
    for value in singles:
        full[id(value)] = _Gather.apply(value)
    return [full.get(id(value), value) if isinstance(value, Tensor) else value for value in values]


class _GatherRows(torch.autograd.Function):
    """Full tensors of several ``DTensor`` s sharded on dim 0 over one 1-D mesh, in one
    all-gather (each rank's rows padded to the same count, as FSDP2 does); backward hands each
    rank its rows of every gradient, without communication."""

    @staticmethod
    def forward(*tensors: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        import torch.distributed as dist

        mesh = tensors[0].device_mesh
        ranks = mesh.size()
        rows = [-(-t.shape[0] // ranks) for t in tensors]  # rows per rank, as torch.chunk
        pieces = []
        for t, count in zip(tensors, rows):
            local = t.to_local()
            if local.shape[0] < count:
                padding = local.new_zeros((count - local.shape[0], *local.shape[1:]))
                local = torch.cat([local, padding])
            pieces.append(local.reshape(-1))
        send = torch.cat(pieces)
        receive = send.new_empty(ranks * send.numel())
        dist.all_gather_into_tensor(receive, send, group=mesh.get_group())
        receive = receive.view(ranks, send.numel())
        out, offset = [], 0
        for t, piece, count in zip(tensors, pieces, rows):
            block = receive[:, offset : offset + piece.numel()]
            out.append(block.reshape(ranks * count, *t.shape[1:])[: t.shape[0]].clone())
            offset += piece.numel()
        return tuple(out)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        inner = [unwrapped(t) for t in inputs]
        ctx.specs = [(t.device_mesh, t.placements) for t in inner]

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        return tuple(
            None if grad is None else piece_of(grad, mesh, placements)
            for grad, (mesh, placements) in zip(grads, ctx.specs)
        )


def loadable(currents: list[Any], values: list[Any]) -> list[Any]:
    """``values`` made copyable into ``currents``: a full tensor going into a ``DTensor`` becomes
    this rank's piece of it (every rank holds the same full tensor), a ``DTensor`` going into
    a plain tensor its full tensor."""
    out = []
    for current, value in zip(currents, values):
        if is_dtensor(current) and isinstance(value, Tensor) and not is_dtensor(value):
            value = piece_of(value.detach(), current.device_mesh, current.placements)
        elif is_dtensor(value) and not is_dtensor(current):
            value = value.full_tensor()
        out.append(value)
    return out
