"""Learning-rate schedules: functions of the step count, usable as an optimizer's ``lr=``.

Each schedule ``s`` maps the number of steps already taken (``0`` for the first step) to the
learning rate of the next step, and equals the matching `torch.optim.lr_scheduler` at every step,
bit for bit: ``s(t)`` is the ``lr`` that torch's optimizer uses in its ``t + 1``-th step when the
scheduler steps after every optimizer step. Arguments are named as torch's; the base learning rate
(the optimizer's ``lr`` in torch) comes first.

Several torch schedulers update the learning rate recursively (``lr = lr * gamma``), which rounds
differently from the closed form; a schedule called with a number replays that recursion (cached,
so a training loop pays O(1) per step). Called with a tensor (the step counter under `vmap`,
`grad` or `torch.compile`) it uses the closed form, equal up to rounding.

>>> opt = modstate.optim.sgd(lr=modstate.optim.schedules.step(0.1, step_size=2, gamma=0.5))
>>> params = {"w": torch.zeros(1)}
>>> state = opt.init(params)
>>> for _ in range(4):
...     params, state = opt.step(params, {"w": torch.ones(1)}, state)
>>> params["w"]  # 0.1 + 0.1 + 0.05 + 0.05
tensor([-0.3000])
"""

from __future__ import annotations

from modstate.optim.schedules._factories import (
    constant,
    cosine,
    exponential,
    linear_warmup,
    multistep,
    onecycle,
    step,
    warmup_cosine,
)

__all__ = [
    "constant",
    "cosine",
    "exponential",
    "linear_warmup",
    "multistep",
    "onecycle",
    "step",
    "warmup_cosine",
]
