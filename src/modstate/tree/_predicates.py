"""`is_float` and `is_trainable`: the leaf predicates a training loop partitions a tree by.

One rule, shared with ``modstate.split`` and the optimizers: a tensor takes part in
differentiation, averaging and training when its dtype is floating-point or complex (the dtypes
autograd can differentiate, and the only ones a tensor may set ``requires_grad`` on).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from modstate._core.torch_facts import is_trainable as trainable


def is_float(leaf: Any) -> bool:
    """Whether ``leaf`` is a floating-point or complex tensor.

    These are the dtypes autograd differentiates (``torch.func.grad`` takes them), that
    [`lerp`][modstate.tree.lerp] averages and that the optimizers step; BatchNorm's integer
    ``num_batches_tracked`` is not one of them.

    Args:
        leaf: Any leaf of a tree.

    Returns:
        True for a tensor of a floating-point or complex dtype, False for anything else.

    Example:
        >>> ms.tree.is_float(torch.zeros(2)), ms.tree.is_float(torch.zeros(2, dtype=torch.cfloat))
        (True, True)
        >>> ms.tree.is_float(torch.tensor(3)), ms.tree.is_float("text")
        (False, False)
    """
    return isinstance(leaf, Tensor) and (leaf.is_floating_point() or leaf.is_complex())


def is_trainable(leaf: Any) -> bool:
    """Whether ``leaf`` is a tensor that requires grad: a trainable parameter.

    Only floating-point and complex tensors can require grad, so every trainable leaf is also
    [`is_float`][modstate.tree.is_float]; ``modstate.split`` puts exactly these leaves in its
    trained half.

    Args:
        leaf: Any leaf of a tree.

    Returns:
        True for a floating-point or complex tensor with ``requires_grad`` set.

    Example:
        >>> ms.tree.is_trainable(torch.nn.Parameter(torch.zeros(2)))
        True
        >>> ms.tree.is_trainable(torch.zeros(2)), ms.tree.is_trainable(torch.tensor(3))
        (False, False)
    """
    return trainable(leaf)  # modstate.split's rule, stated once in _core
