"""``Ensemble(route=...)``: the batched forward or a loop over the members, chosen by measuring.

Whatever the route, the ensemble computes what its members compute one by one; measuring at
the first call with new inputs changes nothing a later call can see, and is done once per input
signature, also when threads call at once.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import modstate as ms

from members import ATOL, cnn, from_threads, loop, mlp, seeded


def trained_copies(models, x):
    """The members' outputs, stacked, and their gradients of the outputs' sum, one by one."""
    copies = copy.deepcopy(models)
    out = loop(copies, x)
    out.sum().backward()
    grads = [{n: p.grad for n, p in m.named_parameters()} for m in copies]
    return out, grads, copies


@pytest.mark.parametrize("route", ["auto", "batched", "loop"])
def test_every_route_equals_the_members_one_by_one_in_training(route):
    models = seeded(cnn, 3)  # BatchNorm in training mode
    x = torch.randn(5, 3, 8, 8)
    expected, grads, after = trained_copies(models, x)
    ensemble = ms.Ensemble(models, route=route)
    out = ensemble(x)
    out.sum().backward()
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    for i, member_grads in enumerate(grads):
        for path, grad in member_grads.items():
            stacked = ensemble.stacked.get_parameter(path)
            torch.testing.assert_close(stacked.grad[i], grad, atol=ATOL, rtol=0, msg=path)
    for i, member in enumerate(after):  # one update of the statistics, measuring or not
        for path, buffer in member.named_buffers():
            torch.testing.assert_close(ensemble.stacked.get_buffer(path)[i], buffer, msg=path)


def test_the_loop_route_maps_inputs_per_member():
    models = seeded(mlp, 4)
    x = torch.randn(4, 6, 5)
    ensemble = ms.Ensemble(models, in_dims=0, route="loop").eval()
    torch.testing.assert_close(ensemble(x), loop(models, x, in_dims=0), atol=ATOL, rtol=0)


def test_auto_measures_once_per_input_signature_and_the_plan_shows_it():
    ensemble = ms.Ensemble(seeded(mlp, 3))
    x = torch.randn(8, 5)
    ensemble(x)
    ensemble(torch.randn(8, 5))  # same signature: no new measurement
    assert len(ensemble.plan.notes) == 1
    note = ensemble.plan.notes[0]
    assert note.startswith("forward for inputs (8, 5) float32 (train, grad): ")
    assert "batched" in note and "loop" in note and "measured in" in note
    with torch.no_grad():
        ensemble(x)  # autograd off: another signature
    ensemble.eval()(x)  # eval: another one
    ensemble(torch.randn(2, 5))  # another shape: another one
    assert len(ensemble.plan.notes) == 4
    assert "(eval, grad)" in ensemble.plan.notes[2]


def test_measuring_changes_no_random_state_and_no_tensor():
    models = seeded(cnn, 2)
    ensemble = ms.Ensemble(models)
    before = {k: v.clone() for k, v in ensemble.state_dict().items()}
    torch.manual_seed(3)
    state = torch.random.get_rng_state()
    with torch.no_grad():
        ensemble.eval()(torch.randn(2, 3, 8, 8))
    torch.manual_seed(3)
    assert torch.equal(torch.random.get_rng_state(), state)
    for key, value in ensemble.state_dict().items():
        assert torch.equal(value, before[key]), key  # eval: nothing moves


def test_threads_share_one_measurement_and_get_the_same_outputs():
    ensemble = ms.Ensemble(seeded(mlp, 3)).eval()
    inputs = [torch.randn(16, 5, generator=torch.Generator().manual_seed(i)) for i in range(200)]
    results = from_threads(ensemble, inputs)
    assert len(ensemble.plan.notes) == 1  # one signature, one measurement
    with torch.no_grad():
        for i, x in enumerate(inputs):  # the route chosen: the same numbers, exactly
            assert torch.equal(results[i], ensemble(x)), i


def test_compiled_and_reference_ensembles_do_not_measure():
    models = seeded(mlp, 2)
    x = torch.randn(3, 5)
    for ensemble in (ms.Ensemble(models, fast=False), ms.Ensemble(models, route="batched")):
        ensemble(x)
        assert ensemble.plan.notes == []
    measured = ms.Ensemble(models)
    torch.func.grad(lambda t: ms.call(measured, t, x).sum())(ms.extract(measured, detach=True))
    assert measured.plan.notes == []  # under torch.func: the batched forward


def test_dropout_in_training_with_randomness_runs_batched_unmeasured():
    models = seeded(lambda: torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.Dropout()), 2)
    ensemble = ms.Ensemble(models, randomness="different").train()
    ensemble(torch.randn(3, 5))
    assert ensemble.plan.notes == []  # a loop would draw other masks


def test_a_copy_and_a_pickle_measure_afresh():
    ensemble = ms.Ensemble(seeded(mlp, 2))
    ensemble(torch.randn(3, 5))
    for other in (copy.deepcopy(ensemble), pickle.loads(pickle.dumps(ensemble))):
        assert other.route == "auto" and other.plan.notes == []
        torch.testing.assert_close(
            other.eval()(torch.ones(1, 5)), ensemble.eval()(torch.ones(1, 5))
        )
        ensemble.train()


def test_an_unknown_route_is_refused_with_the_choices():
    models = seeded(mlp, 2)
    with pytest.raises(ValueError, match="Ensemble: route='fastest'; use one of 'auto'"):
        ms.Ensemble(models, route="fastest")
    with pytest.raises(ValueError, match="Ensemble.from_factory: route='vmap'; use one of"):
        ms.Ensemble.from_factory(mlp, 2, route="vmap")
    assert ms.Ensemble(models, route="loop").route == "loop"  # the fix: one of the choices


def test_after_eight_signatures_new_ones_take_the_usual_route_unmeasured():
    ensemble = ms.Ensemble(seeded(mlp, 2)).eval()
    models = ensemble.members()
    with torch.no_grad():
        for rows in range(1, 13):  # a new shape at every call, as a growing sequence gives
            x = torch.randn(rows, 5)
            torch.testing.assert_close(ensemble(x), loop(models, x), atol=ATOL, rtol=0)
    assert len(ensemble.plan.notes) == 8


def test_the_loop_is_kept_only_where_it_measured_clearly_faster(monkeypatch):
    from modstate.ensemble import _choice

    # each run "takes" the seconds its way gives (a sleep would be as noisy as the machine)
    monkeypatch.setattr(_choice, "_timed", lambda way, trained: way())

    def taking(seconds):
        return lambda: seconds

    # a tie within the margin keeps the batched forward; a clear win keeps the loop
    close = _choice._measure("inputs", taking(0.02), taking(0.0195), [])
    assert close.route == "batched"
    assert close.batched_s == 0.02 and close.loop_s == 0.0195
    clear = _choice._measure("inputs", taking(0.02), taking(0.012), [])
    assert clear.route == "loop"
    assert _choice.LOOP_MARGIN < 1


def test_more_rounds_are_timed_where_the_routes_are_close(monkeypatch):
    from modstate.ensemble import _choice

    runs = {"batched": 0, "loop": 0}

    def counted(name, seconds):
        def way():
            runs[name] += 1
            return seconds

        return way

    monkeypatch.setattr(_choice, "_timed", lambda way, trained: way())
    _choice._measure("inputs", counted("batched", 0.2), counted("loop", 0.1), [])
    # the warm-up, the memory pass, then the timed rounds: 0.1 s against 0.2 is clear
    assert runs == {"batched": 2 + _choice._ROUNDS, "loop": 2 + _choice._ROUNDS}
    runs.update(batched=0, loop=0)
    _choice._measure("inputs", counted("batched", 0.1), counted("loop", 0.097), [])
    assert runs["batched"] > 2 + _choice._ROUNDS  # close: timed on, up to _CLOSE_S in all


def test_a_batched_forward_over_the_memory_bound_gives_way_to_the_loop_whatever_its_time():
    import time

    from modstate.ensemble import _choice

    def big_and_fast():
        return torch.empty(_choice.ALLOWANCE // 4 + 2**20)  # more than the allowance alone

    chosen = _choice._measure("inputs", big_and_fast, lambda: time.sleep(0.01), [])
    assert chosen.route == "loop"
    assert chosen.batched_bytes > chosen.bound_bytes == _choice.ALLOWANCE  # the loop makes 0
    assert "over the bound" in chosen.line()


def test_a_wide_ensemble_without_grad_runs_the_loop_where_batched_would_hold_every_member():
    # 8 members of 16 -> 4096 -> 4 on 1024 rows: the batched hidden layer is 8 x 16 MiB at
    # once, the loop's one member's 16 MiB; the weights are 2.7 MiB
    nn = torch.nn
    models = seeded(lambda: nn.Sequential(nn.Linear(16, 4096), nn.ReLU(), nn.Linear(4096, 4)), 8)
    ensemble = ms.Ensemble(models).eval()
    x = torch.randn(1024, 16)
    with torch.no_grad():
        out = ensemble(x)
    (note,) = ensemble.plan.notes
    assert ": loop (" in note and "over the bound" in note, note
    torch.testing.assert_close(out, loop(models, x), atol=ATOL, rtol=0)
    pinned = ms.Ensemble(models, route="batched").eval()  # asked for: batched, unmeasured
    with torch.no_grad():
        torch.testing.assert_close(pinned(x), out, atol=ATOL, rtol=0)
    assert pinned.plan.notes == []
