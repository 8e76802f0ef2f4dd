"""Trees as data, with no module in sight.

- ``flat``: nested trees <-> ``state_dict``-style dotted keys, and walking a tree's leaves;
- ``nodes``: what is a node and what is a leaf of any pytree, and its leaves with their paths;
- ``leaves``: reading what callers pass (a tree, or a tuple of trees with None holes);
- ``readers``: programs, made once per tree structure, that read a tree's leaves in a fixed order;
- ``ties``: which leaves are one tensor, and keeping those ties through a tree operation.

May import: ``modstate._core``'s base modules (``errors``, ``types``, ``torch_facts``) only.
"""
