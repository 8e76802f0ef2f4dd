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
from modstate.optim._adadelta import Adadelta, adadelta
from modstate.optim._adagrad import Adagrad, adagrad
from modstate.optim._adam import Adam, adam, adamw
from modstate.optim._adamax import Adamax, adamax
from modstate.optim._clip import clip_grad_norm
from modstate.optim._masked import Masked, masked
from modstate.optim._nadam import NAdam, nadam
from modstate.optim._protocol import Optimizer, OptimizerState
from modstate.optim._radam import RAdam, radam
from modstate.optim._rmsprop import RMSprop, rmsprop
from modstate.optim._sgd import SGD, sgd
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
    "OptimizerState",
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
