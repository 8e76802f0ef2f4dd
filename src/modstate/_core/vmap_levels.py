"""The seam between ``torch.vmap`` and code that computes every member at once.

Inside a ``torch.vmap``, a function receives one member's view of each batched input: a
``BatchedTensor`` whose hidden dim ``bdim`` holds every member. Code that can do better than
vmap's per-operation rules takes the tensor inside (`members_of`), computes every member at once
with ordinary torch ops, and hands the result back as one member's view again
(`as_member_view`). While it computes, the vmap layer is set aside (`VmapSetAside`): its ops then
run as plain ops on plain tensors, recorded by autograd (or by an outer ``torch.func``
transform) as the ops they are, and random ops draw as written (vmap would otherwise batch them a
second time). The ensemble's batched kernels work this way, and so do ``ms.grad`` and
``ms.apply`` under a lone ``torch.vmap`` (`lone_vmap`).

This is what ``torch.autograd.Function``'s ``vmap`` staticmethod does; measured, going through it
costs about 250 µs a call against 6 µs here. The price is a few private functions of
``torch._C._functorch``; this module is the only one in modstate that calls them
(``tests/test_layers.py`` keeps it so), and it also serves the rest of modstate's needs of that
API: the tensor inside the transforms' wrappers (`unwrapped`, `wrapper_chain`), and the grad
levels that ``sharded/`` takes off and puts back around a DTensor (`grad_wrapped`,
`wrap_for_grad`, `grad_levels`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch._C._functorch import (
    TransformType,
    _add_batch_dim,
    _unwrap_batched,
    _wrap_for_grad,
    get_interpreter_stack,
    get_unwrapped,
    is_batchedtensor,
    is_functorch_wrapped_tensor,
    maybe_current_level,
    maybe_get_level,
    pop_dynamic_layer_stack,
    push_dynamic_layer_stack,
)
from torch.utils import _pytree as torch_pytree

__all__ = [
    "LoneVmap",
    "VmapSetAside",
    "as_member_view",
    "grad_levels",
    "grad_wrapped",
    "lone_vmap",
    "maps_members",
    "maybe_current_level",
    "members_of",
    "unwrapped",
    "vmap_tree_map",
    "wrap_for_grad",
    "wrapper_chain",
]


class LoneVmap(NamedTuple):
    """The one ``torch.vmap`` running: its level, its member count and its randomness."""

    level: int
    size: int
    randomness: str


def lone_vmap() -> LoneVmap | None:
    """The ``torch.vmap`` running when it is the only ``torch.func`` transform running (no
    ``grad`` inside or around it, no other vmap); None otherwise."""
    stack = get_interpreter_stack()
    if not stack or len(stack) != 1 or stack[0].key() != TransformType.Vmap:
        return None
    interpreter = stack[0]
    if _VmapPointer is None:  # where a torch release moved it: the Python wrapper says the same
        from torch._functorch.pyfunctorch import coerce_cinterpreter

        python: Any = coerce_cinterpreter(interpreter)
        return LoneVmap(python.level(), python.batch_size(), python.randomness())
    vmap = _VmapPointer(interpreter)  # read directly: 2 µs against 12 through the wrapper
    return LoneVmap(interpreter.level(), vmap.batchSize(), _RANDOMNESS[vmap.randomness().name])


_VmapPointer: Any = getattr(torch._C._functorch, "CVmapInterpreterPtr", None)


def unwrapped(tensor: Tensor) -> Tensor:
    """The tensor inside every ``torch.func`` wrapper (``grad``, ``vmap``) around ``tensor``."""
    while is_functorch_wrapped_tensor(tensor):
        tensor = get_unwrapped(tensor)
    return tensor


def wrapper_chain(tensor: Tensor) -> Iterator[Tensor]:
    """``tensor``, then each tensor inside its ``torch.func`` wrappers, outermost first (a
    wrapper reports ``requires_grad`` for its own level only)."""
    yield tensor
    while is_functorch_wrapped_tensor(tensor):
        tensor = get_unwrapped(tensor)
        yield tensor


def grad_levels() -> int:
    """How many ``torch.func`` transforms that differentiate (grad, vjp, jvp) are running."""
    kinds = (TransformType.Grad, TransformType.Jvp)
    return sum(interpreter.key() in kinds for interpreter in get_interpreter_stack() or ())


def grad_wrapped(tensor: Tensor) -> tuple[Tensor, list[int]] | None:
    """``(inner, levels)``: the tensor inside the ``torch.func.grad`` wrappers around ``tensor``
    and their levels, outermost first; None when a ``vmap`` wrapper is among them."""
    *wrappers, inner = wrapper_chain(tensor)
    if any(is_batchedtensor(wrapper) for wrapper in wrappers):
        return None
    return inner, [maybe_get_level(wrapper) for wrapper in wrappers]


def wrap_for_grad(tensor: Tensor, levels: list[int]) -> Tensor:
    """``tensor`` wrapped again at each grad level of ``levels`` (outermost first, as
    `grad_wrapped` gives them), innermost first."""
    for level in reversed(levels):
        tensor = _wrap_for_grad(tensor, level)
    return tensor


_RANDOMNESS = {"Error": "error", "Same": "same", "Different": "different"}


def members_of(value: Any, level: int) -> tuple[Any, int | None]:
    """``(tensor, bdim)``: the tensor holding every member of ``value`` and the dim that counts
    the members, or ``(value, None)`` when ``value`` is the same for every member (not batched at
    ``level``: a shared input, a constant)."""
    if not isinstance(value, Tensor):
        return value, None
    tensor, bdim = _unwrap_batched(value, level)
    return tensor, bdim


def vmap_tree_map(function: Callable[[Tensor], Tensor], value: Any) -> Any:
    """``function`` applied to every tensor of ``value``, walked as ``torch.vmap`` walks its inputs
    and outputs: torch's own pytrees, where Hugging Face registers its ``ModelOutput``. Plain
    dicts, lists and tuples (a tree of state, most outputs) are walked here, which is several
    times faster; any other node is torch's to walk."""
    kind = type(value)
    if kind is Tensor or isinstance(value, Tensor):
        return function(value)
    if kind is dict:
        return {key: vmap_tree_map(function, item) for key, item in value.items()}
    if kind is list or kind is tuple:
        return kind(vmap_tree_map(function, item) for item in value)
    if value is None or kind in (bool, int, float, str):
        return value
    return torch_pytree.tree_map_only(Tensor, function, value)


def maps_members(value: Any, level: int) -> bool:
    """Whether a tensor inside ``value`` (walked as `vmap_tree_map` walks it) is batched at
    ``level``."""
    return any(
        isinstance(leaf, Tensor) and members_of(leaf, level)[1] is not None
        for leaf in torch_pytree.tree_leaves(value)
    )


def as_member_view(tensor: Tensor, bdim: int, level: int) -> Tensor:
    """One member's view of ``tensor``, whose dim ``bdim`` counts the members."""
    return _add_batch_dim(tensor, bdim, level)


class VmapSetAside:
    """``with VmapSetAside():`` runs the code inside one transform level lower: plain ops on
    plain tensors, as a ``torch.autograd.Function``'s ``vmap`` rule runs. (A class rather than a
    generator: it is entered once per layer per call.)"""

    __slots__ = ("layer",)

    def __enter__(self) -> None:
        self.layer = pop_dynamic_layer_stack()

    def __exit__(self, *exc: object) -> None:
        push_dynamic_layer_stack(self.layer)
