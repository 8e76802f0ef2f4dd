"""Which vmap level is an ensemble's own: the seam to ``torch.vmap`` itself
(`modstate._core.vmap_levels`), plus the level of the ensemble's forward running now.

The ensemble's own vmap level is kept in a context variable for the duration of its forward
(`ensemble_level`), so that a kernel knows which batch dim is the member dim and a layer
run outside an ensemble's forward is recognized as such. Context variables are per thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from modstate._core.vmap_levels import (
    VmapSetAside,
    as_member_view,
    maybe_current_level,
    members_of,
)

__all__ = [
    "VmapSetAside",
    "as_member_view",
    "ensemble_level",
    "maybe_current_level",
    "members_of",
    "running",
]

_RUNNING: ContextVar[tuple[object, int] | None] = ContextVar("modstate_ensemble", default=None)


@contextlib.contextmanager
def running(owner: object) -> Iterator[int]:
    """Marks the code inside as ``owner``'s forward, at the vmap level running now (the
    ensemble's own ``torch.vmap``, entered just outside); yields that level."""
    level = maybe_current_level()
    assert level is not None, "running() is entered inside the ensemble's torch.vmap"
    token = _RUNNING.set((owner, level))
    try:
        yield level
    finally:
        _RUNNING.reset(token)


def ensemble_level(owner: object) -> int | None:
    """The vmap level of ``owner``'s forward when a kernel of ``owner`` runs inside it (and no
    other transform was entered since); None otherwise."""
    active = _RUNNING.get()
    if active is None or active[0] is not owner or maybe_current_level() != active[1]:
        return None
    return active[1]
