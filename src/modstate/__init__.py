"""modstate: a PyTorch model's state as a JAX-style pytree.

>>> import torch, modstate as ms
>>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
>>> tree = ms.extract(model)                 # {"0": {"weight": ..., "bias": ...}, "2": {...}}
>>> ms.flatten(tree).keys() == model.state_dict().keys()
True
>>> out = ms.call(model, ms.extract(model, detach=True), torch.randn(2, 3))
"""

from . import checkpoint, optim, tree
from ._call import call
from ._ensemble import Ensemble
from ._extract import extract
from ._flat import flatten, unflatten
from ._inject import inject, load, swap
from ._stack import stack, stack_modules, unstack
from ._vmap import vmap_call

__version__ = "0.1.0"

__all__ = [
    "Ensemble",
    "__version__",
    "call",
    "checkpoint",
    "extract",
    "flatten",
    "inject",
    "load",
    "optim",
    "stack",
    "stack_modules",
    "swap",
    "tree",
    "unflatten",
    "unstack",
    "vmap_call",
]
