"""Differentiating a function of trees: ``grad`` and ``grad_and_value``.

- ``routes``: the public functions, and the choice between plain autograd (outside a
  ``torch.func`` transform) and ``torch.func`` (inside one);
- ``arguments``: the differentiated leaves of the arguments, their ties, and the gradients
  rebuilt as trees;
- ``members``: the route for a function called per member inside ``vmap``.

May import: the base modules and ``trees``.
"""
