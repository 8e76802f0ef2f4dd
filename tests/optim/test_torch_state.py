"""torch.optim's state as a tree keyed by parameter path (``optim.optimizer_state``), and back
into an optimizer (``optim.load_optimizer_state``): the next step is torch's own, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import modstate as ms
from modstate import optim


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2))


def backward(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 3, generator=generator)
    model.zero_grad()
    model(x).pow(2).sum().backward()


def grouped_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    groups = [
        {"params": [model[0].weight, model[0].bias, model[3].weight]},
        {"params": [model[2].weight, model[2].bias, model[3].bias], "lr": 0.01},
    ]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=0.05, amsgrad=True)
    return torch.optim.AdamW(groups, lr=0.05, weight_decay=0.1)


def stepped_adam(model: nn.Module, seed: int = 0) -> torch.optim.Optimizer:
    """A grouped Adam over ``model`` after one step on the gradients of ``backward(model, seed)``."""
    opt = grouped_optimizer("adam", model)
    backward(model, seed)
    opt.step()
    return opt


def test_optimizer_state_is_keyed_by_parameter_path():
    model = make_model()
    opt = stepped_adam(model)
    tree = optim.optimizer_state(opt, model)
    flat = ms.flatten(tree["state"])
    assert flat["2.weight.exp_avg"] is opt.state[model[2].weight]["exp_avg"]
    assert set(flat) == {
        f"{path}.{key}"
        for path in ("0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias")
        for key in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    }
    assert tree["param_groups"][0]["params"] == ["0.weight", "0.bias", "3.weight"]
    assert tree["param_groups"][1]["params"] == ["2.weight", "2.bias", "3.bias"]
    assert tree["param_groups"][1]["lr"] == 0.01
    assert tree["param_groups"][0]["amsgrad"] is True
    assert {p for g in tree["param_groups"] for p in g["params"]} == set(
        ms.flatten(ms.extract(model))
    )


def test_frozen_and_tied_parameters():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    model[2].weight = model[1].weight  # tied: the first path, "1.weight", names it
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    tree = optim.optimizer_state(opt, model)
    assert "0" not in tree["state"]
    assert list(tree["state"]["2"]) == ["bias"]
    assert ms.flatten(tree["state"])["1.weight.momentum_buffer"].shape == (4, 4)
    assert tree["param_groups"][0]["params"] == [
        "1.weight",
        "1.bias",
        "2.bias",
        "3.weight",
        "3.bias",
    ]

    fresh_opt = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9
    )
    optim.load_optimizer_state(fresh_opt, model, tree)
    assert torch.equal(
        fresh_opt.state[model[2].weight]["momentum_buffer"],
        opt.state[model[1].weight]["momentum_buffer"],
    )


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_loaded_state_makes_the_next_step_identical(kind):
    model = make_model()
    opt = grouped_optimizer(kind, model)
    torch.optim.lr_scheduler.StepLR(opt, step_size=10)  # adds "initial_lr" to the groups
    for seed in range(3):
        backward(model, seed)
        opt.step()
    tree = copy.deepcopy(optim.optimizer_state(opt, model))  # a checkpoint

    fresh = make_model(seed=1)
    fresh.load_state_dict(model.state_dict())
    fresh_opt = grouped_optimizer(kind, fresh)
    fresh_opt.param_groups[1]["lr"] = 0.5  # the tree's hyperparameters win
    optim.load_optimizer_state(fresh_opt, fresh, tree)
    assert fresh_opt.param_groups[1]["lr"] == 0.01

    for m, o in ((model, opt), (fresh, fresh_opt)):
        backward(m, 10)
        o.step()
    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert (
        ms.flatten(optim.optimizer_state(opt, model)["state"]).keys()
        == ms.flatten(optim.optimizer_state(fresh_opt, fresh)["state"]).keys()
    )


def test_loaded_tree_is_copied_not_shared():
    model = make_model()
    opt = stepped_adam(model)
    tree = copy.deepcopy(optim.optimizer_state(opt, model))
    before = copy.deepcopy(tree)
    fresh_opt = grouped_optimizer("adam", model)
    optim.load_optimizer_state(fresh_opt, model, tree)
    backward(model, 1)
    fresh_opt.step()
    for key, value in ms.flatten(tree["state"]).items():
        assert torch.equal(value, ms.flatten(before["state"])[key]), key


def broken_trees(tree):
    """(expected message, broken copy) for each way an Adam tree can fail to fit."""
    cases = []

    def case(match, edit):
        broken = copy.deepcopy(tree)
        edit(broken)
        cases.append((match, broken))

    def make_sgd_group(t):
        del t["param_groups"][0]["betas"]
        t["param_groups"][0]["momentum"] = 0.9

    case(
        r"^load_optimizer_state: '9\.weight': .*not a parameter",
        lambda t: t["param_groups"][0]["params"].append("9.weight"),
    )
    case(
        r"^load_optimizer_state: '0\.bias': .* does not list it",
        lambda t: t["param_groups"][0]["params"].remove("0.bias"),
    )
    case(
        r"^load_optimizer_state: '2\.bias': .*holds it in group 1",
        lambda t: t["param_groups"][0]["params"].append("2.bias"),
    )
    case(
        r"^load_optimizer_state: 'param_groups': the tree has 1 param groups, the optimizer has 2",
        lambda t: t["param_groups"].pop(),
    )
    case(
        r"^load_optimizer_state: 'param_groups\.0': has hyperparameters \['momentum'\] and "
        r"lacks \['betas'\]",
        make_sgd_group,
    )
    case(
        r"^load_optimizer_state: '2\.weight\.exp_avg': state of shape \(3, 3\)",
        lambda t: t["state"]["2"]["weight"].update(exp_avg=torch.zeros(3, 3)),
    )
    case(
        r"^load_optimizer_state: '7\.weight\.exp_avg'",
        lambda t: t["state"].update({"7": {"weight": {"exp_avg": torch.zeros(1)}}}),
    )
    case(
        r"^load_optimizer_state: '0\.bias': the state there is a Tensor; it must be a dict",
        lambda t: t["state"]["0"].update(bias=torch.zeros(4)),
    )
    return cases


def test_trees_that_do_not_fit_are_refused_and_change_nothing():
    model = make_model()
    tree = copy.deepcopy(optim.optimizer_state(stepped_adam(model), model))
    target = stepped_adam(model, seed=1)
    before = copy.deepcopy(target.state_dict())
    for match, broken in broken_trees(tree):
        with pytest.raises(ValueError, match=match):
            optim.load_optimizer_state(target, model, broken)
        after = target.state_dict()
        assert after["param_groups"] == before["param_groups"]
        for key, entries in before["state"].items():
            for name, value in entries.items():
                assert torch.equal(after["state"][key][name], value)


def test_state_for_a_parameter_the_optimizer_does_not_hold_is_refused():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    backward(model, 0)
    opt.step()
    tree = optim.optimizer_state(opt, model)
    model[0].requires_grad_(False)
    partial = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9
    )
    with pytest.raises(ValueError, match=r"'0\.weight'"):
        optim.load_optimizer_state(partial, model, tree)


def test_an_optimizer_of_another_module_is_refused():
    model, other = make_model(), make_model()
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(
        ValueError, match=r"^optimizer_state: 'param_groups\.0\.params\.0': parameter 0 of"
    ):
        optim.optimizer_state(opt, model)


def test_a_modstate_optimizer_is_refused_with_the_reason_and_the_fix_works(tmp_path):
    model = make_model()
    opt = optim.adam()
    with pytest.raises(TypeError, match=r"expected a torch\.optim\.Optimizer.*holds no state"):
        optim.optimizer_state(opt, model)
    with pytest.raises(TypeError, match=r"expected a torch\.optim\.Optimizer"):
        optim.load_optimizer_state(opt, model, {"state": {}, "param_groups": []})
    # The fix the message names: the state is already a tree keyed by path; save it directly.
    params = ms.extract(model, detach=True)
    state = opt.step(params, ms.tree.map(torch.ones_like, params), opt.init(params))[1]
    ms.checkpoint.save(state, tmp_path / "adam.safetensors")
    loaded = ms.checkpoint.load(tmp_path / "adam.safetensors")
    assert ms.flatten(loaded).keys() == ms.flatten(state).keys()
    assert all(torch.equal(ms.flatten(loaded)[k], v) for k, v in ms.flatten(state).items())
