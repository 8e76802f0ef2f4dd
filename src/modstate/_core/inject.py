"""The swap engine: put a tree's tensors into a module's slots, and take them out again.

Every public operation first *prepares* a :class:`Swap` (which slot gets which tensor), checking
everything without touching the module, and only then applies it. A prepared swap comes from one
of three routes:

- the compiled plan of the module's :class:`~modstate._walk.Anatomy`, when the tree has exactly the
  shape ``extract`` gives (a few C-level passes over flat lists);
- the general route, path by path, for partial trees, ties given at one path, and for precise
  errors whenever the compiled plan declines;
- the ``state_dict`` route (``use_state_dict=True``), which replays ``load_state_dict``'s hooks.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from itertools import repeat
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from .flat import Tree, is_subtree, unflatten
from .hooks import Assignment, LoadPlan, plan_load, run_overridden_loads
from .sharded import Sharding, gathered, loadable
from .walk import Anatomy, ModuleGuard, anatomy_of, forget

_is = operator.is_
_setitem = operator.setitem
_shape_and_dtype = operator.attrgetter("shape", "dtype")


class Swap:
    """Slots and the tensors that go into them, ready to be applied and undone.

    ``targets(i)`` is ``(node, key)``, where the tree holds ``values[i]``: a buffer that the body
    reassigns is written back there, as ``torch.func.functional_call`` does. ``rebuild(olds)``
    nests values listed like ``values`` at the tree's paths (what :func:`swap` returns).
    """

    __slots__ = (
        "_applied",
        "buffers",
        "guard",
        "names",
        "olds",
        "rebuild",
        "tables",
        "targets",
        "values",
    )

    def __init__(
        self,
        tables: list[dict[str, Any]],
        names: list[str],
        values: list[Any],
        olds: list[Any],
        buffers: list[int],
        targets: Callable[[int], tuple[Any, str] | None],
        guard: Callable[[], None] | None,
        rebuild: Callable[[list[Any]], Tree],
    ) -> None:
        self.rebuild = rebuild
        self.tables = tables
        self.names = names
        self.values = values
        self.olds = olds
        self.buffers = buffers
        self.targets = targets
        self.guard = guard
        self._applied = False

    def apply(self) -> None:
        deque(map(_setitem, self.tables, self.names, self.values), maxlen=0)
        self._applied = True

    def replaced(self) -> Tree:
        """What the applied swap took out of the module, at the tree's paths."""
        return self.rebuild(self.olds)

    def undo(self) -> None:
        if not self._applied:
            return
        self._applied = False
        tables, names, values = self.tables, self.names, self.values
        for i in self.buffers:
            now = tables[i][names[i]]
            if now is not values[i]:
                target = self.targets(i)
                if target is not None:
                    target[0][target[1]] = now
        # Reversed, so that a slot listed twice ends up with what it held first.
        deque(map(_setitem, reversed(tables), reversed(names), reversed(self.olds)), maxlen=0)
        if self.guard is not None:
            self.guard()


class UnshardedSwap(Swap):
    """A swap on a sharded module that computes unsharded: the tree's ``DTensor`` leaves go in
    gathered (differentiably) and the parallelism's forward hooks are off while it is applied."""

    __slots__ = ("_restore_hooks", "_sharding")

    def __init__(self, prepared: Swap, sharding: Sharding) -> None:
        super().__init__(
            prepared.tables,
            prepared.names,
            gathered(prepared.values),
            prepared.olds,
            prepared.buffers,
            prepared.targets,
            prepared.guard,
            prepared.rebuild,
        )
        self._sharding = sharding
        self._restore_hooks: Callable[[], None] | None = None

    def apply(self) -> None:
        self._restore_hooks = self._sharding.bypass()
        super().apply()

    def undo(self) -> None:
        try:
            super().undo()
        finally:
            restore, self._restore_hooks = self._restore_hooks, None
            if restore is not None:
                restore()


# -- preparing -------------------------------------------------------------------------------------


TreeArg = Mapping[str, Any] | tuple[Mapping[str, Any], ...] | list[Mapping[str, Any]]
"""A tree, or several trees that together give the module's paths (say parameters and buffers),
as ``torch.func.functional_call`` accepts a tuple of dicts."""


def prepare(module: nn.Module, tree: TreeArg, strict: bool, *, compute: bool = False) -> Swap:
    """Check ``tree`` against ``module`` and say which slot gets which tensor; change nothing.

    ``compute=True`` prepares a swap for computing (``call``, ``inject``): on a sharded module
    (FSDP2, tensor parallel) that is the unsharded computation (see ``sharded.py``)."""
    anatomy = anatomy_of(module)
    prepared = None
    if type(tree) is dict or isinstance(tree, Mapping):
        prepared = _prepare_compiled(anatomy, tree, strict)
    if prepared is None:
        prepared = _prepare_by_path(anatomy, tree, strict)
    if compute and anatomy.sharding is not None:
        return UnshardedSwap(prepared, anatomy.sharding)
    return prepared


def _prepare_compiled(anatomy: Anatomy, tree: Mapping[str, Any], strict: bool) -> Swap | None:
    read = anatomy.read(tree)
    if read is None:
        return None
    leaves, nodes = read
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

    leaf_nodes, leaf_keys = anatomy.leaf_nodes, anatomy.leaf_keys
    guarded = anatomy.guarded
    return Swap(
        anatomy.tables,
        anatomy.names,
        leaves,
        olds,
        anatomy.buffer_positions,
        lambda i: (nodes[leaf_nodes[i]], leaf_keys[i]),
        ModuleGuard(guarded).restore if guarded else None,
        anatomy.new_tree,
    )


def _prepare_by_path(anatomy: Anatomy, tree: TreeArg, strict: bool) -> Swap:
    slots = anatomy.slots
    index_of = {slot.path: i for i, slot in enumerate(slots)}
    given: dict[int, tuple[Any, Any, str]] = {}
    for path, leaf, node, key in leaves_of(tree):
        i = index_of.get(path)
        if i is None:
            raise KeyError(_unknown_path_message(anatomy, path))
        if not isinstance(leaf, Tensor):
            raise TypeError(f"{path!r}: expected a tensor, got {type(leaf).__name__}")
        if strict:
            _check_like(path, leaf, slots[i].get())
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
        ModuleGuard(guarded).restore if guarded else None,
        lambda olds: unflatten({p: v for p, v in zip(paths, olds) if p is not None}),
    )


class MissingPaths(KeyError):
    """A strict tree that leaves out some of the module's paths; ``paths`` lists them all."""

    def __init__(self, paths: list[str], fix: str) -> None:
        self.paths = paths
        shown = ", ".join(repr(p) for p in paths[:5]) + (" ..." if len(paths) > 5 else "")
        super().__init__(f"the tree has no tensor for {shown} ({len(paths)} missing); {fix}")

    def __str__(self) -> str:
        return str(self.args[0])


def leaves_of(tree: TreeArg) -> Iterator[tuple[str, Any, Any, str]]:
    """``(path, leaf, node, key)`` for every leaf of a tree or of several trees, ``node[key]``
    being where the leaf sits; refuses anything else, and a path given by two trees.

    A None leaf is a hole: the path is not given by this tree (the halves that
    ``modstate.tree.partition`` makes hold None where a leaf went to the other half)."""
    if isinstance(tree, (tuple, list)):
        seen: set[str] = set()
        for component in tree:
            _check_is_tree(component)
            for item in _leaves_with_parents(component, ""):
                if item[0] in seen:
                    raise ValueError(f"{item[0]!r} is given by two of the trees")
                seen.add(item[0])
                yield item
    else:
        _check_is_tree(tree)
        yield from _leaves_with_parents(tree, "")


def _check_is_tree(tree: Any) -> None:
    if not isinstance(tree, Mapping):
        raise TypeError(
            f"expected a tree (a dict of tensors) or a tuple of trees, got {type(tree).__name__}"
        )


def _leaves_with_parents(
    tree: Mapping[str, Any], prefix: str
) -> Iterator[tuple[str, Any, Any, str]]:
    for key, value in tree.items():
        if not isinstance(key, str):
            raise TypeError(
                f"tree keys must be strings, got {key!r} under {prefix[:-1] or 'the root'!r}"
            )
        if is_subtree(key, value):
            yield from _leaves_with_parents(value, f"{prefix}{key}.")
        elif value is not None:
            yield prefix + key, value, tree, key


def _unknown_path_message(anatomy: Anatomy, path: str) -> str:
    if path in anatomy.module_paths:
        return f"{path!r} is a submodule: give a dict of its tensors, not a single value"
    owner = path.rpartition(".")[0]
    while owner and owner not in anatomy.module_paths:
        if owner in anatomy.by_path:
            return f"{path!r}: {owner!r} is a tensor, not a submodule"
        owner = owner.rpartition(".")[0]
    return f"unknown path {path!r}: the module has no parameter or buffer there"


def _check_like(path: str, leaf: Tensor, current: Tensor) -> None:
    if is_lazy(current) or is_lazy(leaf):
        return
    if leaf.shape != current.shape:
        raise ValueError(
            f"{path!r}: shape {tuple(leaf.shape)} in the tree, {tuple(current.shape)} in the module "
            "(strict=False accepts other shapes)"
        )
    if leaf.dtype != current.dtype:
        raise TypeError(
            f"{path!r}: dtype {leaf.dtype} in the tree, {current.dtype} in the module "
            "(strict=False accepts other dtypes)"
        )


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` are one tensor: the same object, the same view of one storage, or
    two wrappers that ``torch.func`` transforms made of one tensor given at two paths."""
    if a is b:
        return True
    a, b = _unwrapped(a), _unwrapped(b)
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


def _unwrapped(tensor: Tensor) -> Tensor:
    while torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return tensor


# -- the state_dict route --------------------------------------------------------------------------


class HookedSwap(Swap):
    """A swap prepared by replaying ``load_state_dict``; it swaps extra state too."""

    __slots__ = ("extra_states", "previous_extra")

    def __init__(self, plan: LoadPlan, tree: TreeArg, guard: ModuleGuard | None) -> None:
        assignments = plan.assignments
        flat_nodes = {path: (node, key) for path, _, node, key in leaves_of(tree)}

        def target(i: int) -> tuple[Any, str] | None:
            return flat_nodes.get(assignments[i].key)

        super().__init__(
            [a.table for a in assignments],
            [a.name for a in assignments],
            [a.value for a in assignments],
            [a.current for a in assignments],
            [i for i, a in enumerate(assignments) if a.is_buffer],
            target,
            None if guard is None else guard.restore,
            lambda olds: unflatten({a.key: old for a, old in zip(assignments, olds)}),
        )
        self.extra_states = plan.extra_states
        self.previous_extra: list[tuple[nn.Module, str, Any]] = []

    def apply(self) -> None:
        try:
            for module, key, value in self.extra_states:
                self.previous_extra.append((module, key, module.get_extra_state()))
                module.set_extra_state(value)
        except BaseException:
            self._restore_extra()
            raise
        super().apply()

    def undo(self) -> None:
        if self._applied:
            super().undo()
            self._restore_extra()

    def replaced(self) -> Tree:
        tree = super().replaced()
        for _, key, state in self.previous_extra:
            owner, _, name = key.rpartition(".")
            node = tree
            for part in owner.split(".") if owner else ():
                node = node.setdefault(part, {})
            node[name] = state
        return tree

    def _restore_extra(self) -> None:
        while self.previous_extra:
            module, _, state = self.previous_extra.pop()
            module.set_extra_state(state)


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
        _judge(plan, strict, check_dtypes=strict and not in_place)
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


def _judge(plan: LoadPlan, strict: bool, check_dtypes: bool) -> None:
    if plan.errors:
        raise ValueError(plan.errors[0])
    if plan.unexpected:
        raise KeyError(
            f"unknown path {plan.unexpected[0]!r}: after the module's load_state_dict hooks, "
            "no parameter, buffer or extra state takes it"
        )
    if strict and plan.missing:
        shown = ", ".join(repr(k) for k in plan.missing[:5])
        raise KeyError(
            f"the tree has no value for {shown} ({len(plan.missing)} missing, as load_state_dict "
            "sees it); pass strict=False to keep the module's own"
        )
    if check_dtypes:
        for a in plan.assignments:
            if not is_lazy(a.current) and not is_lazy(a.value) and a.value.dtype != a.current.dtype:
                raise TypeError(
                    f"{a.key!r}: dtype {a.value.dtype} in the tree, {a.current.dtype} in the module "
                    "(strict=False accepts other dtypes)"
                )


# -- the public operations -------------------------------------------------------------------------


class inject:
    """Inside the block, ``module`` computes with the tree's tensors; afterwards it holds its own.

    The tree's tensors go in as they are, no copy: gradients reach the tree's leaves, and batched
    tensors under ``torch.vmap`` work. On exit, also when the body raised, the module holds the very
    same objects it held before, with the same ``requires_grad``. A buffer that ``forward``
    reassigns (``self.count = self.count + 1``) is written back into ``tree``. In-place updates
    (BatchNorm statistics) land in the tree's tensors.

    ``strict=True``: the tree's paths are the module's (as ``extract`` gives them) with the same
    shapes and dtypes; non-persistent buffers may be left out (``state_dict`` leaves them out; the
    module keeps its own there), and so may the other paths of a tie group given once. ``strict=False``: a partial tree (missing paths keep the module's tensors),
    other shapes and dtypes. Unknown paths are always an error; a refused tree changes nothing.
    Where the module holds one tensor at several paths (tied weights), one path sets them all;
    giving different tensors at two of them is an error. The tensor at the first of the paths (in
    module order) serves them all: under ``torch.func`` transforms, which wrap a tensor given at
    two paths into two wrappers, the gradient of the tie lands at that first path.

    With ``use_state_dict=True`` the tree is read as ``load_state_dict`` reads it: through the
    module's load pre-hooks (renames, legacy keys, lazy materialization) and post-hooks, with its
    ``set_extra_state``; the module is restored on exit all the same.

    >>> import torch, modstate as ms
    >>> lin = torch.nn.Linear(2, 2)
    >>> with ms.inject(lin, {"weight": torch.zeros(2, 2), "bias": torch.ones(2)}):
    ...     lin(torch.randn(1, 2))
    tensor([[1., 1.]])
    """

    __slots__ = ("_module", "_strict", "_swap", "_tree", "_use_state_dict")

    def __init__(
        self,
        module: nn.Module,
        tree: TreeArg,
        *,
        strict: bool = True,
        use_state_dict: bool = False,
    ) -> None:
        self._module = module
        self._tree = tree
        self._strict = strict
        self._use_state_dict = use_state_dict
        self._swap: Swap | None = None

    def __enter__(self) -> nn.Module:
        if self._swap is not None:
            raise RuntimeError("this inject(...) block is already active; make a new one")
        if self._use_state_dict:
            plan, guard = prepare_hooked(self._module, self._tree, self._strict, in_place=False)
            swap: Swap = HookedSwap(plan, self._tree, guard)
        else:
            swap = prepare(self._module, self._tree, self._strict, compute=True)
        swap.apply()
        self._swap = swap
        return self._module

    def __exit__(self, *exc_info: object) -> None:
        swap, self._swap = self._swap, None
        if swap is not None:
            swap.undo()


def swap(
    module: nn.Module,
    tree: TreeArg,
    *,
    strict: bool = True,
    use_state_dict: bool = False,
) -> Tree:
    """Put the tree's tensors into ``module`` for good; return a tree of what they replaced.

    The permanent form of :func:`inject`, with the same checks, so ``swap(module, old)`` undoes it.
    The tree's objects go in as they are (a plain tensor stays a plain tensor in ``_parameters``;
    pass ``nn.Parameter`` leaves to keep parameters parameters).

    >>> import torch, modstate as ms
    >>> lin = torch.nn.Linear(2, 2)
    >>> old = ms.swap(lin, {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)})
    >>> _ = ms.swap(lin, old)  # back to the original Parameters
    """
    if use_state_dict:
        plan, guard = prepare_hooked(module, tree, strict, in_place=False)
        guard.restore()  # the replaced tensors stay unmaterialized: swapping back restores all
        prepared: Swap = HookedSwap(plan, tree, None)
    else:
        prepared = prepare(module, tree, strict)
    sharding = anatomy_of(module).sharding
    if sharding is not None:
        sharding.check_swappable(prepared.tables, prepared.names)
    prepared.apply()
    forget(module)
    return prepared.replaced()


def load(
    module: nn.Module,
    tree: TreeArg,
    *,
    strict: bool = True,
    use_state_dict: bool = False,
) -> None:
    """Copy the tree's values into the module's own tensors, in place (identity kept).

    ``load_state_dict`` semantics, for EMA and target-network updates: the module keeps its
    objects; only their values change. Shapes must match; with ``strict=False`` dtypes may differ
    (values are cast) and the tree may be partial. Nothing is copied unless every check passed.

    >>> import torch, modstate as ms
    >>> online, target = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    >>> ms.load(target, ms.extract(online))
    >>> bool(torch.equal(target.weight, online.weight))
    True
    """
    if use_state_dict:
        plan, _ = prepare_hooked(module, tree, strict, in_place=True)
        currents = [a.current for a in plan.assignments]
        values = [a.value for a in plan.assignments]
    else:
        prepared = prepare(module, tree, strict)
        _check_copyable(module, prepared)
        currents, values, plan = prepared.olds, prepared.values, None
    if anatomy_of(module).sharding is not None:
        values = loadable(currents, values)
    _copy(currents, values)
    if plan is not None:
        for owner, _, state in plan.extra_states:
            owner.set_extra_state(state)
        if plan.overridden:
            run_overridden_loads(plan)
            if plan.errors:
                raise ValueError(plan.errors[0])


def _copy(currents: list[Tensor], values: list[Tensor]) -> None:
    """``current.copy_(value)`` for each pair, once per tensor (ties), fused where possible."""
    seen: set[int] = set()
    pairs = []
    for current, value in zip(currents, values):
        if current is not value and id(current) not in seen:
            seen.add(id(current))
            pairs.append((current, value))
    if not pairs:
        return
    destinations, sources = map(list, zip(*pairs))
    with torch.no_grad():
        try:
            torch._foreach_copy_(destinations, sources)
        except (RuntimeError, TypeError, NotImplementedError):
            for destination, source in pairs:
                destination.copy_(source)


def _check_copyable(module: nn.Module, prepared: Swap) -> None:
    for i, (current, value) in enumerate(zip(prepared.olds, prepared.values)):
        if is_lazy(current):
            raise ValueError(
                f"{_path_of(module, prepared, i)!r} is not initialized yet (lazy module): load "
                "cannot copy into it; use swap, or load with use_state_dict=True"
            )
        if value.shape != current.shape:
            raise ValueError(
                f"{_path_of(module, prepared, i)!r}: shape {tuple(value.shape)} in the tree, "
                f"{tuple(current.shape)} in the module: load copies in place, shapes must match"
            )


def _path_of(module: nn.Module, prepared: Swap, i: int) -> str:
    table, name = prepared.tables[i], prepared.names[i]
    return next(s.path for s in anatomy_of(module).slots if s.table is table and s.name == name)
