"""The engine: where a module keeps its tensors, and how trees go in and out of it.

A map, not a face: the public names are re-exported by ``modstate/__init__.py`` from the modules
that define them. Bottom up (each level imports only the levels below it; ``tests/test_layers.py``
keeps the rule):

- base: ``errors`` (the one error format), ``types`` (what a tree is), ``torch_facts`` (small
  facts about torch tensors stated once), ``vmap_levels`` (torch's functorch interpreter stack:
  which ``vmap`` levels are running, a tensor's member view);
- ``trees/``: trees as data, with no module in sight: nested <-> dotted keys, reading the trees
  (or tuples of trees) callers pass, ties between leaves;
- ``sharded/``: FSDP2 / tensor-parallel modules (gathers, units, the sharding of one module). A
  reader working on plain modules can skip it;
- ``module/``: where a module keeps its tensors (the anatomy, compiled once per module), the slot
  tables a stateless call overlays for its own thread, and the ``state_dict`` bridge;
- ``swap/``: checking a tree against a module and planning which slot gets which tensor
  (``prepare``), the swaps applied and undone (``swaps``), and the reading programs made once per
  tree structure;
- ``grad/``: differentiating a function of trees (``torch.func.grad``'s contract, plain autograd
  outside transforms);
- the verbs, at the top: ``extract``, ``split``, ``call`` (``call``, ``call_partial``), ``apply``,
  ``inject`` (``inject``, ``swap``) and ``load``.

This is the bottom part of modstate: it imports torch and optree only, never another part.
"""
