"""FSDP2 and tensor-parallel modules: what is different when a module's tensors are DTensors.

- ``gathers``: gathering a sharded tensor for a call, and the local piece of one;
- ``units``: FSDP2's units (its ``FSDPParamGroup``) and what a call does with them;
- ``sharding``: what one module's sharding means for a swap (what may be swapped or loaded).

A reader working on the plain call path can skip this folder: for a module with no DTensor the
anatomy's ``sharding`` is None and nothing here runs.

May import: the base modules only.
"""
