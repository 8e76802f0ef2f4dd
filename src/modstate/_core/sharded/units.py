"""FSDP2's forward, stood in for during a stateless call: one unit's parameters gathered at a time.

Every ``fully_shard`` -ed module is a *unit*: it owns the parameters of its subtree that no nested
``fully_shard`` -ed module owns (the root's own parameters are the root's unit). FSDP2 all-gathers
a unit's parameters in a forward pre-hook, frees them in a forward hook, and all-gathers them again
before the unit's backward. During a call with a tree, `Units` takes the place of those two
hooks (at their very keys, so every other hook keeps its order) and does the same with the tree's
``DTensor`` s: just before a unit runs, its leaves are gathered (`Gathered`, one
all-gather) and put into its slots; just after, the slots get the ``DTensor`` s back, and the full
tensors go:

- without autograd (``torch.no_grad()``, ``inference_mode``, or nothing requires grad), with the
  last reference to them;
- with autograd, their memory is released while autograd keeps the tensor objects it saved; a
  hook on the unit's outputs gathers them again when the gradient reaches the unit, and the
  gather's backward (which runs once every gradient of the unit's parameters is done) releases
  them again. Such a unit's outputs must not be views that are then modified in place if the
  unit is to be re-gathered, as with FSDP2 itself.

Between units, a unit's slots hold the tree's ``DTensor`` s, as FSDP2's hold its sharded
parameters: a forward that reads another unit's parameters outside that unit's forward fails
loudly (mixed ``DTensor`` / ``Tensor`` arithmetic), as it does under FSDP2.

FSDP2's ``MixedPrecisionPolicy`` applies as in the module's own forward: the shards are cast to
``param_dtype`` before they are gathered (a parameter that is not floating point, or already in
that dtype, is not cast), floating-point inputs are cast to ``param_dtype`` when
``cast_forward_inputs`` is set, outputs to ``output_dtype``; a gradient goes back through
``reduce_dtype`` (a call reduces nothing across ranks: each rank gets its piece of its own
gradient, so ``reduce_dtype`` only rounds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from modstate._core.sharded.gathers import Gathered, gather
from modstate._core.torch_facts import is_dtensor
from modstate._core.vmap_levels import unwrapped, wrapper_chain


class Policy:
    """The parts of an FSDP2 ``MixedPrecisionPolicy`` a forward sees."""

    __slots__ = ("input_dtype", "output_dtype", "param_dtype", "reduce_dtype")

    def __init__(self, module: nn.Module) -> None:
        policy = _mixed_precision_of(module)
        self.param_dtype = getattr(policy, "param_dtype", None)
        self.reduce_dtype = getattr(policy, "reduce_dtype", None)
        self.output_dtype = getattr(policy, "output_dtype", None)
        cast_inputs = getattr(policy, "cast_forward_inputs", True)
        self.input_dtype = self.param_dtype if cast_inputs else None

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        """The dtype a parameter of ``dtype`` computes in (None: its own), as FSDP2 decides."""
        if self.param_dtype is None or self.param_dtype == dtype or not dtype.is_floating_point:
            return None
        return self.param_dtype

    def gradient_dtype(self) -> torch.dtype | None:
        return None if self.reduce_dtype == self.param_dtype else self.reduce_dtype


def _mixed_precision_of(module: nn.Module) -> Any:
    state = module._get_fsdp_state()  # type: ignore[operator]
    try:
        return state._mp_policy
    except AttributeError:
        raise RuntimeError(
            f"{type(module).__name__}: this version of torch keeps FSDP2's MixedPrecisionPolicy "
            "where modstate does not look (FSDPState._mp_policy), so a call cannot apply it"
        ) from None


class _Unit:
    """One unit's part of a call: which slots it fills with which values."""

    __slots__ = (
        "active",
        "distinct",
        "dtypes",
        "input_dtype",
        "output_dtype",
        "placeholders",
        "plan",
        "positions",
        "reduce_dtypes",
    )

    def __init__(self, policy: Policy, positions: list[int], values: list[Any]) -> None:
        self.input_dtype = policy.input_dtype
        self.output_dtype = policy.output_dtype
        self.positions = positions
        self.placeholders = [values[i] for i in positions]
        # Each slot's value in the unit's forward: ("gather", k) for the k-th distinct DTensor,
        # ("cast", dtype) for a plain tensor cast to param_dtype, ("keep", None) otherwise.
        sources: dict[int, int] = {}
        self.plan: list[tuple[str, Any]] = []
        distinct: list[Any] = []
        dtypes: list[Any] = []
        reduce_dtypes: list[Any] = []
        for value in self.placeholders:
            if isinstance(value, Tensor) and is_dtensor(unwrapped(value)):
                k = sources.get(id(value))
                if k is None:
                    k = sources[id(value)] = len(distinct)
                    distinct.append(value)
                    dtypes.append(policy.compute_dtype(value.dtype))
                    reduce_dtypes.append(policy.gradient_dtype())
                self.plan.append(("gather", k))
            elif isinstance(value, Tensor) and policy.compute_dtype(value.dtype) is not None:
                self.plan.append(("cast", policy.param_dtype))
            else:
                self.plan.append(("keep", None))
        self.distinct = distinct
        self.dtypes = dtypes
        self.reduce_dtypes = reduce_dtypes
        self.active: list[tuple[Gathered | None, list[Any]]] = []

    def values(self, fulls: list[Tensor]) -> list[Any]:
        out = []
        for (how, what), value in zip(self.plan, self.placeholders, strict=True):
            if how == "gather":
                out.append(fulls[what])
            elif how == "cast":
                out.append(value.to(what))
            else:
                out.append(value)
        return out


class Units:
    """Stand-ins for FSDP2's forward hooks on every unit, for one call.

    ``put(positions, values)`` puts values into the call's slots (the swap's own method);
    ``units`` maps each ``fully_shard`` -ed module to the positions of the slots it owns.
    """

    __slots__ = ("_by_module", "_put")

    def __init__(
        self,
        put: Callable[[list[int], list[Any]], None],
        units: list[tuple[nn.Module, list[int]]],
        values: list[Any],
    ) -> None:
        self._put = put
        self._by_module = {id(m): _Unit(Policy(m), positions, values) for m, positions in units}

    def hook(self, module: nn.Module, hook_dict: str) -> Any:
        """The hook that takes the place of FSDP2's hook in ``module``'s ``hook_dict`` (None for
        a module that is not a unit of this call)."""
        unit = self._by_module.get(id(module))
        if unit is None:
            return None
        if hook_dict == "_forward_pre_hooks":
            return lambda module, args, kwargs: self._pre(unit, args, kwargs)
        return lambda module, args, output: self._post(unit, output)

    def method(self, module: nn.Module, method: Callable[..., Any]) -> Any:
        """What takes the place of a method registered with ``register_fsdp_forward_method``:
        ``method`` run between the unit's stand-in hooks (None for a module that is not a unit
        of this call)."""
        unit = self._by_module.get(id(module))
        if unit is None:
            return None

        def run(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = self._pre(unit, args, kwargs)
            return self._post(unit, method(*args, **kwargs))

        return run

    def _pre(self, unit: _Unit, args: Any, kwargs: Any) -> tuple[Any, Any]:
        if unit.input_dtype is not None:
            args, kwargs = _cast_floats(unit.input_dtype, (args, kwargs))
        gathered = None
        fulls: list[Tensor] = []
        if unit.distinct:
            gathered = Gathered(unit.dtypes, unit.reduce_dtypes)
            fulls = gather(gathered, unit.distinct)
        values = unit.values(fulls)
        if unit.positions:
            self._put(unit.positions, values)
        unit.active.append((gathered, values))
        return args, kwargs

    def _post(self, unit: _Unit, output: Any) -> Any:
        if not unit.active:  # an always-called hook after a pre-hook that failed
            return output
        gathered, _ = unit.active.pop()
        if unit.positions:
            # A unit run inside itself (recursion) gets the outer run's values back.
            self._put(unit.positions, unit.active[-1][1] if unit.active else unit.placeholders)
        if gathered is not None:
            output = _release(gathered, output)
        if unit.output_dtype is not None:
            output = _cast_floats(unit.output_dtype, output)
        return output


def _release(gathered: Gathered, output: Any) -> Any:
    """Free a unit's full tensors after its forward, with a hook on its outputs that gathers
    them again before its backward; nothing to do when nothing on the outputs is tracked by
    autograd (the full tensors go with their last reference)."""
    tensors = _tensors_in(output)
    tracked = [t for t in tensors if _tracked(t)]
    if not tracked:
        return output
    kept = {_storage(full) for full in gathered.fulls} - {-1}
    if any(_storage(t) in kept for t in tensors):
        return output  # the output is (a view of) a parameter: it keeps its memory

    def refill(grad: Tensor) -> None:
        gathered.refill()

    wrap = False
    for tensor in tracked:
        if tensor.requires_grad:
            tensor.register_hook(refill)
            base = tensor._base
            if base is not None and base.requires_grad:
                # An in-place op on a view output replaces its hook; its base keeps this one.
                base.register_hook(refill)
        else:
            wrap = True  # tracked by an outer torch.func.grad, under a vmap
    if wrap:
        from torch.distributed.utils import _apply_to_tensors

        output = _apply_to_tensors(
            lambda t: (
                _RefillBeforeBackward.apply(gathered, t)
                if _tracked(t) and not t.requires_grad
                else t
            ),
            output,
        )
    gathered.releasing = True
    gathered.free()
    return output


class _RefillBeforeBackward(torch.autograd.Function):
    """A copy of a unit's output whose backward gathers the unit's parameters again; for the
    outputs that a hook cannot be registered on (under ``torch.vmap`` inside ``torch.func.grad``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(gathered: Gathered, tensor: Tensor) -> Tensor:  # type: ignore[override]
        return tensor.clone()  # not the input itself, which in-place ops could not modify then

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.gathered = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:  # type: ignore[override]
        ctx.gathered.refill()
        return None, grad


def _tracked(tensor: Tensor) -> bool:
    """Whether autograd records ``tensor`` at some level (torch.func wraps report it level by
    level: a vmapped tensor inside torch.func.grad says False outside, True one level in)."""
    return any(level.requires_grad for level in wrapper_chain(tensor))


def _storage(tensor: Tensor) -> int:
    inner = unwrapped(tensor)
    try:
        return inner.untyped_storage().data_ptr() if inner.numel() else -1
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return -1


def _tensors_in(value: Any, found: list[Tensor] | None = None) -> list[Tensor]:
    """The tensors in an output: in dicts, lists, tuples (named ones too) and dataclasses."""
    found = [] if found is None else found
    if isinstance(value, Tensor):
        found.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors_in(item, found)
    elif isinstance(value, (list, tuple, set)):
        for item in value:
            _tensors_in(item, found)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _tensors_in(getattr(value, field.name), found)
    return found


def _cast_floats(dtype: torch.dtype, value: Any) -> Any:
    """``value`` with every floating-point tensor in it cast to ``dtype``, walked as FSDP2 walks
    a forward's inputs and outputs."""
    from torch.distributed.utils import _apply_to_tensors

    def cast(tensor: Tensor) -> Tensor:
        if not torch.is_floating_point(tensor) or tensor.dtype == dtype:
            return tensor
        return tensor.to(dtype)

    return _apply_to_tensors(cast, value)
