"""Putting a tree's tensors into a module's slots, and taking them out again.

- ``prepare``: check a tree against a module and plan which slot gets which tensor (every check
  runs here, before anything changes);
- ``swaps``: the prepared swaps, applied and undone, for the calling thread only (calls) or for
  every thread (``inject``, ``swap``);
- ``unknown``: the error for a path that names no tensor (what is there instead);
- ``traced``: the same checks while ``torch.compile`` traces, where there is no anatomy;
- ``parts``: the `PartsReader`, the reading program a call and ``apply`` make once per
  structure of a tuple of trees such as ``(params, state)``, and its one cache.

May import: the base modules, ``trees``, ``sharded`` and ``module``.
"""
