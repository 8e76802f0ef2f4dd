"""Operations on pytrees of tensors: map, reshape, split, arithmetic, mean, selection, summary.

Every function takes any pytree (nested ``dict``/``list``/``tuple``/namedtuple, ``None`` as an
empty subtree) whose leaves are tensors, returns a new tree of the same structure, and never
mutates its input. Dicts keep their insertion order, and a ``dict``, an ``OrderedDict`` (what
``state_dict()`` returns) and a ``defaultdict`` are one kind of node: trees that must match do so
when their keys do. The leading ``batch_ndim`` dims of each leaf (default 1, the ensemble dim) are
its batch dims; the rest of each leaf is untouched.

>>> import torch, modstate as ms
>>> tree = {"layer": {"weight": torch.ones(4, 3, 2), "bias": torch.zeros(4, 3)}}
>>> ms.tree.reshape(tree, (2, 2))["layer"]["weight"].shape
torch.Size([2, 2, 3, 2])
>>> [t["layer"]["bias"].shape for t in ms.tree.unbind(tree)]
[torch.Size([3]), torch.Size([3]), torch.Size([3]), torch.Size([3])]

A tie stays a tie: one tensor at several places (``extract`` lists a tied weight at each of its
paths) gives one result at all of them, computed at its first place, so the result still fits
the model.

Errors read ``"tree.<function>: '<path>': <what>; <fix>"``, naming the dotted path of the
offending leaf (``'layer.bias'``); a refused call returns nothing and changes nothing.

Where things are (this package imports only ``modstate._core``):

- ``_map``: `map`, `map_with_path`;
- ``_shape``: `reshape`, `view`, `unbind`, `split` (the batch dims);
- ``_arithmetic``: `add`, `sub`, `mul`, `lerp`; ``_mean``: `mean` (model soups);
- ``_each``: `zeros_like`, `clone`, `detach`, `to` (one tensor op at each leaf);
- ``_partition``: `partition`, `combine`; ``_predicates``: `is_float`, `is_trainable`;
- ``_select``: `select`, `exclude` (globs on dotted paths); ``_summary``: `summary`;
- the machinery: ``_walk`` (the one recursion over any pytree), ``_fast`` (the fast path for
  plain nested dicts of tensors, what ``extract`` gives), ``_ties`` (a tie stays a tie),
  ``_errors`` (paths in errors, the message format).
"""

from __future__ import annotations

from modstate.tree._arithmetic import add, lerp, mul, sub
from modstate.tree._each import clone, detach, to, zeros_like
from modstate.tree._map import map, map_with_path
from modstate.tree._mean import mean
from modstate.tree._partition import combine, partition
from modstate.tree._predicates import is_float, is_trainable
from modstate.tree._select import exclude, select
from modstate.tree._shape import reshape, split, unbind, view
from modstate.tree._summary import TreeSummary, summary

__all__ = [
    "TreeSummary",
    "add",
    "clone",
    "combine",
    "detach",
    "exclude",
    "is_float",
    "is_trainable",
    "lerp",
    "map",
    "map_with_path",
    "mean",
    "mul",
    "partition",
    "reshape",
    "select",
    "split",
    "sub",
    "summary",
    "to",
    "unbind",
    "view",
    "zeros_like",
]
