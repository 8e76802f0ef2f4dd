"""Pure functional optimizers on trees, and any `torch.optim` optimizer's state as a tree.

Optax-style: an optimizer is a frozen description of its hyperparameters with two pure methods::

    opt = modstate.optim.adam(lr=1e-3)
    state = opt.init(params)
    params, state = opt.step(params, grads, state)

`params` is any pytree of tensors (typically ``modstate.extract(model, detach=True)``), `grads`
a tree of the same structure (``torch.func.grad`` returns one) in which a leaf may be None: that
leaf's param and state are returned unchanged (a frozen leaf). `state` is a plain dict: a 0-dim
``"step"`` counter tensor and one tree per buffer (``"exp_avg"``, ``"momentum_buffer"``, ...).

- `sgd`, `adam`, `adamw`, `rmsprop`, `adagrad`, `adamax`, `nadam`, `radam`, `adadelta`, with
  `torch.optim`'s argument names and defaults, and its numbers bit for bit (`torch.equal` after
  every step with `torch.optim` on the CPU, whose default is its single-tensor path). The one
  difference: the step counter is shared by all leaves, where torch counts per parameter (they
  differ only for a leaf whose gradient is sometimes None).
- A tied weight (one tensor at several paths of `params`, as ``extract`` lists it) is stepped
  once, with the gradient at its first path in module order (where ``torch.func`` puts it), and
  the new tensor stands at all its paths.
- `lr` may be a schedule from `modstate.optim.schedules` (a function of the step count);
  `clip_grad_norm` clips a gradient tree; `masked` steps only the leaves whose path matches.
- ``step(..., donate=True)`` may write its results over the buffers of `params` and `state`
  (the caller promises not to read them again), as `torch.optim` does: same numbers, less memory
  traffic.
- Pure: no input tensor is written to. The step is recorded by autograd when its inputs require
  grad, so an unrolled inner loop can be differentiated (a learning rate that is a tensor with
  ``requires_grad`` gets a gradient; MAML). For plain training pass params that do not require
  grad, or step under ``torch.no_grad()``, so that no graph builds up across steps.
- Hyperparameters are numbers or 0-dim tensors on the params' device. The step counter is a
  0-dim float32 tensor on the CPU (like `torch.optim`'s default, so reading it costs no device
  sync), so `init` and `step` run under ``torch.vmap``: one optimizer per ensemble member, with
  per-member hyperparameters as stacked tensors (build the optimizer inside the vmapped
  function: ``vmap(lambda p, g, s, lr: adam(lr=lr).step(p, g, s))(params, grads, state, lrs)``).
  Meta-gradients are finite everywhere: the square roots of the adaptive optimizers have
  gradient 0 at an exact 0 (where ``sqrt``'s is infinite) and their forward value unchanged.
- Fast: outside vmap / grad transforms and autograd recording, every operation is one
  ``torch._foreach_*`` kernel over all leaves, writing over the step's own intermediates where
  it can; otherwise one out-of-place op per leaf, with the same results.

`optimizer_state` and `load_optimizer_state` express the state of a stateful `torch.optim`
optimizer by parameter path, for checkpoints and tree transforms.
"""

from __future__ import annotations

from modstate.optim import schedules
from modstate.optim._adadelta import Adadelta
from modstate.optim._adagrad import Adagrad
from modstate.optim._adam import Adam
from modstate.optim._adamax import Adamax
from modstate.optim._base import LearningRate, Optimizer
from modstate.optim._clip import clip_grad_norm
from modstate.optim._lists import Scalar
from modstate.optim._masked import Masked, masked
from modstate.optim._nadam import NAdam
from modstate.optim._radam import RAdam
from modstate.optim._rmsprop import RMSprop
from modstate.optim._sgd import SGD
from modstate.optim._torch_state import load_optimizer_state, optimizer_state

__all__ = [
    "SGD",
    "Adadelta",
    "Adagrad",
    "Adam",
    "Adamax",
    "Masked",
    "NAdam",
    "Optimizer",
    "RAdam",
    "RMSprop",
    "adadelta",
    "adagrad",
    "adam",
    "adamax",
    "adamw",
    "clip_grad_norm",
    "load_optimizer_state",
    "masked",
    "nadam",
    "optimizer_state",
    "radam",
    "rmsprop",
    "schedules",
    "sgd",
]

Betas = tuple[Scalar, Scalar]


def sgd(
    lr: LearningRate = 1e-3,
    momentum: Scalar = 0,
    dampening: Scalar = 0,
    weight_decay: Scalar = 0,
    nesterov: bool = False,
    *,
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
    return SGD(lr, momentum, dampening, weight_decay, nesterov, maximize)


def adam(
    lr: LearningRate = 1e-3,
    betas: Betas = (0.9, 0.999),
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    decoupled_weight_decay: bool = False,
) -> Adam:
    """Adam, with `torch.optim.Adam`'s arguments and numbers (L2 penalty as `weight_decay`).

    >>> opt = adam(lr=0.1)
    >>> params = {"w": torch.zeros(2)}
    >>> params, state = opt.step(params, {"w": torch.tensor([1.0, -1.0])}, opt.init(params))
    >>> params["w"]
    tensor([-0.1000,  0.1000])
    """
    return Adam(lr, betas, eps, weight_decay, amsgrad, maximize, decoupled_weight_decay)


def adamw(
    lr: LearningRate = 1e-3,
    betas: Betas = (0.9, 0.999),
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 1e-2,
    amsgrad: bool = False,
    *,
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


def rmsprop(
    lr: LearningRate = 1e-2,
    alpha: Scalar = 0.99,
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0,
    momentum: Scalar = 0,
    centered: bool = False,
    *,
    maximize: bool = False,
) -> RMSprop:
    """RMSprop, with `torch.optim.RMSprop`'s arguments and numbers.

    >>> opt = rmsprop(lr=0.01)
    >>> params = {"w": torch.zeros(2)}
    >>> params, state = opt.step(params, {"w": torch.tensor([1.0, -1.0])}, opt.init(params))
    >>> params["w"]  # -0.01 * g / sqrt(0.01 * g * g)
    tensor([-0.1000,  0.1000])
    """
    return RMSprop(lr, alpha, eps, weight_decay, momentum, centered, maximize)


def adagrad(
    lr: LearningRate = 1e-2,
    lr_decay: Scalar = 0,
    weight_decay: Scalar = 0,
    initial_accumulator_value: float = 0,
    eps: Scalar = 1e-10,
    *,
    maximize: bool = False,
) -> Adagrad:
    """Adagrad, with `torch.optim.Adagrad`'s arguments and numbers (dense gradients).

    >>> opt = adagrad(lr=0.5)
    >>> params = {"w": torch.zeros(2)}
    >>> params, state = opt.step(params, {"w": torch.tensor([2.0, -1.0])}, opt.init(params))
    >>> params["w"]
    tensor([-0.5000,  0.5000])
    """
    return Adagrad(lr, lr_decay, weight_decay, initial_accumulator_value, eps, maximize)


def adamax(
    lr: LearningRate = 2e-3,
    betas: Betas = (0.9, 0.999),
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0,
    *,
    maximize: bool = False,
) -> Adamax:
    """Adamax, with `torch.optim.Adamax`'s arguments and numbers.

    >>> opt = adamax(lr=0.1)
    >>> params = {"w": torch.zeros(2)}
    >>> params, state = opt.step(params, {"w": torch.tensor([1.0, -1.0])}, opt.init(params))
    >>> params["w"]
    tensor([-0.1000,  0.1000])
    """
    return Adamax(lr, betas, eps, weight_decay, maximize)


def nadam(
    lr: LearningRate = 2e-3,
    betas: Betas = (0.9, 0.999),
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0,
    momentum_decay: Scalar = 4e-3,
    decoupled_weight_decay: bool = False,
    *,
    maximize: bool = False,
) -> NAdam:
    """NAdam, with `torch.optim.NAdam`'s arguments and numbers.

    >>> opt = nadam(lr=0.1)
    >>> params = {"w": torch.zeros(1)}
    >>> params, state = opt.step(params, {"w": torch.ones(1)}, opt.init(params))
    >>> params["w"]
    tensor([-0.1056])
    """
    return NAdam(lr, betas, eps, weight_decay, momentum_decay, decoupled_weight_decay, maximize)


def radam(
    lr: LearningRate = 1e-3,
    betas: Betas = (0.9, 0.999),
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0,
    decoupled_weight_decay: bool = False,
    *,
    maximize: bool = False,
) -> RAdam:
    """RAdam, with `torch.optim.RAdam`'s arguments and numbers.

    >>> opt = radam(lr=0.1)
    >>> params = {"w": torch.zeros(1)}
    >>> params, state = opt.step(params, {"w": torch.ones(1)}, opt.init(params))
    >>> params["w"]  # the first steps are momentum SGD (rho_t <= 5)
    tensor([-0.1000])
    """
    return RAdam(lr, betas, eps, weight_decay, decoupled_weight_decay, maximize)


def adadelta(
    lr: LearningRate = 1.0,
    rho: Scalar = 0.9,
    eps: Scalar = 1e-6,
    weight_decay: Scalar = 0,
    *,
    maximize: bool = False,
) -> Adadelta:
    """Adadelta, with `torch.optim.Adadelta`'s arguments and numbers.

    >>> opt = adadelta()
    >>> params = {"w": torch.zeros(1)}
    >>> params, state = opt.step(params, {"w": torch.ones(1)}, opt.init(params))
    >>> params["w"]  # -sqrt(eps) / sqrt(0.1 + eps)
    tensor([-0.0032])
    """
    return Adadelta(lr, rho, eps, weight_decay, maximize)
