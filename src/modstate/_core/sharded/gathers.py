"""Gathering ``DTensor`` s into full tensors, differentiably, and gathering them again for backward.

A `Gathered` is one gather of several ``DTensor`` s (one FSDP unit's parameters, say): it
makes their full tensors, optionally cast to a compute dtype first (FSDP2's ``param_dtype``: the
shards are cast before they travel, as FSDP does), and can free those full tensors' memory and
fill it again later (`Gathered.free`, `Gathered.refill`), the way FSDP2 frees a unit's
unsharded parameters after its forward and all-gathers them again before its backward. Autograd
keeps referring to the same tensors throughout; only their storage comes and goes.

`gather` is the differentiable form (also under ``torch.func.grad`` and ``torch.vmap``):
backward hands each rank its piece of the gradient, without communication, as a ``DTensor`` laid
out like the leaf (`piece_of`), cast to FSDP2's ``reduce_dtype`` on the way as FSDP's
gradient reduction would be.

The leaves sharded on dim 0 over one 1-D mesh (FSDP2's layout) travel together in one all-gather
into one buffer, each rank's rows padded to ``torch.chunk``'s row count as FSDP2 pads them; any
other layout (tensor parallel, 2-D meshes, stacked trees) is gathered by DTensor's own
redistribution, one tensor at a time.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor

from modstate._core.torch_facts import functorch_active, is_dtensor
from modstate._core.vmap_levels import grad_levels, grad_wrapped, unwrapped, wrap_for_grad

_VMAP_OF_GRAD = (
    "torch.vmap around torch.func.grad (per-sample gradients) through a call on a sharded module "
    "is not supported: the gradient of a DTensor leaf would be batched, which its pieces cannot "
    "be; put torch.func.grad around the vmap instead (torch.func.grad of ms.vmap_call), or loop "
    "over the samples"
)

_SECOND_ORDER = (
    "a second derivative through the gradient of a sharded call's DTensor leaves "
    "(create_graph=True, torch.func.grad of torch.func.grad, hessian) is not supported: each "
    "rank's gradient piece is cut from its own full gradient, so differentiating it again would "
    "leave out the other ranks' rows; differentiate twice with respect to the inputs only (that "
    "works), or gather the tree (leaf.full_tensor()) and call an unsharded copy of the module"
)


def holds_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``DTensor``, or a ``torch.func`` wrapper (``grad``, ``vmap``) of
    one."""
    if not isinstance(value, Tensor) or "torch.distributed.tensor" not in sys.modules:
        return False
    return is_dtensor(unwrapped(value))


class Gathered:
    """One gather of ``DTensor`` s: their full tensors, and how to free and refill them.

    ``dtypes[i]``: the dtype the i-th full tensor computes in (None: the leaf's own), and
    ``reduce_dtypes[i]`` the dtype its gradient passes through on the way back (None: none).
    ``releasing``: whether the backward frees the full tensors once their gradients are handed
    back (set for a unit freed after its forward).
    """

    __slots__ = ("_versions", "dtypes", "fulls", "reduce_dtypes", "releasing", "sources")

    def __init__(self, dtypes: list[Any], reduce_dtypes: list[Any]) -> None:
        self.dtypes = dtypes
        self.reduce_dtypes = reduce_dtypes
        self.sources: list[Any] = []
        self.fulls: list[Tensor] = []
        self.releasing = False
        self._versions: list[tuple[int, int]] = []

    def gather(self, sources: list[Any]) -> list[Tensor]:
        """The full tensors of ``sources`` (``DTensor`` s, none of them wrapped by torch.func)."""
        self.sources = sources
        with torch.no_grad():
            self._versions = [_version_of(source) for source in sources]
            self.fulls = _fill(sources, self.dtypes, None)
        return self.fulls

    def free(self) -> None:
        """Release the full tensors' memory; whoever holds them (autograd's saved tensors) keeps
        the tensor objects, which `refill` fills again."""
        for full in self.fulls:
            full.untyped_storage().resize_(0)

    def is_freed(self) -> bool:
        return any(full.untyped_storage().nbytes() == 0 and full.numel() > 0 for full in self.fulls)

    def refill(self) -> None:
        """All-gather again into the full tensors freed by `free`; nothing if they are
        not freed. Refuses shards that changed in place since the gather (the backward would
        compute with other values than the forward did)."""
        if not self.is_freed():
            return
        for source, seen in zip(self.sources, self._versions, strict=True):
            if _version_of(source) != seen:
                raise RuntimeError(
                    "a DTensor of the tree given to a call on a sharded module was modified in "
                    "place between the forward and the backward (its gathered copy is freed "
                    "after each FSDP unit's forward and gathered again for the backward); "
                    "modify it after the backward, or pass a copy to the call"
                )
        # Plain tensors throughout: this runs inside a backward, where torch.func.grad would
        # wrap the buffers made here.
        with torch.no_grad(), torch._C._DisableFuncTorch():
            targets = []
            for full in self.fulls:
                storage = full.untyped_storage()
                storage.resize_(full.numel() * full.element_size())
                # An alias of the same memory with its own version counter: autograd's saved
                # tensors see the values, not a modification.
                targets.append(
                    full.new_empty(0).set_(
                        storage, full.storage_offset(), full.shape, full.stride()
                    )
                )
            _fill(self.sources, self.dtypes, targets)

    def pieces(self, grads: tuple[Any, ...]) -> list[Any]:
        """Each gradient of a full tensor as this rank's piece of it, a ``DTensor`` laid out like
        its source, in the source's dtype (through ``reduce_dtypes`` on the way)."""
        out: list[Any] = []
        for grad, source, reduce_dtype in zip(grads, self.sources, self.reduce_dtypes, strict=True):
            if grad is None:
                out.append(None)
                continue
            if reduce_dtype is not None:
                grad = grad.to(reduce_dtype)
            grad = grad.to(source.dtype)
            out.append(piece_of(grad, source.device_mesh, source.placements))
        return out


def _version_of(source: Any) -> tuple[int, int]:
    # In-place ops on the DTensor bump its own counter, on its local tensor the local's.
    with torch.no_grad():  # to_local is then the local tensor itself, not an autograd.Function
        return source._version, source.to_local()._version


def _fill(sources: list[Any], dtypes: list[Any], targets: list[Tensor] | None) -> list[Tensor]:
    """The full tensors of ``sources`` cast to ``dtypes``, written into ``targets`` if given (else
    new tensors). Sources sharded on dim 0 over one 1-D mesh share one all-gather per mesh and
    dtype; others are gathered one by one."""
    fulls: list[Any] = [None] * len(sources)
    batches: dict[Any, list[int]] = {}
    for i, source in enumerate(sources):
        dtype = dtypes[i] or source.dtype
        placements = source.placements
        if source.device_mesh.ndim == 1 and _is_plain_shard(placements[0], 0):
            key = (id(source.device_mesh), dtype, source.device)
            batches.setdefault(key, []).append(i)
            continue
        full = _full_tensor(source, dtype)
        if targets is not None:
            targets[i].copy_(full)
            full = targets[i]
        fulls[i] = full
    for indices in batches.values():
        chosen = [sources[i] for i in indices]
        dtype = dtypes[indices[0]] or chosen[0].dtype
        outs = None if targets is None else [targets[i] for i in indices]
        for i, full in zip(indices, _gather_rows(chosen, dtype, outs), strict=True):
            fulls[i] = full
    return fulls


def _full_tensor(source: Any, dtype: torch.dtype) -> Tensor:
    """``source.to(dtype).full_tensor()`` without autograd: DTensor's own redistribution of the
    local tensor (``full_tensor`` goes through an ``autograd.Function`` that cannot run while a
    torch.func transform is active, as in a backward under ``torch.func.grad``)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._redistribute import redistribute_local_tensor

    spec = source._spec
    local = source._local_tensor
    if dtype != local.dtype:
        local = local.to(dtype)
    target = DTensorSpec(spec.mesh, (Replicate(),) * spec.mesh.ndim, tensor_meta=spec.tensor_meta)
    full = redistribute_local_tensor(local, spec, target)
    wait = getattr(full, "wait", None)  # an AsyncCollectiveTensor: its value, waited for
    full = full if wait is None else wait()
    # A full tensor of its own (Gathered.free releases its memory): not the shard itself (a
    # mesh of one rank gathers nothing), nor a view into a larger buffer.
    own = (
        full.is_contiguous()
        and full.storage_offset() == 0
        and full.untyped_storage().nbytes() == full.numel() * full.element_size()
        and full.untyped_storage().data_ptr() != source._local_tensor.untyped_storage().data_ptr()
    )
    return full if own else full.clone(memory_format=torch.contiguous_format)


def _is_plain_shard(placement: Any, dim: int) -> bool:
    from torch.distributed.tensor import Shard

    return type(placement) is Shard and placement.dim == dim


def _gather_rows(sources: list[Any], dtype: torch.dtype, outs: list[Tensor] | None) -> list[Tensor]:
    """Full tensors of ``DTensor`` s sharded on dim 0 over one 1-D mesh, in one all-gather: this
    rank's rows of each, padded to ``torch.chunk``'s row count, are written straight into its
    part of the receiving buffer (cast on the way), then every tensor's rows are copied out."""
    import torch.distributed as dist

    mesh = sources[0].device_mesh
    ranks, rank = mesh.size(), mesh.get_local_rank(0)
    rows = [-(-s.shape[0] // ranks) for s in sources]  # rows per rank, as torch.chunk
    widths = [count * _row_numel(s.shape) for count, s in zip(rows, sources, strict=True)]
    span = sum(widths)
    receive = torch.empty(ranks * span, dtype=dtype, device=sources[0].device)
    mine = receive.narrow(0, rank * span, span)
    offset = 0
    for source, width in zip(sources, widths, strict=True):
        local = source.to_local()
        mine.narrow(0, offset, local.numel()).copy_(local.reshape(-1))
        offset += width
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(receive, mine, group=mesh.get_group(0))
    block = receive.view(ranks, span)
    fulls = []
    offset = 0
    for index, (source, count, width) in enumerate(zip(sources, rows, widths, strict=True)):
        full = (
            torch.empty(source.shape, dtype=dtype, device=source.device)
            if outs is None
            else outs[index]
        )
        total = source.shape[0]
        if total == ranks * count:
            full.view(ranks, width).copy_(block[:, offset : offset + width])
        else:
            row = _row_numel(source.shape)
            for r in range(ranks):
                start, stop = r * count, min(total, (r + 1) * count)
                if stop <= start:
                    break
                full.narrow(0, start, stop - start).view(-1).copy_(
                    block[r, offset : offset + (stop - start) * row]
                )
        fulls.append(full)
        offset += width
    # Released now, not when the last reference goes: gloo's worker thread can hold the
    # collective's tensors a while after it completed (the memory would linger into the next
    # unit's gather). The collective is done with it (the call above waited for it).
    receive.untyped_storage().resize_(0)
    return fulls


def _row_numel(shape: Any) -> int:
    numel = 1
    for size in shape[1:]:
        numel *= size
    return numel


class _Gather(torch.autograd.Function):
    """The full tensors of a `Gathered` 's sources; backward hands back each rank's piece
    of every gradient (no communication) and, for a unit freed after its forward, frees the full
    tensors again once their gradients are done."""

    @staticmethod
    def forward(gathered: Gathered, *values: Any) -> tuple[Tensor, ...]:  # type: ignore[override]
        return tuple(gathered.gather(list(values)))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.gathered = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:  # type: ignore[override]
        # A backward that records a graph of its own (create_graph=True, or a torch.func level
        # outside this one; a single torch.func.grad records one that nothing uses).
        if grad_levels() > 1 if functorch_active() else torch.is_grad_enabled():
            raise NotImplementedError(_SECOND_ORDER)
        gathered: Gathered = ctx.gathered
        pieces = gathered.pieces(grads)
        if gathered.releasing:  # the unit's gradients are done: its memory goes again
            gathered.free()
        return (None, *pieces)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], gathered: Gathered, *values: Any) -> Any:
        # A stacked tree: each stacked DTensor is gathered whole (member dim first).
        moved = [
            v if d is None or d == 0 else v.movedim(d, 0)
            for v, d in zip(values, in_dims[1:], strict=True)
        ]
        outs = _Gather.apply(gathered, *moved)
        return outs, tuple(None if d is None else 0 for d in in_dims[1:])


def gather(gathered: Gathered, values: list[Any]) -> list[Tensor]:
    """The full tensors of ``values`` (distinct ``DTensor`` s, possibly wrapped by ``torch.func``
    transforms), differentiably; ``gathered`` keeps them for `Gathered.free` /
    `Gathered.refill`."""
    return list(_Gather.apply(gathered, *values))


def gathered(values: list[Any]) -> list[Any]:
    """``values`` with every ``DTensor`` replaced by its full tensor (differentiably); one gather
    per distinct tensor, so tied leaves stay one tensor."""
    distinct: dict[int, Any] = {}
    for value in values:
        if holds_dtensor(value):
            distinct.setdefault(id(value), value)
    if not distinct:
        return values
    sources = list(distinct.values())
    count = len(sources)
    fulls = gather(Gathered([None] * count, [None] * count), sources)
    full = {id(source): whole for source, whole in zip(sources, fulls, strict=True)}
    return [full.get(id(value), value) if isinstance(value, Tensor) else value for value in values]


def piece_of(full: Tensor, mesh: Any, placements: Any) -> Tensor:
    """This rank's piece of ``full`` (the same on every rank) as a ``DTensor`` with
    ``placements``, without communication; differentiable outside ``torch.func`` transforms."""
    from torch.distributed.tensor import DTensor

    if any(p.is_partial() for p in placements):
        raise ValueError("a Partial placement has no piece of a full tensor")
    found = grad_wrapped(full)
    if found is None:
        raise NotImplementedError(_VMAP_OF_GRAD)
    inner, levels = found
    if not levels:
        return DTensor.from_local(
            _local_piece(full, mesh, placements),
            mesh,
            placements,
            run_check=False,
            shape=full.shape,
            stride=full.stride(),
        )
    # A gradient inside torch.func.grad is wrapped once per grad level; from_local (an
    # autograd.Function without setup_context) cannot run there, so the DTensor is made around
    # the innermost tensor and wrapped again, level by level.
    piece = _dtensor_around(
        _local_piece(inner, mesh, placements), mesh, placements, full.shape, full.stride()
    )
    return wrap_for_grad(piece, levels)


def _local_piece(full: Tensor, mesh: Any, placements: Any) -> Tensor:
    """This rank's part of ``full`` under ``placements`` (Shard and Replicate), a copy when it
    is a part: a view would keep the whole full tensor alive (a full gradient per parameter,
    where FSDP keeps this rank's piece)."""
    if not all(p.is_replicate() or _is_plain_shard(p, p.dim) for p in placements):
        # _StridedShard (FSDP2 over tensor parallel) and the like: DTensor's own rules, which
        # for Replicate -> Shard take the piece without communication.
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor._redistribute import redistribute_local_tensor

        meta = TensorMeta(full.shape, full.stride(), full.dtype)
        replicated = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tensor_meta=meta)
        target = DTensorSpec(mesh, tuple(placements), tensor_meta=meta)
        local = redistribute_local_tensor(full, replicated, target)
    else:
        local = full
        for mesh_dim, placement in enumerate(placements):
            if placement.is_shard():
                pieces = torch.chunk(local, mesh.size(mesh_dim), dim=placement.dim)
                index = mesh.get_local_rank(mesh_dim)
                local = pieces[index] if index < len(pieces) else local.narrow(placement.dim, 0, 0)
    return local.clone() if local.numel() < full.numel() else local


def _dtensor_around(local: Tensor, mesh: Any, placements: Any, shape: Any, stride: Any) -> Tensor:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, tuple(placements), TensorMeta(shape, stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)
