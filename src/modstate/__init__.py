"""modstate: a PyTorch model's state as a JAX-style pytree.

>>> import torch, modstate as ms
>>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
>>> tree = ms.extract(model)                 # {"0": {"weight": ..., "bias": ...}, "2": {...}}
>>> ms.flatten(tree).keys() == model.state_dict().keys()  # and the non-persistent buffers
True
>>> out = ms.call(model, ms.extract(model, detach=True), torch.randn(2, 3))
"""

from modstate import checkpoint, optim, tree
from modstate._core.call import call, call_partial
from modstate._core.extract import extract
from modstate._core.grad.routes import grad, grad_and_value
from modstate._core.inject import inject, swap
from modstate._core.load import load
from modstate._core.split import split
from modstate._core.trees.flat import flatten, unflatten
from modstate.ensemble import Ensemble, stack, stack_modules, unstack, vmap_call
from modstate.ensemble._members_apply import apply
from modstate.ensemble._update_bn import update_bn

__version__ = "0.2.0"

__all__ = [
    "Ensemble",
    "__version__",
    "apply",
    "call",
    "call_partial",
    "checkpoint",
    "extract",
    "flatten",
    "grad",
    "grad_and_value",
    "inject",
    "load",
    "optim",
    "split",
    "stack",
    "stack_modules",
    "swap",
    "tree",
    "unflatten",
    "unstack",
    "update_bn",
    "vmap_call",
]
