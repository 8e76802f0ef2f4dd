"""Ensembles: N models of one architecture as stacked trees, run at once.

``_stack`` stacks and unstacks trees; ``_vmap`` runs a module with every member of a stacked
tree under ``torch.vmap`` (`StackedCall`); ``_ensemble`` holds the ``Ensemble`` module that owns
stacked state; ``_kept`` keeps an ``Ensemble`` per module for trees given at call time, which
``_vmap_call`` (``vmap_call``) and ``_members_apply`` (``modstate.apply`` under a lone
``torch.vmap``) run. How an ``Ensemble`` runs: ``_plan`` decides each layer's route, ``_kernels/``
holds the batched kernels (one file per family of layers), ``_functorch`` is the seam where a
kernel meets ``torch.vmap``, ``_runner`` runs the model's own forward under vmap with the
kernels in place, and ``_chain`` runs a plain ``Sequential`` of kernels without vmap.
``_update_bn`` recomputes BatchNorm statistics for averaged weights (``modstate.update_bn``, on
``_members_apply``'s ``apply``). ``_stacked_state`` registers the stacked tensors on a mirror of
the model, ``_factory`` builds members for ``Ensemble.from_factory`` (seeds, one member at a
time), and ``_sharded`` spreads the members over the ranks of a device mesh.

May import ``modstate._core`` and ``modstate.tree``; never ``optim``, ``checkpoint`` or ``cli``.
"""

from modstate.ensemble._ensemble import Ensemble
from modstate.ensemble._stack import stack, stack_modules, unstack
from modstate.ensemble._vmap_call import vmap_call

__all__ = ["Ensemble", "stack", "stack_modules", "unstack", "vmap_call"]
