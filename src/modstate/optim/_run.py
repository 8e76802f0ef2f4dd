"""`Run`: one optimizer step in progress, as the optimizers' `_update` methods see it."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from modstate.optim._checks import is_zero
from modstate.optim._kernels import FOREACH
from modstate.optim._lists import LeafOps, Leaves


@functools.cache
def one() -> Tensor:
    """A 0-dim 1.0 to count steps with (float32; a counter keeps its own dtype): a tensor, as
    an int would be wrapped into one on every call."""
    return torch.ones((), dtype=torch.float32)


class Run:
    """One step in progress: the leaves to update as lists, and what the update may do to them.

    `p`, `g` and `buffers` are the gathered lists; an update replaces them with new lists.
    `kernel` is the path the step takes (`modstate.optim._kernels`): ``"fused"``,
    ``"foreach"``, ``"single"`` or ``"differentiable"``; `ops` runs the elementwise operations
    in the form that path needs. `donated` says the caller donated params and state (honoured
    in eager form only); `own_p` / `own_buffers` say that those lists may be written over
    (donated, or fresh); `own_g` starts False and the update sets it once `g` is an
    intermediate of its own. `scalars` holds the 0-dim state entries other than the step
    counter (NAdam's ``mu_product``). `count` is this step's number, counting from 1: a float,
    or a 0-dim float64 tensor when it cannot be read for free (under `vmap`, `grad` or
    `torch.compile`); `step` is the new step counter of the state.
    """

    __slots__ = (
        "buffers",
        "count",
        "donated",
        "g",
        "groups",
        "hyper",
        "kernel",
        "layout",
        "once",
        "ops",
        "own_buffers",
        "own_g",
        "own_p",
        "p",
        "scalars",
        "step",
    )

    def __init__(
        self,
        kernel: str,
        ops: LeafOps,
        p: Leaves,
        g: Leaves,
        buffers: dict[str, Leaves],
        count: float | Tensor,
        hyper: dict[str, Any],
        scalars: dict[str, Tensor],
        donate: bool,
        step: Tensor,
        layout: list[tuple[int, ...]] | None = None,
        groups: list[list[int]] | None = None,
    ) -> None:
        self.kernel = kernel
        self.ops = ops
        self.p, self.g, self.buffers = p, g, buffers
        self.count = count
        self.hyper = hyper
        self.scalars = scalars
        self.donated = donate and ops.foreach
        self.own_p = self.own_buffers = self.donated
        self.own_g = False
        self.step = step
        # The params' strides where the buffers are known to share them (a repeated step).
        self.layout = layout
        # The leaves grouped by device and dtype (`device_groups`) where known (a repeated step).
        self.groups = groups
        self.once: dict[str, Any] = {}  # what a step computes once, shared by its chunks

    def chunk(self, start: int, stop: int) -> Run:
        """The same step on leaves ``start:stop`` (the update is elementwise, so running it chunk
        by chunk gives the same numbers); what it computes once is shared."""
        part = Run(
            self.kernel,
            self.ops,
            self.p[start:stop],
            self.g[start:stop],
            {name: leaves[start:stop] for name, leaves in self.buffers.items()},
            self.count,
            self.hyper,
            self.scalars,
            self.donated,
            self.step,
            None if self.layout is None else self.layout[start:stop],
        )
        part.once = self.once
        return part

    def join(self, parts: Sequence[Run]) -> None:
        """Take the updated leaves of `parts` (consecutive chunks of this step) back."""
        self.p = [leaf for part in parts for leaf in part.p]
        for name in self.buffers:
            self.buffers[name] = [leaf for part in parts for leaf in part.buffers[name]]

    @property
    def first(self) -> bool | Tensor:
        """Whether this is the first step (a 0-dim bool tensor when the count is one)."""
        return self.count == 1

    @property
    def multi_tensor(self) -> bool:
        """Whether the step follows torch.optim's multi-tensor (foreach) order of operations,
        which differs from the single-tensor order in a few optimizers."""
        return self.kernel == FOREACH

    def begin(self, maximize: bool, *, decoupled_weight_decay: bool = False) -> None:
        """The lines every torch.optim optimizer begins with: ``g = -g`` if `maximize`, then
        weight decay, either decoupled (``p = p * (1 - lr * weight_decay)``, AdamW) or as an
        L2 penalty (``g = g + weight_decay * p``)."""
        weight_decay = self.hyper["weight_decay"]
        if maximize:
            self.g, self.own_g = self.ops.neg(self.g), True
        if is_zero(weight_decay):
            return
        if decoupled_weight_decay:
            factor = 1 - self.hyper["lr"] * weight_decay
            self.p, self.own_p = self.ops.mul(self.p, factor, own=self.own_p), True
        else:
            self.g = self.ops.add(self.g, self.p, weight_decay, own=self.own_g)
            self.own_g = True

    def fused_groups(
        self, names: Sequence[str]
    ) -> Iterator[tuple[Leaves, Leaves, list[Leaves], list[Tensor]]]:
        """The leaves as torch's fused kernels take them: ``(params, grads, [one list per
        buffer in names], state_steps)`` per call, in place on lists the step owns.

        Leaves are grouped by device and dtype, as torch.optim groups them; ``state_steps``
        is this step's new counter (a float32 tensor on the group's device, what torch.optim's
        fused state holds after its increment), once per leaf. A donated step runs on the
        caller's buffers. A pure step must not write its inputs, so it copies params and
        buffers first (`p` and `buffers` then hold the copies); copying in cache-sized chunks
        just before the kernel reads them was measured no faster.
        """
        params, grads = self.p, self.g
        buffers = [self.buffers[name] for name in names]
        if not (self.own_p and self.own_buffers):
            params = [leaf.clone() for leaf in params]
            buffers = [[leaf.clone() for leaf in leaves] for leaves in buffers]
        grads = _aligned(params, grads, buffers, self.layout)
        for indices in self.groups or device_groups(params):
            step = self.step  # the new step counter: a float32 CPU tensor unless told otherwise
            first = params[indices[0]]
            if step.dtype != torch.float32 or not first.is_cpu:
                step = torch.full((), float(self.count), dtype=torch.float32, device=first.device)
            if len(indices) == len(params):
                yield params, grads, buffers, [step] * len(indices)
            else:
                yield (
                    [params[i] for i in indices],
                    [grads[i] for i in indices],
                    [[leaves[i] for i in indices] for leaves in buffers],
                    [step] * len(indices),
                )
        self.p, self.own_p = params, True
        self.buffers.update(zip(names, buffers, strict=True))
        self.own_buffers = True


def device_groups(params: Leaves) -> list[list[int]]:
    """The indices of `params` grouped by device and dtype, as torch.optim groups leaves for
    its fused kernels, groups in the order of their first leaf."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, param in enumerate(params):
        groups.setdefault((param.device, param.dtype), []).append(i)
    return list(groups.values())


def _aligned(
    params: Leaves,
    grads: Leaves,
    buffers: list[Leaves],
    layout: list[tuple[int, ...]] | None = None,
) -> Leaves:
    """Make every leaf's gradient and buffers share its param's memory layout, as the fused
    kernels need: they walk the three tensors' memory in step, and torch.optim's gradients
    always match their param's layout (autograd's gradient layout contract), where a gradient
    from ``torch.autograd.grad`` (a batched matmul's, say) may be a transposed view. A param
    that is not dense is replaced by a contiguous copy first. `layout`, when given, is the
    params' strides, which the buffers are known to share (a repeated donated step: the last
    step laid them out), so only the gradients are checked. Returns the grads (a new list
    where one was copied); params and buffers are updated in their lists."""
    strides = layout if layout is not None else [param.stride() for param in params]
    if [grad.stride() for grad in grads] == strides and (
        layout is not None
        or all([leaf.stride() for leaf in leaves] == strides for leaves in buffers)
    ):
        return grads  # the common case: every layout matches already
    aligned = grads
    for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
        stride = param.stride()
        if grad.stride() == stride and all(leaves[i].stride() == stride for leaves in buffers):
            continue
        if torch.empty_like(param).stride() != stride:  # not dense (a view with gaps)
            params[i] = param = param.contiguous()
            stride = param.stride()
        if aligned is grads:
            aligned = list(grads)
        aligned[i] = _laid_out_like(param, grad)
        for leaves in buffers:
            leaves[i] = _laid_out_like(param, leaves[i])
    return aligned


def _laid_out_like(param: Tensor, value: Tensor) -> Tensor:
    if value.stride() == param.stride():
        return value
    return torch.empty_like(param).copy_(value)
