"""``nn.Dropout`` for every member, with masks that do not depend on the route.

``F.dropout`` draws its mask in the memory order of its input, and the ensemble's routes lay the
members' activations out differently (features first in a chain of Linear layers, members
folded into the channels by a grouped convolution, the layout ``torch.vmap``'s own rules pick
under ``fast=False``): the same random state would give other masks on each route. Here the
mask is always the one ``F.dropout`` draws on the CPU for activations laid out members first
and contiguous, ``(members, *member's shape)`` (with ``randomness="same"``, one member's shape),
on any device, and it is applied to the activations in whatever layout they are. So the masks depend only on the random
state and the member: ``fast=True`` and ``fast=False``, a chain and the runner, give the same.
"""

from __future__ import annotations

from torch import Tensor, nn

from .base import KernelContext


def dropout_members(
    x: Tensor, bdim: int | None, count: int, p: float, randomness: str
) -> tuple[Tensor, int | None]:
    """``x`` (the members along ``bdim``; None: one input for all) through dropout in training
    mode, ``randomness`` ``"different"`` or ``"same"``, with the masks of the module docstring.

    Values and gradients are those of ``F.dropout`` on that layout: ``x * noise``, ``noise``
    drawn as ``F.dropout`` draws it on the CPU (``bernoulli_(1 - p)``, scaled by
    ``1 / (1 - p)``; zeros and no draw for ``p == 1``).
    """
    if randomness == "same":
        shape = x.shape if bdim is None else x.shape[:bdim] + x.shape[bdim + 1 :]
        noise = _noise(x, shape, p)
        return x * (noise if bdim is None else noise.unsqueeze(bdim)), bdim
    if bdim is None:
        x, bdim = x.expand(count, *x.shape), 0
    noise = _noise(x, (count, *x.shape[:bdim], *x.shape[bdim + 1 :]), p)
    return x * noise.movedim(0, bdim), bdim


def _noise(x: Tensor, shape: tuple[int, ...], p: float) -> Tensor:
    """A contiguous tensor of ``shape`` (like ``x``) holding 0 or ``1 / (1 - p)``."""
    if p == 1:
        return x.new_zeros(shape)
    return x.new_empty(shape).bernoulli_(1 - p).div_(1 - p)


class DropoutKernel:
    """An ``nn.Dropout`` layer in the runner, on every route (``fast=False`` too, so that its
    masks are the chain's). In eval mode, with ``p == 0`` or with ``randomness="error"`` it
    declines, and the layer's own forward runs under vmap (which refuses a random op in that
    mode). ``inplace=True`` is computed out of place: the result is what the layer returns."""

    fresh = False

    def __init__(self, module: nn.Dropout, context: KernelContext) -> None:
        self.module = module  # read at call time: its training flag
        self.count = context.count
        self.randomness = context.randomness
        self.route = f"dropout, randomness={context.randomness!r} (masks drawn members first)"

    def __call__(self, x: Tensor, bdim: int | None) -> tuple[Tensor, int] | None:
        p = self.module.p
        if not self.module.training or p == 0 or self.randomness == "error":
            return None
        if bdim is None:  # one input for all: every member gets its own row of the output
            x, bdim = x.expand(self.count, *x.shape), 0
        out, out_bdim = dropout_members(x, bdim, self.count, p, self.randomness)
        assert out_bdim is not None
        return out, out_bdim
