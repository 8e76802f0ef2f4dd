"""masked(opt, *patterns): only matching leaves are stepped and hold state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import modstate as ms
from modstate import optim


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def test_only_matching_leaves_move_and_hold_state():
    params = ms.extract(make_model(), detach=True)
    opt = optim.masked(optim.adam(lr=0.1), "2.*")
    state = opt.init(params)
    assert state["exp_avg"]["0"] == {"weight": None, "bias": None}
    assert state["exp_avg"]["2"]["weight"].shape == (2, 4)
    grads = ms.tree.map(lambda p: torch.ones_like(p) if p.is_floating_point() else None, params)
    new, state = opt.step(params, grads, state)
    assert new["0"]["weight"] is params["0"]["weight"]
    assert new["1"]["num_batches_tracked"] is params["1"]["num_batches_tracked"]
    assert not torch.equal(new["2"]["weight"], params["2"]["weight"])


def test_same_numbers_as_torch_optim_on_the_matching_parameters():
    model = make_model()
    params = ms.tree.clone(ms.extract(model, detach=True))  # torch.optim steps the model in place
    head = [model[2].weight, model[2].bias]
    torch_opt = torch.optim.SGD(head, lr=0.1, momentum=0.9)
    opt = optim.masked(optim.sgd(lr=0.1, momentum=0.9), "2")
    state = opt.init(params)
    for step in range(5):
        grads = ms.tree.map(
            lambda p, step=step: torch.full_like(p, step + 1.0) if p.is_floating_point() else None,
            params,
        )
        for p in head:
            p.grad = torch.full_like(p, step + 1.0)
        torch_opt.step()
        params, state = opt.step(params, grads, state)
    assert torch.equal(params["2"]["weight"], model[2].weight.detach())
    assert torch.equal(params["2"]["bias"], model[2].bias.detach())


def test_patterns_that_match_nothing_are_refused():
    params = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match=r"^masked\.init: 'head\.\*': matches no leaf path; .*'w'"):
        optim.masked(optim.sgd(), "head.*").init(params)
    # The fix the message names: a pattern that matches one of the listed paths.
    assert optim.masked(optim.sgd(), "w").init(params)["step"] == 0
    with pytest.raises(ValueError, match="pass at least one, such as 'head.*'"):
        optim.masked(optim.sgd())


def test_grads_of_another_structure_name_the_path():
    params = {"a": torch.ones(2), "b": torch.ones(2)}
    opt = optim.masked(optim.sgd(), "a")
    with pytest.raises(ValueError, match=r"^masked\.step: 'b': a path of params that grads lacks"):
        opt.step(params, {"a": torch.ones(2)}, opt.init(params))
    # The fix the message names: grads of params' structure, None where there is no gradient.
    new, _ = opt.step(params, {"a": torch.ones(2), "b": None}, opt.init(params))
    assert new["b"] is params["b"]


def test_a_tie_matched_at_one_of_its_paths_is_stepped_and_stays_one_tensor():
    from zoo import TiedLM

    torch.manual_seed(0)
    lm = TiedLM()  # embed.weight is head.weight
    params, _ = ms.split(lm, detach=True)
    tokens = torch.tensor([[1, 2, 3]])
    grads = torch.func.grad(lambda p: ms.call(lm, p, tokens).square().mean())(params)
    opt = optim.masked(optim.sgd(lr=0.5), "head.*")  # names the tie's second path only
    new, _ = opt.step(params, grads, opt.init(params))
    assert new["head"]["weight"] is new["embed"]["weight"]
    expected = params["embed"]["weight"] - 0.5 * grads["embed"]["weight"]
    assert torch.equal(new["head"]["weight"], expected)
    assert new["body"]["weight"] is params["body"]["weight"]  # not matched: unchanged
    ms.call(lm, new, tokens)  # still fits the model
