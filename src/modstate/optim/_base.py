"""`ElementwiseOptimizer`: what every pure optimizer of `modstate.optim` shares.

An optimizer is a frozen dataclass of hyperparameters. `init` builds its state, `step` checks the
trees, resolves the hyperparameters for this step (a schedule for `lr` is evaluated at the step
count; a 0-dim tensor that is free to read becomes a number, so the numbers are `torch.optim`'s),
and hands a `Run` (the leaves as lists, the ops, the step count) to the optimizer's `_update`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from modstate._core.types import Tree
from modstate.optim._checks import check_betas, check_hyperparameter, check_kernels, check_lr
from modstate.optim._hyper import (
    check_members,
    hyperparameter_names,
    is_number,
    resolve,
    scalars_of,
)
from modstate.optim._kernels import DIFFERENTIABLE, FOREACH, FUSED, SINGLE, eager_kernel
from modstate.optim._lists import LeafOps, Scalar
from modstate.optim._repeat import Repeat, Returned, again
from modstate.optim._run import Run, one
from modstate.optim._tree import (
    StepLeaves,
    init_buffers,
    new_scalar,
    read_number,
    scalar_dtype,
)

# A learning rate: a number, a 0-dim tensor, or a schedule (a function of the step count).
LearningRate = Scalar | Callable[[Any], Scalar]
# Two decay rates (beta1, beta2), each a number or a 0-dim tensor.
Betas = tuple[Scalar, Scalar]


def _gathered(
    kernel: str,
    ops: LeafOps,
    leaves: StepLeaves,
    names: tuple[str, ...],
    count: float | Tensor,
    hyper: dict[str, Any],
    scalars: dict[str, Tensor],
    donate: bool,
    new_step: Tensor,
) -> Run:
    """The `Run` of a step over the leaves it updates."""
    buffers = {n: leaves.gather(leaves.buffers[n]) for n in names}
    p, g = leaves.gather(leaves.params), leaves.gather(leaves.grads)
    return Run(kernel, ops, p, g, buffers, count, hyper, scalars, donate, new_step)


def _results(
    leaves: StepLeaves,
    names: tuple[str, ...],
    new_step: Tensor,
    new_scalars: dict[str, Tensor],
    run: Run | None = None,
) -> tuple[Tree, dict[str, Any]]:
    """``(new_params, new_state)``: the run's updated leaves (none without a run) put back."""
    new_state: dict[str, Any] = {"step": new_step, **new_scalars}
    new_state.update(
        {n: leaves.rebuild(leaves.buffers[n], run.buffers[n] if run else []) for n in names}
    )
    return leaves.rebuild(leaves.params, run.p if run else []), new_state


@dataclass(frozen=True)
class ElementwiseOptimizer:
    """Base of the pure optimizers whose update is elementwise over the leaves (every optimizer
    of `modstate.optim`; `masked` wraps one). Subclasses define the fields, buffers and `_update`.

    Subclasses are frozen dataclasses of hyperparameters; build them with the factories
    (`modstate.optim.adam`, ...), which carry `torch.optim`'s argument names and defaults.

    The object also keeps two caches beside its fields, set with ``object.__setattr__`` (the
    dataclass is frozen): ``_repeat``, what the last eager step found, which the next step of a
    loop handed the very trees it returned may reuse; and ``_constant``, the hyperparameters when
    they are all numbers. They are not fields: equality, ``repr``, copies and pickles leave them
    out (`__getstate__`), and a step under ``torch.compile`` neither reads nor writes them.
    """

    name: ClassVar[str] = "optimizer"
    scalar_names: ClassVar[tuple[str, ...]] = ()
    # Whether torch.optim has fused kernels for this optimizer (`_fused_update` runs them).
    has_fused: ClassVar[bool] = False

    foreach: bool | None = field(default=None, kw_only=True)
    fused: bool | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        check_kernels(self.name, self.foreach, self.fused, has_fused=self.has_fused)
        hyperparameter_names(type(self))  # known before any trace (dataclass fields are not)

    def __getstate__(self) -> dict[str, Any]:
        """The fields only: a pickled or copied optimizer leaves its caches behind (what the
        last step found, `_repeat`, concerns that step's trees, and holds their ids)."""
        return {key: value for key, value in self.__dict__.items() if key not in _CACHES}

    @property
    def buffer_names(self) -> tuple[str, ...]:
        """Names of the per-leaf state trees."""
        return ()

    def _fill(self, name: str, leaf: Tensor) -> Tensor:
        """The initial value of buffer `name` for `leaf`: zeros unless an optimizer says else."""
        return torch.zeros_like(leaf, memory_format=torch.preserve_format)

    def _update(self, run: Run) -> dict[str, Tensor]:
        """Update `run.p` and `run.buffers`; return the new scalar state (name -> 0-dim)."""
        raise NotImplementedError

    def _fused_update(self, run: Run) -> dict[str, Tensor]:
        """`_update` with torch's fused kernel, in place on `run.p` and `run.buffers` (which
        the step owns by then); only for the optimizers with `has_fused`."""
        raise NotImplementedError

    def init(self, params: Tree) -> dict[str, Any]:
        """The optimizer's state before the first step.

        Args:
            params: the tree of floating-point (or complex) tensors to optimize; None is an
                empty subtree. A tied tensor (one object at several paths) gets one buffer,
                standing at all its paths.

        Returns:
            ``{"step": 0-dim tensor, <buffer name>: tree like params, ...}``: a step counter
            (a 0-dim CPU tensor, float32 like torch.optim's) and one tree per buffer
            (``"exp_avg"``, ``"momentum_buffer"``, ...).

        Raises:
            TypeError: a leaf of `params` is not a floating-point or complex tensor (the
                message names its path and the fix).

        Example:
            >>> opt = modstate.optim.sgd(lr=0.1, momentum=0.9)
            >>> sorted(opt.init({"w": torch.ones(2)}))
            ['momentum_buffer', 'step']
        """
        state: dict[str, Any] = {"step": new_scalar(0.0)}
        state.update({name: new_scalar(1.0) for name in self.scalar_names})
        state.update(init_buffers(params, self.buffer_names, self._fill, self.name))
        return state

    def step(
        self, params: Tree, grads: Tree, state: Mapping[str, Any], *, donate: bool = False
    ) -> tuple[Tree, dict[str, Any]]:
        """One optimizer step.

        No input is changed, unless ``donate=True``. Leaves whose gradient is None keep their
        param and state (the same objects); the step counter is shared by all leaves and
        counts every call.

        Args:
            params: the tree of tensors being optimized.
            grads: a tree of the same structure (``torch.func.grad`` or ``ms.grad`` returns
                one); a None leaf freezes that leaf for this step.
            state: the dict returned by `init` or by the last step.
            donate: the caller promises not to read `params` and `state` again, so their
                buffers may hold the results (as ``torch.optim`` steps in place): same
                numbers, no new memory.

        Returns:
            ``(new_params, new_state)``, trees of the same structure as `params` and `state`.

        Raises:
            ValueError: `grads` or a tree of `state` does not fit `params` (the message names
                the first path that does not), or `state` is another optimizer's.
            TypeError: a leaf of `params` is not a floating-point or complex tensor.

        Example:
            >>> opt = modstate.optim.sgd(lr=0.5)
            >>> params = {"w": torch.ones(2)}
            >>> new, state = opt.step(params, {"w": torch.ones(2)}, opt.init(params))
            >>> new["w"], params["w"]
            (tensor([0.5000, 0.5000]), tensor([1., 1.]))
        """
        names = self.buffer_names
        if torch.compiler.is_compiling():
            return self._traced_step(params, grads, state, names)
        repeat = self.__dict__.get("_repeat")
        if repeat is not None and repeat.donated == donate:
            run = again(repeat, params, grads, state)
            if run is not None:
                return self._finish_again(repeat, run, names)
        step = self._check_state(state, names)
        leaves = StepLeaves(params, grads, state, names, self.name)
        scalars = {name: state[name] for name in self.scalar_names}
        if not leaves.active:
            return _results(leaves, names, step + 1, scalars)

        before = read_number(step)
        count_before: float | Tensor = (
            before
            if before is not None
            else step.to(device=leaves.device, dtype=scalar_dtype(leaves.device))
        )
        hyper = self._constant_hyperparameters()
        if hyper is None:
            hyper = {
                name: resolve(getattr(self, name), count_before)
                for name in hyperparameter_names(type(self))
            }
            check_members(self.name, hyper, leaves)
        tensors = [*leaves.tensors(), step, *scalars.values()]
        active = leaves.active_params()
        if LeafOps.differentiable(tensors, [count_before, *scalars_of(hyper)]):
            kernel = DIFFERENTIABLE
        else:
            kernel = eager_kernel(
                f"{self.name}.step", self.foreach, self.fused, active, leaves.active_path
            )
        # The single-tensor order runs as _foreach_ kernels on the CPU only, where they loop
        # the very single-tensor ops (elsewhere they are other kernels, with other roundings).
        eager = kernel != DIFFERENTIABLE and (kernel != SINGLE or all(p.is_cpu for p in active))
        new_step = step.add_(one()) if donate and eager else step + one()
        ops = LeafOps(foreach=eager, multi_tensor=kernel == FOREACH)
        run = _gathered(
            kernel, ops, leaves, names, count_before + 1, hyper, scalars, donate, new_step
        )
        new_scalars = self._update_run(run)
        new_params, new_state = _results(leaves, names, new_step, new_scalars, run)
        # Remember what this step found, for the next step of the loop (`_repeat`).
        kept = None
        if run.ops.foreach and leaves.simple and self._constant_hyperparameters():
            kept = self._remembered(leaves, run, new_scalars, kernel, hyper)
        object.__setattr__(self, "_repeat", kept)  # a cache, not a field
        return new_params, new_state

    def _traced_step(
        self, params: Tree, grads: Tree, state: Mapping[str, Any], names: tuple[str, ...]
    ) -> tuple[Tree, dict[str, Any]]:
        """`step` while ``torch.compile`` traces it: one graph for every step of a run.

        The same checks (at trace time: they read only structure, shapes and dtypes), none of the
        eager caches (a compiled graph is its own cache), and every step-dependent number kept a
        tensor, as ``torch.optim``'s ``capturable`` keeps it: the step count, a schedule's value
        and a 0-dim hyperparameter are graph inputs, so a new step count or learning rate is a
        new input, not a recompile. The update is the out-of-place single-tensor form (the
        compiler fuses it; in place, a donated step gains nothing once compiled), so donation is
        accepted and changes nothing.
        """
        step = self._check_state(state, names)
        leaves = StepLeaves(params, grads, state, names, self.name)
        scalars = {name: state[name] for name in self.scalar_names}
        new_step = step + 1
        if not leaves.active:
            return _results(leaves, names, new_step, scalars)
        count_before = step.to(device=leaves.device, dtype=scalar_dtype(leaves.device))
        hyper = {
            name: resolve(getattr(self, name), count_before)
            for name in hyperparameter_names(type(self))
        }
        check_members(self.name, hyper, leaves)
        ops = LeafOps(foreach=False)
        run = _gathered(
            DIFFERENTIABLE, ops, leaves, names, count_before + 1, hyper, scalars, False, new_step
        )
        return _results(leaves, names, new_step, self._update(run), run)

    def _update_run(self, run: Run) -> dict[str, Tensor]:
        """The update, with the kernel the run chose (fused, by chunks, or as it is)."""
        if run.kernel == FUSED:
            return self._fused_update(run)
        if run.ops.foreach and len(run.p) > 1:
            return self._update_in_chunks(run)
        return self._update(run)

    def _finish_again(
        self, repeat: Repeat, run: Run, names: tuple[str, ...]
    ) -> tuple[Tree, dict[str, Any]]:
        """The rest of a step that `_repeat` recognised as the next of a loop."""
        new_scalars = self._update_run(run)
        if repeat.donated:
            kept = repeat if repeat.holds(run.p, run.buffers) else None
        else:
            kept = repeat.renewed(Returned(run.p, run.buffers, run.step, new_scalars))
        object.__setattr__(self, "_repeat", kept)
        treedef = repeat.treedef
        new_state: dict[str, Any] = {"step": run.step, **new_scalars}
        new_state.update({n: treedef.unflatten(run.buffers[n]) for n in names})
        new_params: Any = treedef.unflatten(run.p)
        return new_params, new_state

    @staticmethod
    def _remembered(
        leaves: StepLeaves,
        run: Run,
        new_scalars: dict[str, Tensor],
        kernel: str,
        hyper: dict[str, Any],
    ) -> Repeat | None:
        """What the next step of the loop may reuse of this finished eager step on `leaves` (a
        simple tree: `run` holds every leaf, in its order): a donated step that wrote every
        param and buffer in place, or a pure one whose outputs are distinct tensors; else None."""
        returned = Returned(run.p, run.buffers, run.step, new_scalars)
        found = Repeat(leaves.treedef, returned, kernel, hyper, donated=run.donated)
        if run.donated and not found.holds(leaves.params, leaves.buffers):
            return None
        return found if found.distinct else None

    def _constant_hyperparameters(self) -> dict[str, Any] | None:
        """The hyperparameters as a dict, when they are all numbers (no schedule, no tensor):
        the same every step, so made once."""
        cached = self.__dict__.get("_constant")
        if cached is None:
            values = {name: getattr(self, name) for name in hyperparameter_names(type(self))}
            constant = all(is_number(value) for value in values.values())
            cached = (values,) if constant else ()
            object.__setattr__(self, "_constant", cached)  # a cache, not a field
        return cached[0] if cached else None

    def _update_in_chunks(self, run: Run) -> dict[str, Tensor]:
        """`_update`, a chunk of leaves at a time (one large leaf, or several small ones): each
        operation then finds its operands still in the cache, as torch.optim's single-tensor
        loop does, where one ``_foreach_*`` kernel over all leaves would stream every tree
        through memory once per operation. Same numbers: the update is elementwise."""
        bounds = _chunk_bounds(run.p)
        if len(bounds) == 1:
            return self._update(run)
        parts = [run.chunk(start, stop) for start, stop in bounds]
        new_scalars: dict[str, Tensor] = {}
        for part in parts:
            new_scalars = self._update(part)
        run.join(parts)
        return new_scalars

    def _check_state(self, state: object, names: tuple[str, ...]) -> Tensor:
        if not isinstance(state, Mapping):
            raise TypeError(
                f"{self.name}.step: 'state': got {type(state).__name__}; pass the dict that "
                f"{self.name}.init (or the last step) returned"
            )
        expected = {"step", *self.scalar_names, *names}
        if set(state) != expected:
            raise ValueError(
                f"{self.name}.step: 'state': has keys {sorted(state)}, but {self.name} keeps "
                f"{sorted(expected)}; pass the state made by this optimizer's init (or its "
                f"last step)"
            )
        for key in ("step", *self.scalar_names):
            if not isinstance(state[key], Tensor) or state[key].dim() != 0:
                raise ValueError(
                    f"{self.name}.step: 'state.{key}': not a 0-dim tensor; pass the state "
                    f"made by this optimizer's init (or its last step)"
                )
        return state["step"]


@dataclass(frozen=True)
class AdamLike(ElementwiseOptimizer):
    """The fields and checks shared by the optimizers built on Adam's moment estimates (Adam,
    AdamW, Adamax, NAdam, RAdam); each declares its own defaults and further fields."""

    lr: LearningRate = 1e-3
    betas: tuple[Scalar, Scalar] = (0.9, 0.999)
    eps: Scalar = 1e-8
    weight_decay: Scalar = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_lr(self.name, self.lr)
        object.__setattr__(self, "betas", check_betas(self.name, self.betas))
        check_hyperparameter(self.name, "eps", self.eps, low=0.0)
        check_hyperparameter(self.name, "weight_decay", self.weight_decay, low=0.0)


# A chunk of an eager step holds at least this many elements: one leaf this large, or several
# smaller ones together (fewer, larger kernels where the leaves are small).
_CHUNK_ELEMENTS = 1 << 16


def _chunk_bounds(leaves: list[Tensor]) -> list[tuple[int, int]]:
    """``(start, stop)`` of consecutive chunks of `leaves`, each of about `_CHUNK_ELEMENTS`."""
    bounds, start, size = [], 0, 0
    for index, leaf in enumerate(leaves):
        size += leaf.numel()
        if size >= _CHUNK_ELEMENTS:
            bounds.append((start, index + 1))
            start, size = index + 1, 0
    if start < len(leaves):
        bounds.append((start, len(leaves)))
    return bounds


# Attributes an optimizer sets on itself as caches (`object.__setattr__`), not fields.
_CACHES = ("_repeat", "_constant")
