"""Preparing a swap: check a tree against a module and say which slot gets which tensor.

Nothing here changes the module. A prepared `Swap` comes from one of
three routes:

- the compiled plan of the module's `Anatomy`, when the tree has
  exactly the shape ``extract`` gives (a few C-level passes over flat lists), or is a tuple of
  trees that together give every path once (``(params, state)``; see ``parts.py``);
- the general route, path by path, for partial trees, ties given at one path, and for precise
  errors whenever the compiled plan declines;
- the ``state_dict`` route (``use_state_dict=True``), which replays ``load_state_dict``'s hooks.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Mapping
from functools import partial
from itertools import repeat
from typing import Any

from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from modstate._core.errors import (
    MissingPaths,
    dtype_mismatch,
    meta_leaf,
    shape_mismatch,
)
from modstate._core.module.anatomy import Anatomy, ModuleGuard, anatomy_of, serial_lock
from modstate._core.module.state_dict import Assignment, LoadPlan, plan_load
from modstate._core.sharded.sharding import partial_leaf
from modstate._core.swap.parts import read_parts
from modstate._core.swap.swaps import Swap, UnshardedSwap
from modstate._core.swap.unknown import unknown_path, wrapper_prefix
from modstate._core.trees.flat import unflatten
from modstate._core.trees.leaves import leaves_of
from modstate._core.types import TreeArg
from modstate._core.vmap_levels import unwrapped

_is = operator.is_
_shape_and_dtype = operator.attrgetter("shape", "dtype")
_is_meta = operator.attrgetter("is_meta")


def prepare(
    module: nn.Module,
    tree: TreeArg,
    strict: bool,
    *,
    compute: bool = False,
    private: bool = False,
) -> Swap:
    """Check ``tree`` against ``module`` and say which slot gets which tensor; change nothing.

    ``compute=True`` prepares a swap for computing (``call``, ``inject``): on a sharded module
    (FSDP2, tensor parallel) that is the unsharded computation (see ``sharded.py``).
    ``private=True`` (a stateless call) prepares a swap that only the calling thread sees, where
    the module allows it (not on sharded modules, nor on modules running ``torch.compile``d code:
    their swaps are for every thread; see ``Anatomy.layered``). Such calls hold a lock (one call
    at a time) on modules running compiled code, and on modules whose forward rewrites tensors
    kept in ``__dict__`` (``Anatomy.serialized``)."""
    anatomy = anatomy_of(module)
    private, lock = _privacy(module, anatomy, private)
    prepared = None
    if type(tree) is dict or isinstance(tree, Mapping):
        prepared = _prepare_compiled(anatomy, tree, strict, private, lock)
    elif isinstance(tree, (tuple, list)):
        prepared = _prepare_compiled_parts(module, anatomy, tree, strict, private, lock)
    if prepared is None:
        prepared = _prepare_by_path(anatomy, tree, strict, private, lock)
    if compute:
        _refuse_meta(anatomy, prepared)
    if compute and anatomy.sharding is not None:
        partial = partial_leaf(prepared.values)
        if partial is not None:
            table, name = prepared.tables[partial], prepared.names[partial]
            path = next(s.path for s in anatomy.slots if s.table is table and s.name == name)
            raise ValueError(
                f"{path!r}: a DTensor with a Partial placement (a pending sum); a call on a "
                "sharded module gathers the tree and gives gradients back piece by piece, which "
                "a pending sum has not: redistribute it first (leaf.redistribute(placements="
                "[Replicate()]) or the module's own placements)"
            )
        return UnshardedSwap(prepared, anatomy.sharding)
    return prepared


def prepare_in_plan_order(
    module: nn.Module,
    anatomy: Anatomy,
    leaves: list[Any],
    targets: Callable[[int], tuple[Any, str] | None],
) -> Swap | None:
    """The stateless call's swap (``prepare(..., strict=True, compute=True, private=True)``) of
    ``leaves`` given in the anatomy's plan order, with no tree to read (``apply`` has them as a
    list); ``targets(i)`` is where a buffer that forward reassigns goes. None where a tree must
    take `prepare`'s routes: other shapes or dtypes, ties given apart, sharded modules."""
    if anatomy.sharding is not None:
        return None
    private, lock = _privacy(module, anatomy, True)
    swap = _compiled_swap(anatomy, leaves, targets, True, private, lock)
    if swap is not None and _meta_slot(anatomy, swap) is not None:
        return None  # prepare names it, for the function that called
    return swap


def _refuse_meta(anatomy: Anatomy, swap: Swap) -> None:
    """Refuse to compute with a meta tensor (shapes only) where the module holds data: forward
    would fail deep inside torch, naming neither the path nor the way out. A meta tree in a meta
    module (tracing shapes) is fine."""
    found = _meta_slot(anatomy, swap)
    if found is not None:
        raise meta_leaf(*found)


def _meta_slot(anatomy: Anatomy, swap: Swap) -> tuple[str, Tensor] | None:
    """The first path (in module order) where ``swap`` puts a meta tensor in place of one with
    data, and the module's tensor there."""
    try:
        if not any(map(_is_meta, swap.values)):  # the common case: one C-level pass
            return None
    except AttributeError:  # a value that is not a tensor: look at each below
        pass
    meta = {
        (id(table), name): old
        for table, name, value, old in zip(
            swap.tables, swap.names, swap.values, swap.olds, strict=True
        )
        if getattr(value, "is_meta", False) and not getattr(old, "is_meta", True)
    }
    for slot in anatomy.slots:  # a swap lists them in plan order
        old = meta.get((id(slot.table), slot.name))
        if old is not None:
            return slot.path, old
    return None


def _privacy(
    module: nn.Module, anatomy: Anatomy, private: bool
) -> tuple[bool, threading.RLock | None]:
    """Whether a swap asked to be ``private`` can be, and the lock it holds if it must run one
    call at a time."""
    # A call on a module that runs compiled code swaps for every thread, as inject does (see
    # Anatomy.layered), so such calls run one at a time. module.compile() after the anatomy was
    # built changes no slot: looked up here.
    compiled = anatomy.runs_compiled_code or vars(module).get("_compiled_call_impl") is not None
    one_at_a_time = private and (anatomy.serialized or compiled)
    private = private and not compiled and anatomy.layered and anatomy.sharding is None
    lock = serial_lock(module) if one_at_a_time and anatomy.sharding is None else None
    return private, lock


def _prepare_compiled(
    anatomy: Anatomy,
    tree: Mapping[str, Any],
    strict: bool,
    private: bool,
    lock: threading.RLock | None,
) -> Swap | None:
    read = anatomy.read(tree)
    if read is None:
        return None
    leaves, nodes = read
    place = partial(anatomy.reader.place, nodes)
    return _compiled_swap(anatomy, leaves, place, strict, private, lock)


def _prepare_compiled_parts(
    module: nn.Module,
    anatomy: Anatomy,
    parts: tuple[Any, ...] | list[Any],
    strict: bool,
    private: bool,
    lock: threading.RLock | None,
) -> Swap | None:
    read = read_parts(anatomy, module, parts)
    if read is None:
        return None
    reader, found = read
    leaves: list[Any] = []
    for part_leaves, _ in found:
        leaves += part_leaves  # numbered one after the other, as the reader's order counts
    place = partial(reader.place, found)
    return _compiled_swap(anatomy, reader.in_plan_order(leaves), place, strict, private, lock)


def _compiled_swap(
    anatomy: Anatomy,
    leaves: list[Any],
    targets: Callable[[int], tuple[Any, str] | None],
    strict: bool,
    private: bool,
    lock: threading.RLock | None,
) -> Swap | None:
    """The swap of the compiled plan for ``leaves`` (one per slot, in plan order); None where
    the general route must look closer (other shapes, ties given apart, non-tensors)."""
    olds = anatomy.holding
    if not all(map(_is, leaves, olds)):
        if not all(map(isinstance, leaves, repeat(Tensor))):
            return None
        if strict:
            try:
                if list(map(_shape_and_dtype, leaves)) != list(map(_shape_and_dtype, olds)):
                    return None
            except (RuntimeError, ValueError):  # a lazy parameter has no shape yet
                return None
        for group in anatomy.tie_positions:
            first = leaves[group[0]]
            for i in group[1:]:
                if leaves[i] is not first:
                    if not _same_tensor(leaves[i], first):
                        return None  # the path-by-path route names the conflict
                    leaves[i] = first  # one tensor for the whole tie, as in the module

    guarded = anatomy.guarded
    return Swap(
        anatomy.tables,
        anatomy.names,
        leaves,
        olds,
        anatomy.buffer_positions,
        targets,
        partial(ModuleGuard, guarded) if guarded else None,
        anatomy.new_tree,
        private=private,
        lock=lock,
        layout=anatomy.layout if private else None,
    )


def _prepare_by_path(
    anatomy: Anatomy, tree: TreeArg, strict: bool, private: bool, lock: threading.RLock | None
) -> Swap:
    slots = anatomy.slots
    index_of = {slot.path: i for i, slot in enumerate(slots)}
    given: dict[int, tuple[Any, Any, str]] = {}
    for path, leaf, node, key in leaves_of(tree):
        i = index_of.get(path)
        if i is None:
            raise unknown_path(anatomy, path)
        if not isinstance(leaf, Tensor):
            raise TypeError(f"{path!r}: expected a tensor, got {type(leaf).__name__}")
        if strict:
            _check_like(path, leaf, slots[i].get(), anatomy, tree)
        given[i] = (leaf, node, key)

    for group in anatomy.tie_groups:
        provided = [i for i in group if i in given]
        if not provided:
            continue
        first = given[provided[0]][0]
        for i in provided[1:]:
            if not _same_tensor(given[i][0], first):
                raise ValueError(
                    f"{slots[provided[0]].path!r} and {slots[i].path!r} are tied in the module "
                    "(one tensor) but the tree gives them different tensors; give one of the "
                    "paths, or the same tensor at both"
                )
        for i in group:
            _, node, key = given.get(i, (None, None, ""))
            given[i] = (first, node, key)

    if strict and len(given) < len(slots):
        # Non-persistent buffers are not part of a checkpoint (state_dict leaves them out): a
        # tree with state_dict's keys is complete, and the module keeps its own there.
        missing = [slot.path for i, slot in enumerate(slots) if i not in given and slot.persistent]
    else:
        missing = []
    if missing:
        raise MissingPaths(missing, "pass strict=False to keep the module's own tensors there")

    order = sorted(given)
    tables = [slots[i].table for i in order]
    names = [slots[i].name for i in order]
    values = [given[i][0] for i in order]
    nodes = [given[i][1] for i in order]
    keys = [given[i][2] for i in order]
    paths = [slots[i].path if given[i][1] is not None else None for i in order]
    guarded = anatomy.guarded
    return Swap(
        tables,
        names,
        values,
        list(map(operator.getitem, tables, names)),
        [pos for pos, i in enumerate(order) if slots[i].is_buffer],
        lambda pos: None if nodes[pos] is None else (nodes[pos], keys[pos]),
        partial(ModuleGuard, guarded) if guarded else None,
        lambda olds: unflatten({p: v for p, v in zip(paths, olds, strict=True) if p is not None}),
        private=private,
        lock=lock,
    )


def _check_like(path: str, leaf: Tensor, current: Tensor, anatomy: Anatomy, tree: TreeArg) -> None:
    if is_lazy(current) or is_lazy(leaf):
        return
    if leaf.shape != current.shape:
        raise shape_mismatch(path, leaf, current, _other_shapes(anatomy, tree, path))
    if leaf.dtype != current.dtype:
        raise dtype_mismatch(path, leaf, current)


def _other_shapes(anatomy: Anatomy, tree: TreeArg, path: str) -> int:
    """How many of the tree's leaves besides ``path`` have other shapes than the module's: the
    measure of how far from this model the tree is (read only on the way to an error)."""
    count = 0
    for other, leaf, _, _ in leaves_of(tree):
        slot = anatomy.by_path.get(other)
        if other == path or slot is None or not isinstance(leaf, Tensor):
            continue
        current = slot.get()
        if not (is_lazy(current) or is_lazy(leaf)) and leaf.shape != current.shape:
            count += 1
    return count


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` are one tensor: the same object, the same view of one storage, or
    two wrappers that ``torch.func`` transforms made of one tensor given at two paths."""
    if a is b:
        return True
    a, b = unwrapped(a), unwrapped(b)
    if a is b:
        return True
    try:
        return (
            a.shape == b.shape
            and a.dtype == b.dtype
            and a.device == b.device
            and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr()
        )
    except (RuntimeError, NotImplementedError):  # tensors without storage
        return False


def prepare_hooked(
    module: nn.Module, tree: TreeArg, strict: bool, *, in_place: bool
) -> tuple[LoadPlan, ModuleGuard]:
    """Replay ``load_state_dict`` on ``tree`` and check the outcome; on refusal, undo what the
    load pre-hooks did (lazy materialization) and raise."""
    flat = {path: leaf for path, leaf, _, _ in leaves_of(tree)}
    anatomy = anatomy_of(module)
    guard = ModuleGuard(anatomy.guarded)
    try:
        plan = plan_load(module, flat, strict=strict, in_place=in_place)
        _fill_ties(anatomy, plan)
        _judge(anatomy, plan, strict, check_dtypes=strict and not in_place)
    except BaseException:
        guard.restore()
        raise
    return plan, guard


def _fill_ties(anatomy: Anatomy, plan: LoadPlan) -> None:
    """A tied path that the tree leaves out gets its group's tensor, and is not missing.

    Files written by ``save_pretrained`` or ``safetensors.torch.save_model`` hold each tie group
    once; ``load_state_dict`` would call the other paths missing, and filling only the given one
    would untie the group while it is injected."""
    if not anatomy.tie_groups or not plan.missing:
        return
    given = {a.key: a for a in plan.assignments}
    missing = set(plan.missing)
    filled = set()
    for group in anatomy.tie_groups:
        paths = [anatomy.slots[i].path for i in group]
        source = next((given[p] for p in paths if p in given), None)
        if source is None:
            continue
        for i in group:
            slot = anatomy.slots[i]
            if slot.path in missing:
                plan.assignments.append(
                    Assignment(slot.table, slot.name, slot.path, source.value, slot.is_buffer)
                )
                filled.add(slot.path)
    if filled:
        plan.missing[:] = [key for key in plan.missing if key not in filled]


def _judge(anatomy: Anatomy, plan: LoadPlan, strict: bool, check_dtypes: bool) -> None:
    if plan.errors:
        raise ValueError(plan.errors[0])
    if plan.unexpected:
        wrapped = wrapper_prefix(anatomy, plan.unexpected[0])
        if wrapped is not None:
            raise wrapped
        raise KeyError(
            f"unknown path {plan.unexpected[0]!r}: after the module's load_state_dict hooks, "
            "no parameter, buffer or extra state takes it"
        )
    if strict and plan.missing:
        raise MissingPaths(
            list(plan.missing),
            "(as load_state_dict sees it) pass strict=False to keep the module's own tensors there",
        )
    if check_dtypes:
        for a in plan.assignments:
            if not is_lazy(a.current) and not is_lazy(a.value) and a.value.dtype != a.current.dtype:
                raise dtype_mismatch(a.key, a.value, a.current)
