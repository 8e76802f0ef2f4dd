"""The engine: where a module keeps its tensors, and how trees go in and out of it.

The pipeline, bottom up:

- ``anatomy``: the one place that knows where a module keeps its tensors (``_parameters``,
  ``_buffers``, ties, shared modules, lazy state), compiled once per module; ``tables``: the
  dicts it lays over ``_parameters`` / ``_buffers``, which a stateless call overlays for its own
  thread only;
- ``types``, ``flat``, ``leaves``: what a tree is, nested <-> dotted ``state_dict`` keys, and
  reading the trees (or tuples of trees) callers pass; ``torch_facts``: small facts about torch
  tensors (functorch wrappers, DTensor, write-back) stated once;
- ``sharded``: the machinery of FSDP2 / tensor-parallel modules; ``hooks``: the ``state_dict``
  bridge;
- ``prepare``: check a tree against a module and plan which slot gets which tensor (three
  routes; ``readers`` and ``parts`` read trees and tuples of trees by programs made once per
  structure), raising the ``errors``; ``swaps``: the prepared swaps, applied and undone, for the
  calling thread only (calls) or for every thread (``inject``, ``swap``);
- ``extract`` takes a tree out, ``split`` divides it into what is trained and what is carried;
  ``inject`` / ``swap`` / ``load`` (in ``inject``) put one in; ``call`` is the stateless call and
  ``apply`` the pure stateful one; ``grad`` differentiates a function of trees
  (``torch.func.grad``'s contract, plain autograd outside transforms).

This is the bottom part: it imports torch and optree only, never another part of modstate.
"""

from modstate._core.apply import apply
from modstate._core.call import call, call_partial
from modstate._core.extract import extract
from modstate._core.flat import flatten, unflatten
from modstate._core.grad import grad, grad_and_value
from modstate._core.inject import inject, load, swap
from modstate._core.split import split

__all__ = [
    "apply",
    "call",
    "call_partial",
    "extract",
    "flatten",
    "grad",
    "grad_and_value",
    "inject",
    "load",
    "split",
    "swap",
    "unflatten",
]
