"""Ensembles: N models of one architecture as stacked trees, run at once under ``torch.vmap``.

``_stack`` stacks and unstacks trees, ``_vmap`` runs a module with every member of a stacked tree,
``_batched`` holds the batched kernels of the layers whose ensemble form is known, and
``_ensemble`` the ``Ensemble`` module that owns stacked state.

May import ``modstate._core`` and ``modstate.tree``; never ``optim``, ``checkpoint`` or ``cli``.
"""

from modstate.ensemble._ensemble import Ensemble
from modstate.ensemble._stack import stack, stack_modules, unstack
from modstate.ensemble._vmap import vmap_call

__all__ = ["Ensemble", "stack", "stack_modules", "unstack", "vmap_call"]
