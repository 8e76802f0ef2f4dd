"""The peak of the tensor memory one run makes: what the route choice weighs beside time.

CPU allocators keep no statistics torch exposes (CUDA's peak counter is global: resetting it
would change what a user reads), and ``torch.profiler`` is one per process. So a
``TorchDispatchMode``, which is this thread's own, counts every storage an op makes (an output
that aliases none of the op's inputs) and a weak reference tells when it is freed: a storage's
Python object lives as long as the storage itself, also where only autograd's saved tensors hold
it, so the count follows what autograd keeps for the backward. The mode slows every op by a
Python call, so the route choice runs it in a pass of its own, apart from the timed ones.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class PeakBytes(TorchDispatchMode):
    """While active, counts the bytes of the tensor storages made on this thread; ``peak`` is
    the most of them alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.peak = 0
        # a made storage's address -> (bytes, a weak reference that calls back when it is freed)
        self._alive: dict[int, tuple[int, weakref.ref]] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs: set[int] | None = None
        for leaf in pytree.tree_leaves(out):
            made = _storage(leaf)
            if made is None or made.data_ptr() in self._alive:
                continue
            if inputs is None:  # views and in-place ops return an input's storage
                held = map(_storage, pytree.tree_leaves((args, kwargs)))
                inputs = {storage.data_ptr() for storage in held if storage is not None}
            if made.data_ptr() not in inputs:
                self._add(made)
        return out

    def _add(self, storage: torch.UntypedStorage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        self._alive[key] = (size, weakref.ref(storage, partial(self._freed, key)))
        self.now += size
        self.peak = max(self.peak, self.now)

    def _freed(self, key: int, _: weakref.ref) -> None:
        size, _ = self._alive.pop(key)
        self.now -= size


def _storage(leaf: object) -> torch.UntypedStorage | None:
    """The storage of a dense tensor that holds memory, else None (sparse, meta, empty)."""
    if not isinstance(leaf, Tensor) or leaf.layout != torch.strided or leaf.is_meta:
        return None
    storage = leaf.untyped_storage()
    return storage if storage.nbytes() and storage.data_ptr() else None


def peak_bytes(run: Callable[[], Any]) -> int | None:
    """The peak of the tensor bytes ``run()`` makes and holds at once (its result dropped at
    the end), or None where it cannot be counted: under another dispatch mode (a fake or
    counting mode the caller set, which would see this one's tensors)."""
    if torch._C._len_torch_dispatch_stack() > 0:
        return None
    with PeakBytes() as counter:
        run()
    return counter.peak


def held_bytes(tensors: list[Tensor]) -> int:
    """The bytes of the distinct storages behind ``tensors``."""
    storages = {s.data_ptr(): s.nbytes() for s in map(_storage, tensors) if s is not None}
    return sum(storages.values())
