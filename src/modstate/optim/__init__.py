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

Kernels: ``foreach=`` and ``fused=``, with torch.optim's meaning
-----------------------------------------------------------------

Every optimizer takes ``foreach=`` and, where torch.optim has fused kernels (`sgd`, `adam`,
`adamw`, `adagrad`), ``fused=``. Each path gives the numbers of the torch.optim path of that
name, bit for bit (tested with ``torch.equal`` over 100 steps in float32, float64 and bfloat16,
pure and donated):

- ``fused=True``: torch's fused kernel (``torch._fused_adam_``, ...), one pass over each leaf;
  on the CPU the fastest way to take a step, as with torch.optim.
- ``foreach=True``: torch.optim's multi-tensor algorithm, one ``torch._foreach_*`` kernel per
  operation over all leaves (its order of operations, which differs from the single-tensor one
  in NAdam, RAdam and Adagrad, so their numbers differ in the last bits).
- ``foreach=False``: torch.optim's single-tensor algorithm (on the CPU run as ``_foreach_*``
  kernels too, which loop the very same single-tensor ops there).
- Neither (the default): torch.optim's default for the device: the single-tensor path on the
  CPU, the foreach path on CUDA. As in torch, the default applies only when both flags are None.

A differentiated step runs the differentiable path whatever the flags: when autograd records
the step (a param, gradient or hyperparameter requires grad, and grad mode is on) or a
``torch.func`` transform runs it (``vmap``, ``grad``), every operation is one out-of-place op
per leaf, which autograd and the batching rules see, with the single-tensor path's numbers.
torch.optim refuses ``fused``/``foreach`` with ``differentiable=True``; here the flags give way,
so ``vmap(adam(fused=True).step)`` steps every member as its own optimizer, and
``adam(lr=lr_tensor_that_requires_grad, fused=True)`` gives the learning rate its gradient.

What a step costs, and when to pass ``donate=True``
-------------------------------------------------------

A donated step (``step(..., donate=True)``) writes its results over the buffers of `params` and
`state`, as torch.optim steps in place: same kernels, same memory traffic, and (measured in
``benchmarks/optim_benchmarks_test.py``) the speed of the fastest torch.optim configuration.
Pass it in an ordinary training loop, where the old params and state are dropped after the
step: ``params, state = opt.step(params, grads, state, donate=True)``.

A pure step (the default) returns new trees and writes no input, which an unrolled loop, a
snapshot or a second look at the old params needs. It costs the donated step plus fresh
memory for every tree it returns (params and each buffer: three trees for Adam). On the CPU
fresh memory is expensive: the allocator hands large blocks back to the OS when they are freed,
so each new block is mapped again and page-faulted on first touch, about 55 us per MB measured
on a 2-core server, and up to several times that when the machine is busy (a 1.05 M-parameter
model's Adam step returns 12.6 MB: about 0.7 ms, twice the fused step itself). torch's fused
kernels work in place, so a pure fused step first copies params and state into the new trees,
which adds one read of them. On a GPU the caching allocator reuses freed blocks, so fresh trees
cost little more than the kernels' own memory traffic; the difference between pure and donated
is then small. The benchmark prints the
"allocation floor" (allocating and first-touching the returned trees) beside the pure step.
This library never changes process-global allocator settings.

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
