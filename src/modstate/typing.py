"""The types of modstate's public API, in one place, for annotating code that uses it.

>>> import torch
>>> from modstate.typing import Optimizer, Tree
>>> def sgd_step(params: Tree, grads: Tree, opt: Optimizer, state: dict) -> tuple[Tree, dict]:
...     return opt.step(params, grads, state)

- `Tree`: a nested ``dict`` mirroring a module tree (what ``modstate.extract`` returns).
- `TreeArg`: what ``call``, ``inject``, ``apply`` and ``load`` take: a tree, or several trees
  that together give the module's paths (a tuple or list of trees, None leaves being holes).
- `Optimizer`: what every optimizer of ``modstate.optim`` (and ``masked``'s result) is: ``init``
  and ``step``.

(This module is imported as ``modstate.typing``; ``from modstate import *`` does not bring it in,
so that it never shadows the standard library's ``typing``.)
"""

from __future__ import annotations

from modstate._core.types import Tree, TreeArg
from modstate.optim import Optimizer

__all__ = ["Optimizer", "Tree", "TreeArg"]
