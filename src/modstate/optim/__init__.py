"""Pure functional optimizers on trees, and any `torch.optim` optimizer's state as a tree.

Optax-style: an optimizer is a frozen description of its hyperparameters with two pure methods::

    opt = modstate.optim.adam(lr=1e-3)
    state = opt.init(params)
    params, state = opt.step(params, grads, state)

`params` is any pytree of tensors (typically ``modstate.extract(model, detach=True)``), `grads`
a tree of the same structure (``torch.func.grad`` returns one) in which a leaf may be None: that
leaf's param and state are returned unchanged (a frozen leaf). `state` is a plain dict: a 0-dim
``"step"`` counter tensor and one tree per buffer (``"exp_avg"``, ``"momentum_buffer"``, ...).

- Same numbers as `torch.optim.SGD` / `Adam` / `AdamW` with the same hyperparameters; the one
  difference is that the step counter is shared by all leaves, where torch counts per parameter
  (they differ only for a leaf whose gradient is sometimes None).
- Pure: no input tensor is written to. The step is recorded by autograd when its inputs require
  grad, so an unrolled inner loop can be differentiated (a learning rate that is a tensor with
  ``requires_grad`` gets a gradient; MAML). For plain training pass params that do not require
  grad, or step under ``torch.no_grad()``, so that no graph builds up across steps.
- Hyperparameters are numbers or 0-dim tensors on the params' device. The step counter is a
  0-dim float32 tensor on the CPU (like `torch.optim`'s default, so reading it costs no device
  sync), so `init` and `step` run under ``torch.vmap``: one optimizer per ensemble member, with
  per-member hyperparameters as stacked tensors (build the optimizer inside the vmapped
  function: ``vmap(lambda p, g, s, lr: adam(lr=lr).step(p, g, s))(params, grads, state, lrs)``).
- Fast: outside vmap / grad transforms and autograd recording, every operation is one
  ``torch._foreach_*`` kernel over all leaves, writing over the step's own intermediates where
  it can; otherwise one out-of-place op per leaf, with the same results.

`optimizer_state` and `load_optimizer_state` express the state of a stateful `torch.optim`
optimizer by parameter path, for checkpoints and tree transforms.
"""

from __future__ import annotations

from modstate.optim._adam import Adam
from modstate.optim._lists import Scalar
from modstate.optim._sgd import SGD
from modstate.optim._torch_state import load_optimizer_state, optimizer_state

__all__ = [
    "SGD",
    "Adam",
    "adam",
    "adamw",
    "load_optimizer_state",
    "optimizer_state",
    "sgd",
]


def sgd(
    lr: Scalar,
    momentum: Scalar = 0,
    dampening: Scalar = 0,
    nesterov: bool = False,
    weight_decay: Scalar = 0,
    maximize: bool = False,
) -> SGD:
    """Stochastic gradient descent, with `torch.optim.SGD`'s arguments and numbers.

    >>> opt = sgd(lr=0.1, momentum=0.9)
    >>> params = {"w": torch.ones(2)}
    >>> state = opt.init(params)
    >>> params, state = opt.step(params, {"w": torch.ones(2)}, state)
    >>> params["w"]
    tensor([0.9000, 0.9000])
    """
    return SGD(lr, momentum, dampening, nesterov, weight_decay, maximize)


def adam(
    lr: Scalar = 1e-3,
    betas: tuple[Scalar, Scalar] = (0.9, 0.999),
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0,
    amsgrad: bool = False,
    maximize: bool = False,
) -> Adam:
    """Adam, with `torch.optim.Adam`'s arguments and numbers (L2 penalty as `weight_decay`).

    >>> opt = adam(lr=0.1)
    >>> params = {"w": torch.zeros(2)}
    >>> params, state = opt.step(params, {"w": torch.tensor([1.0, -1.0])}, opt.init(params))
    >>> params["w"]
    tensor([-0.1000,  0.1000])
    """
    return Adam(lr, betas, eps, weight_decay, amsgrad, maximize, decoupled_weight_decay=False)


def adamw(
    lr: Scalar = 1e-3,
    betas: tuple[Scalar, Scalar] = (0.9, 0.999),
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
) -> Adam:
    """AdamW (decoupled weight decay), with `torch.optim.AdamW`'s arguments and numbers.

    >>> opt = adamw(lr=0.1, weight_decay=0.5)
    >>> params = {"w": torch.ones(1)}
    >>> params, state = opt.step(params, {"w": torch.ones(1)}, opt.init(params))
    >>> params["w"]  # 1 * (1 - 0.1 * 0.5) - 0.1
    tensor([0.8500])
    """
    return Adam(lr, betas, eps, weight_decay, amsgrad, maximize, decoupled_weight_decay=True)
