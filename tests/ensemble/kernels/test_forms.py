"""A layer's batched forms, measured (``_kernels/forms.py``): a CPU convolution on small output
maps runs as a grouped convolution or a batched matmul, whichever its first input of each
signature ran faster; ``measure=False`` leaves it to the cost model. Whatever runs, the ensemble
computes what its members compute one by one."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import modstate as ms
from modstate.ensemble._kernels import conv, forms

from members import ATOL, from_threads, loop, seeded

FORM_NOTE = re.compile(
    r"layer '(?P<path>[\w.]+)', input \((?P<shape>[\d, ]+)\) float32(?P<grad>, grad)?: "
    r"(?P<form>grouped|matmul) \(grouped (?P<grouped>[\d.e+-]+) ms, matmul (?P<matmul>[\d.e+-]+) "
    r"ms, measured in [\d.e+-]+ s\)"
)


def small_maps():
    # 3x3 convolutions on 4x4 maps (16 positions): both forms apply to the second; the first, on
    # the shared input, is one plain convolution with the members' filters side by side
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1), nn.Flatten()
    )


class Residual(nn.Module):
    """Not a Sequential: its forward runs under vmap, the kernels inside (the runner)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = small_maps()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + 1


def form_notes(ensemble: ms.Ensemble) -> list[dict[str, str]]:
    found = [FORM_NOTE.fullmatch(note) for note in ensemble.plan.notes]
    return [match.groupdict() for match in found if match is not None]


@pytest.mark.parametrize("factory", [small_maps, Residual], ids=["chain", "runner"])
def test_each_convolution_keeps_the_faster_form_and_the_plan_shows_the_times(factory):
    models = seeded(factory, 3)
    x = torch.randn(4, 3, 4, 4)
    ensemble = ms.Ensemble(models, route="batched")  # pinned route: the forms still measured
    out = ensemble(x)
    out.sum().backward()
    torch.testing.assert_close(out, loop(models, x), atol=ATOL, rtol=0)
    loop(models, x).sum().backward()
    for i, model in enumerate(models):
        for path, parameter in model.named_parameters():
            grad = ensemble.stacked.get_parameter(path).grad[i]
            torch.testing.assert_close(grad, parameter.grad, atol=ATOL, rtol=0, msg=path)
    notes = form_notes(ensemble)
    assert [n["path"] for n in notes] == ["2" if factory is small_maps else "body.2"]
    assert notes[0]["shape"] == "4, 24, 4, 4" and notes[0]["grad"]  # 3 members side by side
    for note in notes:  # the faster of the two times
        times = {"grouped": float(note["grouped"]), "matmul": float(note["matmul"])}
        assert note["form"] == min(times, key=times.__getitem__)


def test_a_signature_is_measured_once_and_every_call_after_runs_its_form(monkeypatch):
    ensemble = ms.Ensemble(seeded(small_maps, 2), route="batched")
    x = torch.randn(4, 3, 4, 4)
    ensemble(x)
    chosen = {n["path"]: n["form"] for n in form_notes(ensemble)}
    ran: list[str] = []
    original = conv.ConvolutionKernel._form
    monkeypatch.setattr(
        conv.ConvolutionKernel, "_form", lambda *a: ran.append(original(*a)) or ran[-1]
    )
    measured = []
    monkeypatch.setattr(forms, "_measure", lambda *a: measured.append(a) or pytest.fail())
    for _ in range(3):
        ensemble(torch.randn(4, 3, 4, 4))  # the same signature
    assert not measured and ran == [chosen["2"]] * 3
    with torch.no_grad():  # autograd off: another signature, measured
        monkeypatch.undo()
        ensemble(x)
    assert len(form_notes(ensemble)) == 2


def test_measuring_writes_no_tensor_and_draws_no_random_numbers():
    ensemble = ms.Ensemble(seeded(small_maps, 2), route="batched")
    before = {k: v.clone() for k, v in ensemble.state_dict().items()}
    torch.manual_seed(5)
    state = torch.random.get_rng_state()
    ensemble(torch.randn(4, 3, 4, 4, generator=torch.Generator().manual_seed(0)))
    assert form_notes(ensemble)  # measured
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(p.grad is None for p in ensemble.parameters())  # no backward ran into them
    for key, value in ensemble.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_without_measuring_the_cost_model_decides(monkeypatch):
    ran: list[str] = []
    original = conv.ConvolutionKernel._form
    monkeypatch.setattr(
        conv.ConvolutionKernel, "_form", lambda *a: ran.append(original(*a)) or ran[-1]
    )
    cases = [  # (batch, side of the maps, the cost model's form)
        (4, 4, "matmul"),  # 16 positions, 64 columns (batch x positions)
        (5, 4, "grouped"),  # 80 columns
        (20, 2, "matmul"),  # 4 positions, whatever the batch
    ]
    for batch, side, form in cases:
        for ensemble in (
            ms.Ensemble(seeded(small_maps, 2), measure=False),
            ms.Ensemble(seeded(small_maps, 2), compile=False, route="batched", measure=False),
        ):
            ran.clear()
            ensemble(torch.randn(batch, 3, side, side)).sum().backward()
            assert form_notes(ensemble) == [] and ran == [form], (batch, side)
            assert not any(n.startswith("forward for") for n in ensemble.plan.notes)


def test_under_torch_func_and_on_inputs_of_ever_new_shapes_nothing_more_is_measured():
    ensemble = ms.Ensemble(seeded(small_maps, 2))
    tree = ms.extract(ensemble, detach=True)
    x = torch.randn(4, 3, 4, 4)
    torch.func.grad(lambda t: ms.call(ensemble, t, x).sum())(tree)
    assert form_notes(ensemble) == []  # the forms run on wrapped tensors there: the cost model
    models = ensemble.members()
    with torch.no_grad():
        for batch in range(1, 13):  # a new signature at every call
            x = torch.randn(batch, 3, 4, 4)
            torch.testing.assert_close(ensemble(x), loop(models, x), atol=ATOL, rtol=0)
    per_layer = {}
    for note in form_notes(ensemble):
        per_layer[note["path"]] = per_layer.get(note["path"], 0) + 1
    assert per_layer == {"2": forms.MAX_SIGNATURES}


def test_threads_share_one_choice_per_layer_and_get_the_same_outputs():
    ensemble = ms.Ensemble(seeded(small_maps, 3), route="batched").eval()
    inputs = [
        torch.randn(4, 3, 4, 4, generator=torch.Generator().manual_seed(i)) for i in range(200)
    ]
    results = from_threads(ensemble, inputs)
    assert [n["path"] for n in form_notes(ensemble)] == ["2"]  # one measurement
    with torch.no_grad():
        for i, x in enumerate(inputs):  # the forms chosen: the same numbers, exactly
            assert torch.equal(results[i], ensemble(x)), i


def test_measure_must_be_a_bool():
    models = seeded(small_maps, 2)
    with pytest.raises(TypeError, match="Ensemble: measure is a str; give True or False"):
        ms.Ensemble(models, measure="no")
    with pytest.raises(TypeError, match="Ensemble.from_factory: measure is a int; give True"):
        ms.Ensemble.from_factory(small_maps, 2, measure=0)
    assert ms.Ensemble(models, measure=False).measure is False  # the fix
