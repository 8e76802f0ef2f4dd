"""ms.split: the trained parameters on one side, everything that is carried on the other."""

import torch
from torch import nn

import modstate as ms

from zoo import TiedLM


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.BatchNorm1d(4))


def test_params_are_the_trainable_parameters_and_state_the_rest():
    model = bn_model()
    model[2].weight.requires_grad_(False)  # frozen: carried, not trained
    params, state = ms.split(model)
    assert list(ms.flatten(params)) == ["0.weight", "0.bias", "2.bias"]
    assert list(ms.flatten(state)) == [
        "2.weight",
        "2.running_mean",
        "2.running_var",
        "2.num_batches_tracked",
    ]
    assert params["0"]["weight"] is model[0].weight  # the module's own objects
    assert state["2"]["num_batches_tracked"] is model[2].num_batches_tracked


def test_the_halves_are_disjoint_and_give_every_path():
    model = bn_model()
    params, state = ms.split(model)
    everything = ms.flatten(ms.extract(model))
    assert not ms.flatten(params).keys() & ms.flatten(state).keys()
    assert sorted({**ms.flatten(params), **ms.flatten(state)}) == sorted(everything)
    x = torch.randn(5, 3)
    model.eval()
    assert torch.equal(ms.call(model, (params, state), x), model(x))


def test_a_module_without_buffers_has_an_empty_state():
    params, state = ms.split(nn.Linear(2, 2))
    assert state == {} and list(params) == ["weight", "bias"]


def test_detach_gives_detached_leaves_and_keeps_ties():
    lm = TiedLM()
    params, _ = ms.split(lm, detach=True)
    flat = ms.flatten(params)
    assert not any(leaf.requires_grad for leaf in flat.values())
    assert flat["embed.weight"] is flat["head.weight"]  # one tensor at both tied paths
    assert flat["embed.weight"].data_ptr() == lm.embed.weight.data_ptr()  # storage shared
    assert lm.embed.weight.requires_grad  # the module keeps its flags


def test_split_params_go_through_grad_and_the_state_is_left_out():
    model = bn_model().eval()
    params, state = ms.split(model, detach=True)
    x = torch.randn(5, 3)
    grads = torch.func.grad(lambda p: ms.call(model, (p, state), x).sum())(params)
    assert ms.flatten(grads).keys() == ms.flatten(params).keys()


def test_a_complex_parameter_that_requires_grad_is_trainable():
    """One rule with ms.tree.is_trainable: floating or complex, and requires grad."""

    class Spectral(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.filter = nn.Parameter(torch.randn(4, dtype=torch.complex64))
            self.frozen = nn.Parameter(torch.randn(4, dtype=torch.complex64), requires_grad=False)

        def forward(self, x):
            return (torch.fft.fft(x) * self.filter * self.frozen).abs().sum(-1)

    module = Spectral()
    params, state = ms.split(module, detach=True)
    assert list(params) == ["filter"] and list(state) == ["frozen"]
    x = torch.randn(2, 4)
    grads = torch.func.grad(lambda p: ms.call(module, (p, state), x).sum())(params)
    assert grads["filter"].dtype == torch.complex64  # torch.func.grad differentiates it
