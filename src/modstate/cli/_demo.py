"""``python -m modstate demo``: train an ensemble functionally on an embedded dataset.

Everything here is the public API at work, in the fastest correct form for a small model: the
members are one ``Ensemble`` (``in_dims=0``: each member sees its own minibatch), whose stacked
tree is trained functionally with ``grad`` (plain autograd through the ensemble's batched
kernels: no per-operation functorch dispatch) over ``call`` and a pure optimizer
(``modstate.optim.adam(fused=True)``, donated: torch's fused kernel, in place); an EMA of the
stacked tree is kept with ``modstate.tree.lerp``; evaluation runs the stacked tree on one model
with ``vmap_call``, and one member with ``inject`` on an ordinary module.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from torch import nn

from modstate import Ensemble, call, extract, grad, inject, optim, unstack, vmap_call
from modstate import tree as trees

WIDTH = 32
TRAIN_POINTS = 256
BATCH = 64


def make_data(seed: int) -> dict[str, torch.Tensor]:
    """The embedded task: y = sin(2x) + 0.3x + noise on [-3, 3], and a clean test grid that
    reaches past the training range (where an ensemble should disagree)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(TRAIN_POINTS, 1, generator=generator) * 6 - 3
    y = torch.sin(2 * x) + 0.3 * x + 0.1 * torch.randn(TRAIN_POINTS, 1, generator=generator)
    x_test = torch.linspace(-4, 4, 200).unsqueeze(1)
    return {"x": x, "y": y, "x_test": x_test, "y_test": torch.sin(2 * x_test) + 0.3 * x_test}


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(1, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1)
    )


def run(*, members: int = 8, steps: int = 300, seed: int = 0, progress: bool = True) -> int:
    from tqdm.auto import tqdm  # type: ignore[import-untyped]

    torch.manual_seed(seed)
    data = make_data(seed)
    model = make_model()
    # The members as one module: member i is the i-th slice of every stacked tensor, and with
    # in_dims=0 it runs on the i-th slice of the input.
    ensemble = Ensemble([make_model() for _ in range(members)], in_dims=0)
    params = extract(ensemble, detach=True)  # {"stacked": {"0": {"weight": (members, 32, 1) ...
    opt = optim.adam(lr=1e-2, fused=True)
    state = opt.init(params)
    ema = trees.clone(params)

    def loss(tree, x, y):
        # The sum of the members' own mean losses: member i's gradient is that of its own loss.
        return ((call(ensemble, tree, x) - y) ** 2).mean(dim=(1, 2)).sum()

    member_step = grad(loss)
    generator = torch.Generator().manual_seed(seed + 1)
    print(task_line(members))
    started = time.perf_counter()
    bar = tqdm(
        range(steps),
        desc=f"training {_plural(members, 'member')}",
        disable=not progress,
        unit="step",
    )
    for _ in bar:
        # Each member sees its own minibatches: a bootstrap that makes the members differ.
        index = torch.randint(0, TRAIN_POINTS, (members, BATCH), generator=generator)
        grads = member_step(params, data["x"][index], data["y"][index])
        params, state = opt.step(params, grads, state, donate=True)  # the old ones are not read
        ema = trees.lerp(ema, params, EMA_RATE)
    elapsed = time.perf_counter() - started

    stacked, stacked_ema = params["stacked"], ema["stacked"]
    with torch.no_grad():  # the stacked trees on one ordinary model, all members on one input
        test = vmap_call(model, stacked, data["x_test"])  # (members, points, 1)
        test_ema = vmap_call(model, stacked_ema, data["x_test"])
    _report(data, test, test_ema, members, steps, elapsed)

    # Any member is an ordinary model again, without copying it into one: inject its tree.
    first = unstack(stacked)[0]
    with inject(model, first), torch.no_grad():
        single = model(data["x_test"])
    assert torch.allclose(single, test[0], atol=1e-5)
    print(
        "member 0 run as an ordinary nn.Module under ms.inject: same predictions as in the ensemble"
    )
    print(f"read what just ran: src/modstate/cli/_demo.py (here: {Path(__file__).resolve()})")
    return 0


def _mse(prediction: torch.Tensor, target: torch.Tensor) -> float:
    return float(torch.mean((prediction - target) ** 2))


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


# The EMA's weight on the newest params at every step: it averages about the last 1 / EMA_RATE.
EMA_RATE = 0.05
# The ensemble mean "fits the data" when its error inside the training range is below this: the
# clean target's variance there is about 0.8, the label noise's 0.01.
FIT_MSE = 0.05
# Members "disagree where there is no data" when their spread outside the training range is at
# least this many times their spread inside it.
SPREAD_RATIO = 1.5


def task_line(members: int) -> str:
    """The one line that says what the demo does."""
    who = "1 MLP" if members == 1 else f"{members} MLPs trained at once"
    return (
        f"task: fit y = sin(2x) + 0.3x to {TRAIN_POINTS} noisy points on [-3, 3] with {who}, "
        "then predict on [-4, 4]"
    )


def verdicts(members: int, fit_mse: float, spread_in: float, spread_out: float) -> list[str]:
    """What the numbers support, and nothing more."""
    who = "the model's" if members == 1 else "the ensemble's"
    if fit_mse > FIT_MSE:
        return [
            f"not fitted yet: {who} MSE inside the training range is {fit_mse:.3f} "
            f"(above {FIT_MSE}); train longer (--steps) before reading anything into it"
        ]
    lines = [f"fitted: {who} MSE inside the training range is {fit_mse:.3f}"]
    if members == 1:
        lines.append("one member has no spread to measure: use --members 2 or more")
        return lines
    ratio = spread_out / spread_in if spread_in > 0 else math.inf
    spread = (
        f"members' spread (std): {spread_in:.3f} inside the training range, {spread_out:.3f} "
        f"outside ({ratio:.1f}x)"
    )
    if ratio >= SPREAD_RATIO:
        lines.append(f"{spread}: they disagree where there is no data")
    else:
        lines.append(f"{spread}: no clear sign of where the data ends")
    return lines


def _report(data, test, test_ema, members: int, steps: int, elapsed: float) -> None:
    y = data["y_test"]
    inside = (data["x_test"].abs() <= 3).squeeze(1)
    rows = [
        (f"member {i}", _mse(test[i], y), _mse(test[i][inside], y[inside])) for i in range(members)
    ]
    mean = test.mean(0)
    mean_ema = test_ema.mean(0)
    if members > 1:
        rows.append(("ensemble mean", _mse(mean, y), _mse(mean[inside], y[inside])))
        rows.append(
            ("ensemble mean, EMA weights", _mse(mean_ema, y), _mse(mean_ema[inside], y[inside]))
        )
    else:
        rows.append(("member 0, EMA weights", _mse(mean_ema, y), _mse(mean_ema[inside], y[inside])))

    print(
        f"\n{_plural(members, 'member')} x {_plural(steps, 'step')} in {elapsed:.1f} s "
        "(functional loop: ms.grad through one Ensemble, fused Adam)"
    )
    print(f"{'':28}{'test MSE':>12}{'MSE |x|<=3':>14}")
    for name, everywhere, within in rows:
        print(f"{name:28}{everywhere:12.4f}{within:14.4f}")
    spread_in = spread_out = 0.0
    if members > 1:
        spread_in = float(test.std(0)[inside].mean())
        spread_out = float(test.std(0)[~inside].mean())
    for line in verdicts(members, _mse(mean[inside], y[inside]), spread_in, spread_out):
        print(line)
    print(ema_verdict(_mse(mean[inside], y[inside]), _mse(mean_ema[inside], y[inside])))


def ema_verdict(plain_mse: float, ema_mse: float) -> str:
    """Why the EMA weights score as they do: an average of the last steps' weights lags weights
    that are still improving, and smooths weights that jitter around a minimum."""
    steps = round(1 / EMA_RATE)
    if ema_mse > plain_mse:
        return (
            f"EMA weights (an average over about the last {steps} steps) score worse here: the "
            f"weights were still improving when training stopped, and the average lags behind "
            f"them. An EMA pays off when the weights jitter around a minimum (long runs, noisy "
            f"gradients, a large learning rate), not while the loss still falls"
        )
    return (
        f"EMA weights (an average over about the last {steps} steps) score better here: they "
        f"smooth the last steps' jitter around the minimum"
    )
