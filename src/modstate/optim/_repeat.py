"""`Repeat`: what a step found out, kept for the next step of the same loop.

In an ordinary training loop, ``params, state = opt.step(params, grads, state, donate=True)``
hands every step the very tensors the last step wrote in place; a pure loop
(``params, state = opt.step(params, grads, state)``) hands it the very tensors the last step
returned. Most of a step's bookkeeping (walking the trees, deciding the kernel, looking for ties
and complex leaves) then finds what it found last time, and on a small model it costs as much as
the kernel itself. An eager step remembers its analysis here, with the ids of the trees it
returned; the next call reuses it once it has checked, cheaply, that the trees are those (the
same structure, the same tensor objects by ``id``, with the same shapes, dtypes, layouts and
devices), that the gradients fit, and that nothing requires grad. Anything else takes the full
path, which checks everything and names what does not fit. Only ids are kept (no reference to a
tensor); a reused id is harmless, since every fact the analysis depends on is checked again.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from itertools import chain
from typing import Any, NamedTuple

import torch
from torch import Tensor

from modstate._core.torch_facts import functorch_active
from modstate.optim._kernels import FOREACH, FUSED
from modstate.optim._lists import LeafOps
from modstate.optim._run import Run, device_groups, one


class Returned(NamedTuple):
    """What a step returned: the params and each buffer's leaves (name -> leaves), in the order
    of the trees' leaves, the step counter, and the other 0-dim state (name -> tensor)."""

    params: list[Tensor]
    buffers: Mapping[str, list[Tensor]]
    step: Tensor
    scalars: Mapping[str, Tensor]


class Repeat:
    """The analysis of one eager step, and the ids of the trees it returned: the params and
    buffers it wrote in place (`donated`), or the new ones it made (a pure step)."""

    __slots__ = (
        "buffer_names",
        "devices",
        "donated",
        "groups",
        "hyper",
        "ids",
        "kernel",
        "keys",
        "layouts",
        "ops",
        "scalar_ids",
        "scalar_names",
        "shapes",
        "step_id",
        "strides",
        "treedef",
    )

    def __init__(
        self, treedef: Any, returned: Returned, kernel: str, hyper: dict[str, Any], *, donated: bool
    ) -> None:
        """`returned` is what the step returned (its inputs, written in place, when `donated`),
        the leaves in the order of `treedef`'s."""
        params, buffers = returned.params, returned.buffers
        self.treedef = treedef
        self.buffer_names = tuple(buffers)
        self.scalar_names = tuple(returned.scalars)
        self.keys = {"step", *returned.scalars, *buffers}
        self._hold(returned)
        # What the gradients, params and buffers (in that order) must be: the params' shapes
        # and dtypes; the params' layouts (the buffers' too, for a fused kernel) and devices.
        self.shapes = list(map(_shape_and_dtype, params)) * (2 + len(buffers))
        self.strides = list(map(_stride, params))
        self.layouts = self.strides * (1 + len(buffers) if kernel == FUSED else 1)
        self.devices = list(map(_device, params))
        # A fused kernel's calls: the leaves by device and dtype (both checked by `again`).
        self.groups = device_groups(params) if kernel == FUSED else None
        self.kernel, self.hyper, self.donated = kernel, hyper, donated
        self.ops = LeafOps(foreach=True, multi_tensor=kernel == FOREACH)

    def _hold(self, returned: Returned) -> None:
        self.ids = list(map(id, chain(returned.params, *returned.buffers.values())))
        self.step_id = id(returned.step)
        self.scalar_ids = [id(returned.scalars[name]) for name in self.scalar_names]

    def renewed(self, returned: Returned) -> Repeat | None:
        """This analysis for the new trees that a pure step made from the trees it was for;
        None if two of them are one tensor. The new trees are expected to keep the old ones'
        layouts (a step that changed them fails the next call's checks: the full path then)."""
        renewed = Repeat.__new__(Repeat)
        for name in Repeat.__slots__:
            setattr(renewed, name, getattr(self, name))
        renewed._hold(returned)
        return renewed if renewed.distinct else None

    def holds(self, params: list[Tensor], buffers: Mapping[str, list[Tensor]]) -> bool:
        """Whether `params` and `buffers` are the very tensors this analysis is for (a donated
        step that wrote everything in place returns its inputs)."""
        return list(map(id, chain(params, *buffers.values()))) == self.ids

    @property
    def distinct(self) -> bool:
        """Whether no tensor stands twice among the params and buffers (a tie, which the next
        step must see through the full path)."""
        return len(set(self.ids)) == len(self.ids)


_requires_grad = operator.attrgetter("requires_grad")
_shape_and_dtype = operator.attrgetter("shape", "dtype")
_stride = operator.methodcaller("stride")
_device = operator.attrgetter("device")


def again(repeat: Repeat, params: Any, grads: Any, state: Any) -> Run | None:
    """The next step's `Run`, built from `repeat`, when the trees are those the last step
    returned and nothing else changed; None otherwise (take the full path)."""
    if not (type(state) is dict or isinstance(state, Mapping)) or state.keys() != repeat.keys:
        return None
    step = state["step"]
    scalar_names = repeat.scalar_names
    if id(step) != repeat.step_id or [id(state[n]) for n in scalar_names] != repeat.scalar_ids:
        return None
    treedef = repeat.treedef
    try:
        # Up to the remembered structure: a tree shaped otherwise fails here, or puts a
        # subtree or None where a tensor stood, whose id differs from the tensor's.
        params_leaves: list[Any] = treedef.flatten_up_to(params)
        buffers: dict[str, list[Any]] = {
            name: treedef.flatten_up_to(state[name]) for name in repeat.buffer_names
        }
        grad_leaves: list[Any] = treedef.flatten_up_to(grads)
    except (ValueError, TypeError):
        return None
    held = list(chain(params_leaves, *buffers.values()))
    if list(map(id, held)) != repeat.ids:
        return None
    tensors = grad_leaves + held
    try:
        # A remembered id now held by another object, or a tensor reshaped in place
        # (``.data = ...``), shows here.
        if list(map(_shape_and_dtype, tensors)) != repeat.shapes:
            return None
        # The fused kernels walk a param and its buffers in step: their layouts must agree.
        laid_out = held if repeat.kernel == FUSED else params_leaves
        if list(map(_stride, laid_out)) != repeat.layouts:
            return None
        if list(map(_device, params_leaves)) != repeat.devices:
            return None
    except AttributeError:  # a None gradient (a frozen leaf), or not a tensor
        return None
    if functorch_active():
        return None
    if torch.is_grad_enabled() and (step.requires_grad or any(map(_requires_grad, tensors))):
        return None
    if torch.compiler.is_compiling():
        return None
    count = step.item()
    new_step = step.add_(one()) if repeat.donated else step + one()
    return Run(
        repeat.kernel,
        repeat.ops,
        params_leaves,
        grad_leaves,
        buffers,
        count + 1,
        repeat.hyper,
        {name: state[name] for name in scalar_names},
        repeat.donated,
        new_step,
        repeat.strides,
        repeat.groups,
    )
