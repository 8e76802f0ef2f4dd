"""Member-parallel ensembles: the member dim sharded over the ranks of a 1-D ``DeviceMesh``.

``Ensemble(models, mesh=mesh)`` and ``Ensemble.from_factory(factory, n, mesh=mesh)`` build a
`MemberParallelEnsemble`. Its registered parameters and buffers are ``DTensor`` s with
``Shard(0)`` over the mesh, of global shape ``(n, ...)``: an optimizer, ``state_dict`` and
``save_distributed`` see the whole ensemble, each rank storing and computing only its members.
Members are split as ``torch.chunk`` splits the member dim (as ``Shard(0)`` does): rank ``r`` of
``w`` holds members ``r * ceil(n / w)`` onwards; an uneven split is fine, a rank left without
members is refused.

Forward runs this rank's members with an ordinary [`Ensemble`][modstate.Ensemble] (the batched
kernels) on the local pieces of the sharded tensors, through ``DTensor.to_local`` (so gradients
come back sharded like the parameters, without communication), and returns outputs as
``DTensor`` s sharded on the member dim; ``full_tensor()`` gathers them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import optree
import torch
from torch import Tensor, nn

from modstate._core.anatomy import slot_at
from modstate._core.call import call
from modstate._core.extract import extract
from modstate._core.flat import flatten, unflatten
from modstate._core.torch_facts import functorch_active, is_dtensor

from ._ensemble import Ensemble, _mirror


def member_range(count: int, mesh: Any) -> range:
    """The members rank ``mesh.get_local_rank()`` holds, split as ``torch.chunk`` / ``Shard(0)``
    split ``count`` rows; a rank that would hold none is refused."""
    if mesh.ndim != 1:
        raise ValueError(
            f"a member-parallel ensemble needs a 1-D DeviceMesh, got one with {mesh.ndim} dims "
            "(shard the members over one of them: mesh['name'])"
        )
    ranks = mesh.size()
    per_rank = -(-count // ranks)  # ceil, as torch.chunk
    holding = -(-count // per_rank)
    if holding < ranks:
        sizes = [min(per_rank, count - r * per_rank) for r in range(holding)]
        raise ValueError(
            f"{count} members over {ranks} ranks: split as Shard(0) splits the member dim "
            f"({', '.join(map(str, sizes))}), ranks {holding} to {ranks - 1} would hold no member; "
            f"use a member count that leaves every rank at least one (such as a multiple of "
            f"{ranks}), or a smaller mesh"
        )
    rank = mesh.get_local_rank()
    start = rank * per_rank
    return range(start, min(start + per_rank, count))


class MemberParallelEnsemble(Ensemble):
    """An [`Ensemble`][modstate.Ensemble] whose members are spread over the ranks of a 1-D mesh.

    Built by ``Ensemble(models, mesh=mesh)`` (every rank passes all ``n`` models and keeps its
    own) or ``Ensemble.from_factory(factory, n, mesh=mesh)`` (every rank builds only its members,
    member ``i`` under ``torch.manual_seed(i)``, so member ``i`` is the same model whatever the
    number of ranks; the caller's random state is left as it was).

    ``stacked`` holds ``DTensor`` s (``Shard(0)``, global shape ``(n, ...)``); ``forward`` on
    shared inputs (``in_dims=None``) or on per-member inputs (``in_dims=0``: a ``DTensor``
    sharded on dim 0, or a full tensor of which each rank takes its members' rows) returns
    ``DTensor`` s sharded on the member dim. ``member(i)`` and ``members()`` gather the state
    (collectives: every rank calls them). ``local`` is the ordinary ensemble of this rank's
    members that computes the forward.

    ``ms.call(ensemble, tree, x)`` with a tree of such DTensors works under ``torch.autograd``
    (gradients come back sharded like the tree); ``torch.func`` transforms over it are refused
    (DTensor's own conversions do not run under them).
    """

    # Tells the swap engine not to gather the DTensors: forward takes them as they are.
    _modstate_computes_with_dtensors = True

    def __init__(
        self,
        modules: Iterable[nn.Module],
        *,
        mesh: Any,
        **options: Any,
    ) -> None:
        modules = list(modules)
        mine = member_range(len(modules), mesh)
        self._build([modules[i] for i in mine], len(modules), mesh, options)

    @classmethod
    def from_factory(
        cls, factory: Callable[[], nn.Module], n: int, *, mesh: Any = None, **options: Any
    ) -> MemberParallelEnsemble:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        if mesh is None:
            raise ValueError("a member-parallel ensemble needs mesh=, a 1-D DeviceMesh")
        models = []
        for i in member_range(n, mesh):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(i)
                models.append(factory())
        ensemble = cls.__new__(cls)
        ensemble._build(models, n, mesh, options)
        return ensemble

    def _build(self, models: list[nn.Module], count: int, mesh: Any, options: dict) -> None:
        from torch.distributed.tensor import DTensor, Shard

        nn.Module.__init__(self)
        local = Ensemble(models, **options)
        self.__dict__["local"] = local  # computes; its own tensors are placeholders
        self.__dict__["mesh"] = mesh
        self.count = count
        self.members_here = member_range(count, mesh)
        self.stacked = nn.Module()
        owners = {"": self.stacked}
        made: dict[int, Tensor] = {}
        for path, tensor in flatten(extract(local.stacked)).items():
            prefix, _, name = path.rpartition(".")
            owner = owners.get(prefix) or _mirror(owners, prefix)
            slot = slot_at(local.stacked, path)
            sharded = made.get(id(tensor))
            if sharded is None:
                piece = tensor.detach()
                sharded = DTensor.from_local(
                    piece, mesh, [Shard(0)], run_check=False,
                    shape=(count, *piece.shape[1:]), stride=_contiguous_stride((count, *piece.shape[1:])),
                )  # fmt: skip
                if not slot.is_buffer:
                    sharded = nn.Parameter(sharded, requires_grad=tensor.requires_grad)
                made[id(tensor)] = sharded
            if slot.is_buffer:
                owner.register_buffer(name, sharded, persistent=slot.persistent)
            else:
                owner.register_parameter(name, sharded)
        self.training = local.training

    # -- running -----------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if functorch_active():
            raise NotImplementedError(
                "a member-parallel ensemble cannot run under torch.func transforms (grad, vmap, "
                "...): DTensor's conversions do not support them; take gradients with "
                "torch.autograd.grad or loss.backward() (they come back as sharded DTensors)"
            )
        local_state = optree.tree_map(_local_piece, extract(self.stacked))
        if self.local.in_dims is not None:
            args = tuple(self._local_rows(arg) for arg in args)
        out = call(self.local, {"stacked": local_state}, *args, **kwargs)
        return optree.tree_map(self._sharded_output, out)

    def _local_rows(self, value: Any) -> Any:
        if is_dtensor(value):
            return value.to_local()
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == self.count:
            members = self.members_here
            return value[members.start : members.stop]
        return value

    def _sharded_output(self, value: Any) -> Any:
        from torch.distributed.tensor import DTensor, Shard

        if not isinstance(value, Tensor):
            return value
        shape = (self.count, *value.shape[1:])
        return DTensor.from_local(
            value, self.mesh, [Shard(0)], run_check=False, shape=shape,
            stride=_contiguous_stride(shape),
        )  # fmt: skip

    def tree(self) -> dict[str, Any]:
        """The stacked state as a tree of ``DTensor`` s (``Shard(0)``), like ``extract(model)``."""
        return extract(self.stacked)

    # -- members -----------------------------------------------------------------------------------

    def member(self, i: int) -> nn.Module:
        """Member ``i`` as an ordinary module (a collective: every rank calls it, and every rank
        gets the member)."""
        if not isinstance(i, int) or not -self.count <= i < self.count:
            raise IndexError(f"member index {i!r} out of range for an ensemble of {self.count}")
        full = {path: t.full_tensor()[i] for path, t in flatten(self.tree()).items()}
        module = self.local.member(0)
        from modstate._core.inject import load

        load(module, unflatten(full))
        return module

    def members(self) -> list[nn.Module]:
        return [self.member(i) for i in range(self.count)]

    def train(self, mode: bool = True) -> MemberParallelEnsemble:
        nn.Module.train(self, mode)
        self.local.train(mode)
        return self

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Any:
        nn.Module._apply(self, fn, recurse)
        self.local._apply(fn, recurse)
        return self

    @property
    def in_dims(self) -> Any:
        return self.local.in_dims

    @property
    def randomness(self) -> str:
        return self.local.randomness

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "a member-parallel ensemble holds a DeviceMesh and cannot be pickled or deep-copied; "
            "save it with modstate.checkpoint.save_distributed"
        )

    def __deepcopy__(self, memo: dict) -> Any:
        self.__getstate__()

    def __repr__(self) -> str:
        members = self.members_here
        return (
            f"MemberParallelEnsemble(\n  members={self.count} over {self.mesh.size()} ranks, "
            f"here {members.start}..{members.stop - 1}\n  local="
            + repr(self.local).replace("\n", "\n  ")
            + "\n)"
        )


def _local_piece(value: Any) -> Any:
    return value.to_local() if is_dtensor(value) else value


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))
