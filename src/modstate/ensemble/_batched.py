"""Batched kernels: run the layers whose ensemble form is known directly on stacked tensors.

An ensemble of N copies of one ``nn.Linear`` is one ``torch.baddbmm`` over the stacked weights; N
copies of ``nn.Conv2d`` are one grouped convolution; an elementwise activation does not care how
many members there are. `compile_plan` turns a module into a list of *steps*, closures built
once that map ``(activation, shared)`` to the next pair: ``shared`` says the activation is still
the same for every member (the shared input), otherwise its dim 0 is the member dim. A submodule
without a known batched form becomes a step that runs it under ``torch.vmap`` over
[`modstate.call`][modstate.call], so any model works and the known layers are fast. An activation right
after a batched Linear or convolution (ReLU, Tanh, Sigmoid) runs in place on that layer's new
output, which saves allocating one large tensor per layer; the gradients are the same.

Steps read the stacked tensors from their owners' ``_parameters`` / ``_buffers`` dicts at every
call, never keeping tensors themselves, so ``.to()`` and ``load_state_dict`` are seen at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from modstate._core.anatomy import buffer_paths
from modstate._core.extract import extract
from modstate._core.flat import flatten

from ._vmap import Structure

Step = Callable[[Tensor, bool], tuple[Any, bool]]
Slot = tuple[dict[str, Any], str]
"""Where a stacked tensor lives: ``table[name]``, ``table`` an owner's ``_parameters``/``_buffers``."""

ELEMENTWISE: tuple[type[nn.Module], ...] = (
    nn.CELU,
    nn.ELU,
    nn.GELU,
    nn.Hardshrink,
    nn.Hardsigmoid,
    nn.Hardswish,
    nn.Hardtanh,
    nn.LeakyReLU,
    nn.LogSigmoid,
    nn.Mish,
    nn.ReLU,
    nn.ReLU6,
    nn.SELU,
    nn.SiLU,
    nn.Sigmoid,
    nn.Softplus,
    nn.Softshrink,
    nn.Softsign,
    nn.Tanh,
    nn.Tanhshrink,
)
_IN_PLACE: dict[type[nn.Module], Callable[[Tensor], Tensor]] = {
    nn.ReLU: torch.relu_,
    nn.Sigmoid: torch.sigmoid_,
    nn.Tanh: torch.tanh_,
}
_CONVOLUTIONS = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}
_HOOKS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)


class PlanContext:
    """What building steps needs: the member count, the randomness mode, and where the stacked
    tensor of each of the template's tensors lives."""

    def __init__(self, count: int, randomness: str, slot_of: dict[int, Slot]) -> None:
        self.count = count
        self.randomness = randomness
        self._slot_of = slot_of

    def slot(self, tensor: Tensor) -> Slot:
        return self._slot_of[id(tensor)]


class Plan:
    """A module's steps, run on one input for every member: ``plan(x, shared)``.

    When every step works row by row on the last dim (Linear, LayerNorm over the last dim,
    elementwise layers, Dropout), the input's leading dims are merged into one before the first
    step and restored after the last, so each Linear is a single ``baddbmm`` with no reshapes."""

    __slots__ = ("count", "rowwise", "steps")

    def __init__(self, steps: list[Step], count: int) -> None:
        self.steps = steps
        self.count = count
        self.rowwise = all(getattr(step, "rowwise", False) for step in steps)

    def __call__(self, x: Tensor, shared: bool) -> Any:
        count = self.count
        lead = None
        if self.rowwise and x.dim() != 2 + (not shared) and x.dim() >= 1 + (not shared):
            lead = x.shape[:-1] if shared else x.shape[1:-1]
            x = x.reshape(-1, x.shape[-1]) if shared else x.reshape(count, -1, x.shape[-1])
        for step in self.steps:
            x, shared = step(x, shared)
        if shared:  # no layer made the members differ: every member gives the same output
            x = x.expand(count, *x.shape)
        if lead is not None:
            x = x.reshape(count, *lead, x.shape[-1])
        return x


def compile_plan(module: nn.Module, context: PlanContext) -> Plan | None:
    """The plan running ``module`` on one input for every member, or None when ``module`` itself
    has no batched form (the caller then runs all of it under vmap, with any arguments)."""
    if not _is_plain(module) or (
        type(module) is not nn.Sequential and _builder_for(module) is None
    ):
        return None
    return Plan(_steps(module, context), context.count)


def _rowwise(step: Step) -> Step:
    step.rowwise = True  # type: ignore[attr-defined]
    return step


def layer_names(module: nn.Module, context: PlanContext) -> tuple[list[str], list[str]]:
    """The type names of the layers that run batched, and of those that run under vmap."""
    fast: list[str] = []
    slow: list[str] = []

    def visit(m: nn.Module) -> None:
        if type(m) is nn.Sequential and _is_plain(m):
            for child in m:
                visit(child)
        elif _is_plain(m) and _builder_for(m) is not None and _builder_for(m)(m, context) != "vmap":
            fast.append(type(m).__name__)
        else:
            slow.append(type(m).__name__)

    visit(module)
    return fast, slow


def _steps(module: nn.Module, context: PlanContext) -> list[Step]:
    if type(module) is nn.Sequential and _is_plain(module):
        steps: list[Step] = []
        for child in module:
            for step in _steps(child, context):
                # An activation right after a batched Linear/convolution may work in place: that
                # output is new, held by no one, and not saved for backward (baddbmm and
                # convolution save their inputs). It saves allocating a large tensor per layer.
                if steps and getattr(steps[-1], "fresh", False):
                    step = getattr(step, "in_place", step)
                steps.append(step)
        return steps
    builder = _builder_for(module) if _is_plain(module) else None
    built = builder(module, context) if builder is not None else "vmap"
    if built == "vmap":
        return [_vmap_step(module, context)]
    return [built] if built is not None else []


def _is_plain(module: nn.Module) -> bool:
    """No hooks: a batched kernel would skip them."""
    return not any(getattr(module, name, None) for name in _HOOKS) and not getattr(
        module, "_forward_hooks_with_kwargs", None
    )


def _builder_for(module: nn.Module) -> Callable[[Any, PlanContext], Any] | None:
    kind = type(module)
    if kind in ELEMENTWISE:
        return _elementwise_step
    return _BUILDERS.get(kind)


# -- the steps --------------------------------------------------------------------------------------
# A builder returns a step, None for a layer that does nothing (Identity), or "vmap" when this
# instance has no batched form after all (a padding mode, say).


def _elementwise_step(module: nn.Module, context: PlanContext) -> Step:
    forward = module.forward

    def step(x: Tensor, shared: bool) -> tuple[Tensor, bool]:
        return forward(x), shared

    in_place = _IN_PLACE.get(type(module))
    if in_place is not None:

        def step_in_place(x: Tensor, shared: bool) -> tuple[Tensor, bool]:
            return in_place(x), shared

        step.in_place = _rowwise(step_in_place)  # type: ignore[attr-defined]
    return _rowwise(step)


def _fresh(step: Step) -> Step:
    """Marks a step whose output is a new tensor that its backward does not need."""
    step.fresh = True  # type: ignore[attr-defined]
    return step


def _identity_step(module: nn.Module, context: PlanContext) -> None:
    return None


def _linear_step(module: nn.Linear, context: PlanContext) -> Step:
    count = context.count
    weights, weight = context.slot(module.weight)
    if module.bias is None:

        def matmul(x: Tensor, w: Tensor) -> Tensor:
            return torch.bmm(x, w)

    else:
        biases, bias = context.slot(module.bias)

        def matmul(x: Tensor, w: Tensor) -> Tensor:
            return torch.baddbmm(biases[bias].unsqueeze(1), x, w)

    def step(x: Tensor, shared: bool) -> tuple[Tensor, bool]:
        w = weights[weight].transpose(1, 2)
        if shared:
            if x.dim() == 2:
                return matmul(x.expand(count, -1, -1), w), False
            rows = x.reshape(-1, x.shape[-1]).expand(count, -1, -1)
            lead = x.shape[:-1]
        else:
            if x.dim() == 3:
                return matmul(x, w), False
            rows = x.reshape(count, -1, x.shape[-1])
            lead = x.shape[1:-1]
        out = matmul(rows, w)
        return out.view(count, *lead, out.shape[-1]), False

    return _fresh(_rowwise(step))


def _convolution_step(module: nn.Module, context: PlanContext) -> Step | str:
    if module.padding_mode != "zeros":
        return "vmap"
    convolve = _CONVOLUTIONS[type(module)]
    spatial = len(module.kernel_size)
    count = context.count
    weights, weight = context.slot(module.weight)
    biases, bias = context.slot(module.bias) if module.bias is not None else ({}, "")
    stride, padding, dilation = module.stride, module.padding, module.dilation
    groups = module.groups * count
    per_member = _vmap_step(module, context)  # for unbatched (no batch dim) inputs

    def step(x: Tensor, shared: bool) -> tuple[Tensor, bool]:
        if x.dim() != spatial + 2 + (not shared):
            return per_member(x, shared)
        w = weights[weight]
        b = biases.get(bias)
        if shared:
            channels = x.repeat(1, count, *(1,) * spatial)
        else:
            channels = x.transpose(0, 1).flatten(1, 2)  # (batch, members * channels, ...)
        out = convolve(
            channels,
            w.flatten(0, 1),
            None if b is None else b.flatten(),
            stride,
            padding,
            dilation,
            groups,
        )
        out = out.view(out.shape[0], count, w.shape[1], *out.shape[2:]).transpose(0, 1)
        return out, False

    return _fresh(step)


def _layer_norm_step(module: nn.LayerNorm, context: PlanContext) -> Step:
    count = context.count
    normalized = tuple(module.normalized_shape)
    eps = module.eps
    weights, weight = context.slot(module.weight) if module.weight is not None else ({}, "")
    biases, bias = context.slot(module.bias) if module.bias is not None else ({}, "")
    affine = module.weight is not None or module.bias is not None

    def step(x: Tensor, shared: bool) -> tuple[Tensor, bool]:
        out = F.layer_norm(x, normalized, None, None, eps)
        if not affine:
            return out, shared
        # (count, 1, ..., 1, *normalized): broadcasts over the member's leading dims.
        ones = (1,) * (out.dim() - len(normalized) - (not shared))
        shape = (count, *ones, *normalized)
        w = weights.get(weight)
        b = biases.get(bias)
        if w is not None and b is not None:
            return torch.addcmul(b.view(shape), out, w.view(shape)), False
        if w is not None:
            return out * w.view(shape), False
        return out + b.view(shape), False

    return _rowwise(step) if len(normalized) == 1 else step


def _batch_norm_step(module: nn.modules.batchnorm._BatchNorm, context: PlanContext) -> Step | str:
    """N BatchNorms are one BatchNorm over ``N * channels`` channels: the members' channels side
    by side, with the stacked statistics viewed flat, so the kernel updates them in place."""
    if module.momentum is None:
        return "vmap"  # the cumulative average reads each member's own count
    count = context.count
    dims = {nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,)}[type(module)]
    weights, weight = context.slot(module.weight) if module.weight is not None else ({}, "")
    biases, bias = context.slot(module.bias) if module.bias is not None else ({}, "")
    tracked = module.track_running_stats
    means, mean = context.slot(module.running_mean) if tracked else ({}, "")
    variances, variance = context.slot(module.running_var) if tracked else ({}, "")
    counters, counter = context.slot(module.num_batches_tracked) if tracked else ({}, "")
    per_member = _vmap_step(module, context)
    eps, momentum = module.eps, module.momentum

    def step(x: Tensor, shared: bool) -> tuple[Tensor, bool]:
        running_mean, running_var = means.get(mean), variances.get(variance)
        if x.dim() - (not shared) not in dims or not all(
            t is None or t.is_contiguous() for t in (running_mean, running_var)
        ):
            return per_member(x, shared)
        if shared:
            x = x.expand(count, *x.shape)
        training = module.training
        if training and tracked:
            counters[counter].add_(1)
        use_batch_stats = training or running_mean is None
        keep_stats = not training or tracked
        w, b = weights.get(weight), biases.get(bias)
        channels = x.transpose(0, 1).flatten(1, 2)  # (batch, members * channels, ...)
        out = F.batch_norm(
            channels,
            running_mean.view(-1) if keep_stats and running_mean is not None else None,
            running_var.view(-1) if keep_stats and running_var is not None else None,
            None if w is None else w.flatten(),
            None if b is None else b.flatten(),
            use_batch_stats,
            momentum,
            eps,
        )
        out = out.view(out.shape[0], count, -1, *out.shape[2:]).transpose(0, 1)
        if out.dim() == 3:
            # (members, rows, channels) as a view of (rows, members * channels): the batched
            # matmul of a following Linear, and its backward, read such strided rows much more
            # slowly than one copy to member-major rows costs.
            out = out.contiguous()
        return out, False

    # The output is new and batch_norm's backward does not save it: an activation may run in place.
    return _fresh(step)


def _dropout_step(module: nn.Dropout, context: PlanContext) -> Step:
    count = context.count
    randomness = context.randomness
    p = module.p

    def step(x: Tensor, shared: bool) -> tuple[Tensor, bool]:
        if not module.training or p == 0:
            return x, shared
        if randomness == "error":
            raise RuntimeError(
                "dropout in training mode draws random masks, and randomness='error': pass "
                "randomness='different' (a mask per member) or 'same'"
            )
        if randomness == "same":
            if shared:
                return F.dropout(x, p, True), True
            return x * F.dropout(torch.ones_like(x[0]), p, True), False
        if shared:
            x = x.expand(count, *x.shape)
        return F.dropout(x, p, True), False

    return _rowwise(step)


def _flatten_step(module: nn.Flatten, context: PlanContext) -> Step:
    start, end = module.start_dim, module.end_dim
    batched_start = start + 1 if start >= 0 else start
    batched_end = end + 1 if end >= 0 else end

    def step(x: Tensor, shared: bool) -> tuple[Tensor, bool]:
        if shared:
            return x.flatten(start, end), True
        return x.flatten(batched_start, batched_end), False

    return step


def _vmap_step(module: nn.Module, context: PlanContext) -> Step:
    """``module`` under vmap over [`modstate.call`][modstate.call], with its own slice of the stacked state."""
    count = context.count
    randomness = context.randomness
    run = vmap_runner(module, context, randomness)

    def step(x: Tensor, shared: bool) -> tuple[Any, bool]:
        if shared and not run.has_state:  # vmap needs one batched input
            x, shared = x.expand(count, *x.shape), False
        return run((x,), {}, (None if shared else 0,)), False

    return step


class vmap_runner:
    """``module`` run for every member under vmap, on the stacked tensors where they live now.

    Prepared once: which stacked tensor goes to which path (ties counted once). A buffer that
    ``forward`` reassigns is put back where its stacked tensor lives."""

    __slots__ = (
        "count",
        "distinct_slots",
        "has_state",
        "module",
        "randomness",
        "slots",
        "structure",
    )

    def __init__(self, module: nn.Module, context: PlanContext, randomness: str) -> None:
        self.count = context.count
        flat = flatten(extract(module))
        slot_of_path = {path: context.slot(tensor) for path, tensor in flat.items()}
        self.module = module
        self.randomness = randomness
        self.structure = Structure(list(flat), list(flat.values()), buffer_paths(module))
        self.slots = [slot_of_path[path] for path in self.structure.paths]
        ordered = list(slot_of_path.values())
        self.distinct_slots = [ordered[j] for j in self.structure.sources]
        self.has_state = bool(flat)

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any], in_dims: Any) -> Any:
        distinct = [table[name] for table, name in self.distinct_slots]
        out, reassigned = self.structure.run(
            self.module, distinct, args, kwargs, in_dims, self.randomness, None, self.count
        )
        for k, value in reassigned.items():
            table, name = self.slots[k]
            table[name] = value
        return out


_BUILDERS: dict[type[nn.Module], Callable[[Any, PlanContext], Any]] = {
    nn.Linear: _linear_step,
    nn.Conv1d: _convolution_step,
    nn.Conv2d: _convolution_step,
    nn.Conv3d: _convolution_step,
    nn.LayerNorm: _layer_norm_step,
    nn.BatchNorm1d: _batch_norm_step,
    nn.BatchNorm2d: _batch_norm_step,
    nn.BatchNorm3d: _batch_norm_step,
    nn.Dropout: _dropout_step,
    nn.Flatten: _flatten_step,
    nn.Identity: _identity_step,
}
