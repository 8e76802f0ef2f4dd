"""The public operations on a module's slots: ``inject`` (for a block), ``swap`` (for good) and
``load`` (copy values in place)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from .anatomy import anatomy_of, forget
from .hooks import run_overridden_loads
from .prepare import prepare, prepare_hooked
from .sharded import loadable
from .swaps import HookedSwap, Swap
from .types import Tree, TreeArg


class inject:
    """Inside the block, ``module`` computes with the tree's tensors; afterwards it holds its own.

    The tree's tensors go in as they are, no copy: gradients reach the tree's leaves, and batched
    tensors under ``torch.vmap`` work. On exit, also when the body raised, the module holds the very
    same objects it held before, with the same ``requires_grad``. A buffer that ``forward``
    reassigns (``self.count = self.count + 1``) is written back into ``tree``. In-place updates
    (BatchNorm statistics) land in the tree's tensors. Tensors the module keeps as plain attributes
    and lazy modules' class and hooks are restored too; other plain attributes that ``forward``
    assigns (counters, a Llama dynamic RoPE's ``max_seq_len_cached``) are not, as with
    ``torch.func.functional_call`` (see :func:`modstate.call`). For every thread: while the block
    runs, a plain forward in any thread computes with the tree; a concurrent ``ms.call`` with
    its own tree is not affected (see "Threads" in ``docs/semantics.md``).

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
            sharding = anatomy_of(self._module).sharding
            if sharding is not None:
                sharding.refuse_state_dict_route("inject")
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
        tables, names = [a.table for a in plan.assignments], [a.name for a in plan.assignments]
    else:
        prepared = prepare(module, tree, strict)
        _check_copyable(module, prepared)
        currents, values, plan = prepared.olds, prepared.values, None
        tables, names = prepared.tables, prepared.names
    sharding = anatomy_of(module).sharding
    if sharding is not None:
        sharding.check_loadable(tables, names)
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
