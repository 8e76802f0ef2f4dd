"""``load``: copy a tree's values into the module's own tensors in place, or make the tree's
tensors the module's (``assign=True``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from modstate._core.errors import (
    DtypeMismatch,
    OtherModel,
    PathError,
    PathTypeError,
    PathValueError,
    shape_mismatch,
)
from modstate._core.module.anatomy import anatomy_of, forget
from modstate._core.module.state_dict import run_overridden_loads
from modstate._core.sharded.sharding import loadable
from modstate._core.swap.prepare import prepare, prepare_hooked
from modstate._core.swap.swaps import Swap
from modstate._core.torch_facts import eager_route
from modstate._core.types import TreeArg


def load(
    module: nn.Module,
    tree: TreeArg,
    *,
    strict: bool = True,
    use_state_dict: bool = False,
    assign: bool = False,
) -> None:
    """Copy the tree's values into the module's own tensors, in place; or, with ``assign=True``,
    make the tree's tensors the module's.

    ``load_state_dict`` semantics, for EMA and target-network updates: the module keeps its
    objects; only their values change (the tree shares no memory with the module afterwards).
    Nothing changes unless every check passed. A module on the meta device holds no data, so
    copying into it would do nothing: that is refused, naming ``assign=True``.

    ``assign=True`` is ``load_state_dict(assign=True)``: after the same checks, the tree's
    tensors become the module's, without a copy. A parameter stays an ``nn.Parameter`` with the
    module's ``requires_grad`` (a Parameter leaf with that flag goes in as it is; any other tensor
    is wrapped in a new Parameter sharing its storage), a buffer takes the tree's tensor itself,
    and a tie stays a tie (one Parameter at all its paths). That is how a model built on the meta
    device is materialized from a checkpoint, at no memory cost with
    ``checkpoint.load(path, mmap=True)``. Like [`swap`][modstate.swap], it changes the module for every
    thread that uses it; an optimizer made before holds the old parameters.

    Args:
        module: The module to load into.
        tree: A tree of tensors, or a tuple of trees (as for [`inject`][modstate.inject]). Flat dicts with
            dotted keys (``state_dict()``) work too.
        strict: ``True``: the tree gives every path, with the module's dtypes. ``False``: a
            partial tree (the module keeps its own tensors where the tree has none), and other
            dtypes (cast on copy; with ``assign`` the module takes the tree's dtype). Shapes
            must always match. Unknown paths are always an error.
        use_state_dict: Read the tree through the module's ``load_state_dict`` hooks (as
            [`inject`][modstate.inject]); a module that overrides ``_load_from_state_dict`` loads itself.
        assign: Make the tree's tensors the module's instead of copying into them.

    Returns:
        None.

    Raises:
        KeyError: An unknown path, or (strict) a missing one.
        ValueError: A shape differs, the module's tensor is on the meta device (without
            ``assign``), the tree's is (it holds no data), a lazy parameter is not initialized,
            tied paths get different tensors, or a path is given twice.
        TypeError: A dtype differs (strict), a leaf is not a tensor, or (``assign``) an integer
            tensor is given for a parameter that requires grad.

    Example:
        >>> import torch, modstate as ms
        >>> online, target = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> ms.load(target, ms.extract(online))
        >>> bool(torch.equal(target.weight, online.weight))
        True
        >>> with torch.device("meta"):
        ...     big = torch.nn.Linear(2, 2)                  # no memory, no initialisation
        >>> ms.load(big, ms.extract(online, copy=True), assign=True)
        >>> big.weight.device, type(big.weight).__name__, big.weight.requires_grad
        (device(type='cpu'), 'Parameter', True)
    """
    try:
        eager_route(_load, module, tree, strict, use_state_dict, assign)
    except PathError as error:
        fixes: dict[type, str | None] = {
            DtypeMismatch: "strict=False assigns the tree's dtypes"
            if assign
            else "strict=False casts the values to the module's dtypes",
        }
        raise error.within("load", fixes.get(type(error))) from None


def _load(
    module: nn.Module, tree: TreeArg, strict: bool, use_state_dict: bool, assign: bool
) -> None:
    if use_state_dict:
        plan, guard = prepare_hooked(module, tree, strict, in_place=True)
        currents = [a.current for a in plan.assignments]
        values = [a.value for a in plan.assignments]
        tables, names = [a.table for a in plan.assignments], [a.name for a in plan.assignments]
        keys = [a.key for a in plan.assignments]
        try:
            _check_loadable(lambda i: (i, keys[i]), currents, values, assign, lazy_ok=True)
        except BaseException:
            guard.restore()
            raise
    else:
        prepared = prepare(module, tree, strict)
        currents, values, plan = prepared.olds, prepared.values, None
        tables, names = prepared.tables, prepared.names
        _check_loadable(_slot_finder(module, prepared), currents, values, assign, lazy_ok=False)
    sharding = anatomy_of(module).sharding
    if assign:
        if sharding is not None:
            sharding.check_swappable(tables, names)
        _assign(tables, names, _slot_values(currents, values))
        forget(module)
    else:
        if sharding is not None:
            sharding.check_loadable(tables, names)
            values = loadable(currents, values)
        _copy(currents, values)
    if plan is not None:
        for owner, _, state in plan.extra_states:
            owner.set_extra_state(state)
        if plan.overridden:
            run_overridden_loads(plan, assign=assign)
            if plan.errors:
                raise ValueError(f"load: {plan.errors[0]}")


def _copy(currents: list[Tensor], values: list[Tensor]) -> None:
    """``current.copy_(value)`` for each pair, once per tensor (ties), fused where possible."""
    seen: set[int] = set()
    pairs = []
    for current, value in zip(currents, values, strict=True):
        if current is not value and id(current) not in seen:
            seen.add(id(current))
            pairs.append((current, value))
    if not pairs:
        return
    destinations = [destination for destination, _ in pairs]
    sources = [source for _, source in pairs]
    with torch.no_grad():
        try:
            torch._foreach_copy_(destinations, sources)
        except (RuntimeError, TypeError, NotImplementedError):
            for destination, source in pairs:
                destination.copy_(source)


def _slot_values(currents: list[Any], values: list[Any]) -> list[Any]:
    """What each slot holds after an assigning load: a parameter stays a Parameter with the
    module's ``requires_grad``, made once per distinct tensor so that ties stay ties."""
    made: dict[tuple[int, bool], Any] = {}
    out = []
    for current, value in zip(currents, values, strict=True):
        as_parameter = isinstance(current, nn.Parameter)
        key = (id(value), as_parameter)
        new = made.get(key)
        if new is None:
            new = value
            if as_parameter and not (
                isinstance(value, nn.Parameter) and value.requires_grad == current.requires_grad
            ):
                new = nn.Parameter(value.detach(), requires_grad=current.requires_grad)
            made[key] = new
        out.append(new)
    return out


def _assign(tables: list[dict[str, Any]], names: list[str], values: list[Any]) -> None:
    for table, name, value in zip(tables, names, values, strict=True):
        table[name] = value


def _check_loadable(
    where: Any, currents: list[Any], values: list[Any], assign: bool, *, lazy_ok: bool
) -> None:
    """Refuse, before anything changes, what a copy (or an assignment) cannot do, naming the first
    such path in module order; ``where(i)`` is ``(position in module order, path)``."""
    problems = [
        i
        for i, (current, value) in enumerate(zip(currents, values, strict=True))
        if _problem(current, value, assign, lazy_ok) is not None
    ]
    if problems:
        i = min(problems, key=lambda i: where(i)[0])
        kind, what, fix = _problem(currents[i], values[i], assign, lazy_ok)  # type: ignore[misc]
        if kind is OtherModel:  # say how far from this model the tree is
            others = sum(
                1
                for j in problems
                if j != i and not is_lazy(currents[j]) and values[j].shape != currents[j].shape
            )
            raise shape_mismatch(where(i)[1], values[i], currents[i], others)
        raise kind(where(i)[1], what, fix)


def _problem(
    current: Any, value: Any, assign: bool, lazy_ok: bool
) -> tuple[type[PathError], str, str] | None:
    if not isinstance(value, Tensor):
        return None  # prepare names non-tensor leaves
    if value.device.type == "meta":
        return (
            PathValueError,
            "the tree's tensor is on the meta device and holds no data",
            "give a tree of real tensors, such as modstate.checkpoint.load(path)",
        )
    if is_lazy(current):
        if lazy_ok:
            return None
        return (
            PathValueError,
            "not initialized yet (lazy module)",
            "load with use_state_dict=True, which materializes it as load_state_dict does, "
            "or use swap",
        )
    if value.shape != current.shape:
        # load puts values into the module's own tensors: shapes match, strict or not
        return (OtherModel, "", "")  # _check_loadable words it
    if assign:
        if (
            isinstance(current, nn.Parameter)
            and current.requires_grad
            and not (value.is_floating_point() or value.is_complex())
        ):
            return (
                PathTypeError,
                f"a {value.dtype} tensor cannot become a parameter that requires grad",
                "give a floating-point tensor, or freeze the parameter first",
            )
    elif current.device.type == "meta":
        return (
            PathValueError,
            "the module's tensor is on the meta device (it holds no data), so copying into it "
            "would do nothing",
            "pass assign=True to make the tree's tensors the module's: "
            "ms.load(module, tree, assign=True)",
        )
    return None


def _slot_finder(module: nn.Module, prepared: Swap) -> Any:
    """``where(i)``: the position in module order and the path of the prepared swap's slot i."""

    def where(i: int) -> tuple[int, str]:
        table, name = prepared.tables[i], prepared.names[i]
        slots = anatomy_of(module).slots
        return next((n, s.path) for n, s in enumerate(slots) if s.table is table and s.name == name)

    return where
