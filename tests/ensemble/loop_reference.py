"""The check every ensemble test makes: an ``Ensemble`` computes what its members compute one by
one (outputs, gradients, BatchNorm statistics), in training and eval mode, and ``member(i)`` is
member ``i``."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import modstate as ms

ATOL = 1e-5
RTOL = 1e-5


def seeded_members(factory: Callable[[], nn.Module], count: int = 3) -> list[nn.Module]:
    """``count`` models from ``factory``, member ``i`` under seed ``i``; parameters drawn from a
    normal distribution, so that BatchNorm's and LayerNorm's affine terms are not 1 and 0."""
    models = []
    for seed in range(count):
        torch.manual_seed(seed)
        model = factory()
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.is_floating_point():
                    parameter.normal_(0, 0.5)
        models.append(model)
    return models


def loop(
    models: list[nn.Module], inputs: tuple, in_dims: Any, kwargs: dict, output: Callable
) -> torch.Tensor:
    outs = []
    for i, model in enumerate(models):
        mine = tuple(x if in_dims is None else x[i] for x in inputs)
        outs.append(output(model(*mine, **kwargs)))
    return torch.stack(outs)


def assert_like_the_loop(
    factory: Callable[[], nn.Module],
    make_inputs: Callable[[], tuple],
    *,
    count: int = 3,
    in_dims: Any = None,
    modes: tuple[bool, ...] = (True, True, False),
    kwargs: dict | None = None,
    output: Callable[[Any], torch.Tensor] = lambda out: out,
    atol: float = ATOL,
    rtol: float = RTOL,
    kernels: dict | None = None,
) -> ms.Ensemble:
    """Run an ensemble of ``count`` members and the members one by one, once per entry of
    ``modes`` (training or eval), and compare outputs, gradients (of a fixed random weighting of
    the outputs) and every buffer; then ``member(i)``. ``make_inputs()`` gives the positional
    inputs of one call (with a leading member dim when ``in_dims=0``); ``kernels`` goes to the
    ensemble. Returns the ensemble."""
    kwargs = kwargs or {}
    models = seeded_members(factory, count)
    references = [copy.deepcopy(m) for m in models]
    ensemble = ms.Ensemble(models, in_dims=in_dims, kernels=kernels, route="batched", measure=False)
    torch.manual_seed(100)
    for step, training in enumerate(modes):
        inputs = make_inputs()
        ensemble.train(training)
        for reference in references:
            reference.train(training)
        out = output(ensemble(*inputs, **kwargs))
        expected = loop(references, inputs, in_dims, kwargs, output)
        torch.testing.assert_close(out, expected, atol=atol, rtol=rtol, msg=f"output, call {step}")
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
        if out.requires_grad:
            ensemble.zero_grad(set_to_none=True)
            for reference in references:
                reference.zero_grad(set_to_none=True)
            (out * weights).sum().backward()
            (expected * weights).sum().backward()
            for name, parameter in ensemble.named_parameters():
                path = name.removeprefix("stacked.")
                grads = [r.get_parameter(path).grad for r in references]
                if parameter.grad is None:
                    assert all(g is None for g in grads), f"no gradient for {path}"
                    continue
                want = torch.stack(
                    [g if g is not None else torch.zeros_like(parameter[0]) for g in grads]
                )
                torch.testing.assert_close(
                    parameter.grad,
                    want,
                    atol=atol * 10,
                    rtol=rtol * 10,
                    msg=f"grad of {path}, call {step}",
                )
        stacked = ms.flatten(ms.stack([ms.extract(r) for r in references]))
        for path, leaf in ms.flatten(ensemble.tree()).items():
            torch.testing.assert_close(
                leaf, stacked[path], atol=atol, rtol=rtol, msg=f"{path}, call {step}"
            )
    inputs = make_inputs()
    for i, reference in enumerate(references):
        member = ensemble.member(i)
        assert type(member) is type(reference)
        with torch.no_grad():
            mine = tuple(x if in_dims is None else x[i] for x in inputs)
            torch.testing.assert_close(
                output(member(*mine, **kwargs)),
                output(reference(*mine, **kwargs)),
                atol=atol,
                rtol=rtol,
            )
    return ensemble


def backward_nodes(output: torch.Tensor) -> set[str]:
    """The names of every node of ``output``'s backward graph (``"CopySlices"`` where autograd
    rewrote a view that was written in place)."""
    names, seen, todo = set(), set(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names
