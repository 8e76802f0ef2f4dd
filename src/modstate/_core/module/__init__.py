"""Where a module keeps its tensors.

- ``anatomy``: the one place that knows a module's slots (``_parameters``, ``_buffers``, ties,
  shared submodules, lazy and sharded state), compiled once per module and cached;
- ``tables``: the slot tables laid over ``_parameters`` / ``_buffers``, which a stateless call
  overlays for its own thread only;
- ``state_dict``: the bridge to a module's own ``state_dict`` / ``load_state_dict`` hooks.

May import: the base modules, ``trees`` and ``sharded``.
"""
