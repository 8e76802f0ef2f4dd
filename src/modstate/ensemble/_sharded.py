"""Member-parallel ensembles: the member dim sharded over the ranks of a 1-D ``DeviceMesh``.

``Ensemble(models, mesh=mesh)`` and ``Ensemble.from_factory(factory, n, mesh=mesh)`` keep a
`MemberShards`: the ensemble's registered parameters and buffers are ``DTensor`` s with
``Shard(0)`` over the mesh, of global shape ``(n, ...)``, so an optimizer, ``state_dict`` and
``save_distributed`` see the whole ensemble, each rank storing and computing only its members.
Members are split as ``torch.chunk`` splits the member dim (as ``Shard(0)`` does): rank ``r`` of
``w`` holds members ``r * ceil(n / w)`` onwards; an uneven split is fine, a rank left without
members is refused.

Forward runs this rank's members with an ordinary ensemble (``local``, the batched kernels) on
the local pieces of the sharded tensors, through ``DTensor.to_local`` (so gradients come back
sharded like the parameters, without communication), and returns outputs as ``DTensor`` s
sharded on the member dim; ``full_tensor()`` gathers them.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch import Tensor, nn

from modstate._core.call import call
from modstate._core.extract import extract
from modstate._core.load import load
from modstate._core.module.anatomy import slot_at
from modstate._core.torch_facts import functorch_active, is_dtensor
from modstate._core.trees.flat import flatten, unflatten
from modstate.ensemble._stacked_state import mirror


def member_range(count: int, mesh: Any, caller: str) -> range:
    """The members rank ``mesh.get_local_rank()`` holds, split as ``torch.chunk`` / ``Shard(0)``
    split ``count`` rows; a rank that would hold none is refused."""
    if mesh.ndim != 1:
        raise ValueError(
            f"{caller}: the mesh has {mesh.ndim} dims; a member-parallel ensemble needs a 1-D "
            "DeviceMesh (shard the members over one of its dims: mesh['name'])"
        )
    ranks = mesh.size()
    per_rank = -(-count // ranks)  # ceil, as torch.chunk
    holding = -(-count // per_rank)
    if holding < ranks:
        sizes = [min(per_rank, count - r * per_rank) for r in range(holding)]
        raise ValueError(
            f"{caller}: {count} members over {ranks} ranks split as Shard(0) splits the member "
            f"dim ({', '.join(map(str, sizes))}), so ranks {holding} to {ranks - 1} would hold "
            "no member; use a member count that leaves every rank at least one (such as a "
            f"multiple of {ranks}), or a smaller mesh"
        )
    start = mesh.get_local_rank() * per_rank
    return range(start, min(start + per_rank, count))


class MemberShards:
    """The members of an ensemble spread over a 1-D mesh: which are here, how the stacked
    state is registered as ``DTensor`` s, and how a call runs this rank's members."""

    def __init__(self, mesh: Any, count: int, caller: str) -> None:
        self.mesh = mesh
        self.count = count
        self.here = member_range(count, mesh, caller)

    def register(self, local_stacked: nn.Module, root: nn.Module) -> None:
        """Register on ``root`` a ``DTensor`` (``Shard(0)``, global shape ``(count, ...)``) for
        every tensor of ``local_stacked`` (this rank's members), parameters as parameters."""
        from torch.distributed.tensor import DTensor, Shard

        owners = {"": root}
        made: dict[int, Tensor] = {}
        for path, tensor in flatten(extract(local_stacked)).items():
            prefix, _, name = path.rpartition(".")
            owner = mirror(owners, prefix)
            slot = slot_at(local_stacked, path)
            sharded = made.get(id(tensor))
            if sharded is None:
                piece = tensor.detach()
                shape = (self.count, *piece.shape[1:])
                sharded = DTensor.from_local(
                    piece, self.mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                    stride=_contiguous_stride(shape),
                )  # fmt: skip
                if not slot.is_buffer:
                    sharded = nn.Parameter(sharded, requires_grad=tensor.requires_grad)
                made[id(tensor)] = sharded
            if slot.is_buffer:
                owner.register_buffer(name, sharded, persistent=slot.persistent)
            else:
                assert isinstance(sharded, nn.Parameter)
                owner.register_parameter(name, sharded)

    def forward(
        self, local: nn.Module, stacked: nn.Module, in_dims: Any, args: tuple, kwargs: dict
    ) -> Any:
        """Run this rank's members (``local``) on the local pieces of ``stacked``; outputs are
        ``DTensor`` s sharded on the member dim."""
        if functorch_active():
            raise NotImplementedError(
                "Ensemble: a member-parallel ensemble cannot run under torch.func transforms "
                "(grad, vmap, ...), whose wrappers DTensor's conversions do not support; take "
                "gradients with torch.autograd.grad or loss.backward() (they come back as "
                "sharded DTensors)"
            )
        local_state = optree.tree_map(_local_piece, extract(stacked))  # type: ignore[arg-type]
        if in_dims is not None:
            args = tuple(self._local_rows(arg) for arg in args)
        out = call(local, {"stacked": local_state}, *args, **kwargs)
        return optree.tree_map(self._sharded_output, out)

    def _local_rows(self, value: Any) -> Any:
        if is_dtensor(value):
            return value.to_local()
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == self.count:
            return value[self.here.start : self.here.stop]
        return value

    def _sharded_output(self, value: Any) -> Any:
        from torch.distributed.tensor import DTensor, Shard

        if not isinstance(value, Tensor):
            return value
        shape = (self.count, *value.shape[1:])
        return DTensor.from_local(
            value, self.mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
            stride=_contiguous_stride(shape),
        )  # fmt: skip

    def member(self, stacked: nn.Module, template_member: nn.Module, i: int) -> nn.Module:
        """Member ``i`` gathered into ``template_member`` (an ordinary copy of the model): a
        collective, every rank calls it and gets the member."""
        full = {path: t.full_tensor()[i] for path, t in flatten(extract(stacked)).items()}
        load(template_member, unflatten(full))
        return template_member

    def describe(self) -> str:
        return (
            f"members={self.count} over {self.mesh.size()} ranks, here "
            f"{self.here.start}..{self.here.stop - 1}"
        )


def _local_piece(value: Any) -> Any:
    return value.to_local() if is_dtensor(value) else value


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))
