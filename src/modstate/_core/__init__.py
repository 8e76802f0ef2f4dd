"""The engine: where a module keeps its tensors, and how trees go in and out of it.

``walk`` is the one place that knows module anatomy (``_parameters``, ``_buffers``, ties, shared
modules, lazy state); ``flat`` converts nested trees to dotted ``state_dict`` keys and back;
``extract`` takes a tree out, ``split`` divides it into what is trained and what is carried,
``inject`` swaps one in (and out again), ``hooks`` is the ``state_dict`` bridge, ``call`` the
stateless call and ``apply`` the pure stateful one.

This is the bottom part: it imports torch and optree only, never another part of modstate.
"""

from modstate._core.apply import apply
from modstate._core.call import call, call_partial
from modstate._core.extract import extract
from modstate._core.flat import flatten, unflatten
from modstate._core.inject import inject, load, swap
from modstate._core.split import split

__all__ = [
    "apply",
    "call",
    "call_partial",
    "extract",
    "flatten",
    "inject",
    "load",
    "split",
    "swap",
    "unflatten",
]
