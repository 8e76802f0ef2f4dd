"""``ms.apply`` under a lone ``torch.vmap`` over stacked trees runs every member at once with the
ensemble's batched kernels: outputs, gradients and BatchNorm statistics equal the members run
one by one; anything the route does not cover runs as before."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modstate as ms
from modstate.ensemble import _kept

from loop_reference import ATOL, RTOL, seeded_members
from together import run_together

MEMBERS = 3


def bn_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


class Block(nn.Module):
    """A residual conv block with BatchNorm2d: glue (the add) between batched layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn(self.conv(x)) + x)
        return self.head(y.mean((2, 3)))


def stacked(models):
    halves = [ms.split(m, detach=True) for m in models]
    return ms.stack([p for p, _ in halves]), ms.stack([s for _, s in halves])


def kept(module) -> int:
    """How many ensembles the route keeps for ``module`` (0: it never ran for it)."""
    return len(_kept._kept.get(module, {}))


def vmapped_apply(module, params, state, x):
    """Every member of the stacked trees on ``x`` (shared), through ``ms.apply`` under vmap."""
    return torch.vmap(lambda p, s: ms.apply(module, p, s, x))(params, state)


def close(got, want, what):
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=what)


@pytest.mark.parametrize("factory, shape", [(bn_mlp, (5, 4)), (Block, (2, 3, 6, 6))])
@pytest.mark.parametrize("mapped_input", [False, True])
def test_vmap_of_grad_of_apply_equals_the_members_trained_one_by_one(factory, shape, mapped_input):
    models = seeded_members(factory, MEMBERS)
    params, state = stacked(models)
    x = torch.randn(MEMBERS, *shape) if mapped_input else torch.randn(*shape)
    y = torch.randint(0, 2, (shape[0],))
    template = models[0]

    def loss(p, s, x):
        out, new_state = ms.apply(template, p, s, x)
        return F.cross_entropy(out, y), new_state

    in_dims = (0, 0, 0 if mapped_input else None)
    grads, new_state = torch.vmap(ms.grad(loss, has_aux=True), in_dims=in_dims)(params, state, x)
    assert kept(template) == 1  # the batched route ran
    for i, model in enumerate(models):
        F.cross_entropy(model(x[i] if mapped_input else x), y).backward()
        for path, parameter in model.named_parameters():
            close(ms.flatten(grads)[path][i], parameter.grad, f"member {i}: grad of {path}")
        for path, buffer in model.named_buffers():
            close(ms.flatten(new_state)[path][i], buffer, f"member {i}: {path}")
    # nothing passed in was written, and the template is as it was
    assert (
        int(
            ms.flatten(state)[
                "bn.num_batches_tracked" if factory is Block else "1.num_batches_tracked"
            ].sum()
        )
        == 0
    )


def test_forward_under_vmap_equals_the_ensemble_and_follows_eval_and_settings():
    models = seeded_members(bn_mlp, MEMBERS)
    params, state = stacked(models)
    template = models[0]
    x = torch.randn(5, 4)

    def run():
        return torch.vmap(lambda p, s: ms.apply(template, p, s, x))(params, state)

    out, new_state = run()
    with torch.no_grad():
        close(out, ms.Ensemble(models, route="batched")(x), "train-mode outputs")
    for i, model in enumerate(copy.deepcopy(models)):
        model(x)
        close(new_state["1"]["running_mean"][i], model[1].running_mean, f"stats of member {i}")
    template.eval()  # a new setting: another kept ensemble, reading the running statistics
    out, new_state = run()
    assert kept(template) == 2
    for i, model in enumerate(models):
        close(out[i], model.eval()(x), f"eval output of member {i}")
    close(new_state["1"]["running_mean"], state["1"]["running_mean"], "eval: untouched")
    same = []

    def untouched(p, s):
        new = ms.apply(template, p, s, x)[1]
        same.append(new["1"]["running_mean"] is s["1"]["running_mean"])
        return new

    torch.vmap(untouched)(params, state)
    assert same == [True]  # in eval mode a buffer comes back as the very object given
    template.train()
    template[1].momentum = 0.5  # a changed hyperparameter is seen
    _, new_state = run()
    for i, model in enumerate(models):
        model.train()[1].momentum = 0.5
        model[1].reset_running_stats()
        model(x)
        close(new_state["1"]["running_mean"][i], model[1].running_mean, f"momentum, member {i}")


def test_the_module_is_left_as_it_was_and_its_kept_ensemble_goes_with_it():
    models = seeded_members(bn_mlp, MEMBERS)
    params, state = stacked(models)
    template = models[0]
    before = {name: (t, t.requires_grad) for name, t in template.named_parameters()}
    x = torch.randn(5, 4)
    vmapped_apply(template, params, state, x)
    assert {name: (t, t.requires_grad) for name, t in template.named_parameters()} == before
    assert kept(template) == 1
    gone = weakref.ref(template)
    del template, models, before
    gc.collect()
    assert gone() is None  # the kept ensemble does not keep the module alive


def test_calls_the_route_does_not_cover_run_by_vmaps_rules_as_before():
    models = seeded_members(bn_mlp, MEMBERS)
    params, state = stacked(models)
    template = models[0].eval()
    x = torch.randn(5, 4)
    one = ms.unstack(params)[0]

    def apply(p, s):
        return ms.apply(template, p, s, x)[0]

    shared = torch.vmap(apply, in_dims=(None, 0))(one, state)  # params shared by the members
    for i in range(MEMBERS):
        close(shared[i], ms.call(template, (one, ms.unstack(state)[i]), x), f"member {i}")
    calls = []
    handle = template[0].register_forward_hook(lambda *_: calls.append(1))
    try:
        torch.vmap(apply)(params, state)  # a hook: it must run, so the route stands aside
    finally:
        handle.remove()
    assert calls == [1] and kept(template) == 0
    with torch.no_grad():  # torch.func.grad around the vmap: vmap's rules too
        torch.func.grad(lambda p: torch.vmap(apply)(p, state).sum())(params)
    assert kept(template) == 0


def test_a_tree_that_does_not_fit_is_refused_with_the_modules_own_path():
    models = seeded_members(bn_mlp, MEMBERS)
    params, state = stacked(models)
    del state["1"]["running_var"]
    x = torch.randn(5, 4)
    with pytest.raises(KeyError, match="'1.running_var'"):
        torch.vmap(lambda p, s: ms.apply(models[0], p, s, x))(params, state)


def test_dropout_draws_per_member_under_randomness_different():
    def factory():
        return nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 2))

    models = seeded_members(factory, MEMBERS)
    params, state = stacked(models)
    x = torch.randn(5, 4)

    def apply(p, s):
        return ms.apply(models[0], p, s, x)[0]

    with pytest.raises(RuntimeError, match="randomness"):
        torch.vmap(apply)(params, state)
    out = torch.vmap(apply, randomness="different")(params, state)
    assert out.shape == (MEMBERS, 5, 2) and kept(models[0]) == 2  # one per randomness


def test_threads_applying_one_module_each_get_their_own_members():
    models = seeded_members(bn_mlp, MEMBERS)
    template = models[0]
    trees = [stacked(seeded_members(bn_mlp, MEMBERS)[k:] + models[:k]) for k in range(4)]
    x = torch.randn(5, 4)
    run = torch.vmap(lambda p, s: ms.apply(template, p, s, x))
    expected = [run(*tree) for tree in trees]

    def work(i: int) -> int:
        wrong = 0
        for _ in range(100):
            out, new_state = run(*trees[i])
            want_out, want_state = expected[i]
            wrong += not torch.equal(out, want_out)
            wrong += not torch.equal(
                new_state["1"]["running_mean"], want_state["1"]["running_mean"]
            )
        return wrong

    assert run_together(work) == [0, 0, 0, 0]


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(
        self, x: torch.Tensor, scale: torch.Tensor | None = None, pair=None
    ) -> torch.Tensor:
        out = self.linear(x)
        if scale is not None:
            out = out * scale
        if pair is not None:
            out = out + pair[0]
        return out


def test_inputs_mapped_in_keywords_or_containers_run_by_vmaps_rules_with_the_same_numbers():
    models = seeded_members(TwoInputs, MEMBERS)
    params, state = stacked(models)
    template = models[0]
    x = torch.randn(MEMBERS, 5, 4)
    scales = torch.randn(MEMBERS, 1)
    expected = torch.stack([m(x[i], scales[i], (scales[i],)) for i, m in enumerate(models)])

    def by_keyword(p, s, x, scale):
        return ms.apply(template, p, s, x, scale=scale, pair=(scale,))[0]

    def in_a_tuple(p, s, x, scale):
        return ms.apply(template, p, s, x, scale, (scale,))[0]

    for fn in (by_keyword, in_a_tuple):
        close(torch.vmap(fn)(params, state, x, scales), expected, fn.__name__)
    assert kept(template) == 0  # neither took the batched route
    mapped_dim_two = torch.vmap(lambda p, s, x: ms.apply(template, p, s, x)[0], in_dims=(0, 0, 2))
    moved = x.permute(1, 2, 0)  # members last: the route moves them first
    close(
        mapped_dim_two(params, state, moved),
        torch.stack([m(x[i]) for i, m in enumerate(models)]),
        "in_dims=2",
    )
    assert kept(template) == 1


def test_the_kept_ensemble_holds_none_of_the_modules_tensors():
    models = seeded_members(bn_mlp, MEMBERS)
    params, state = stacked(models)
    template = models[0]
    vmapped_apply(template, params, state, torch.randn(5, 4))
    (ensemble,) = _kept._kept[template].values()
    held = [*ms.flatten(ms.extract(ensemble)).values()]
    held += ms.flatten(ms.extract(ensemble._template)).values()
    assert held and all(t.untyped_storage().nbytes() <= t.element_size() for t in held)
    own = {t.untyped_storage().data_ptr() for t in template.state_dict().values()}
    assert not own & {t.untyped_storage().data_ptr() for t in held}


def test_a_replaced_layer_of_another_class_gets_an_ensemble_of_its_own():
    def factory():
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    models = seeded_members(factory, MEMBERS)
    params, state = stacked(models)
    template = models[0]
    x = torch.randn(5, 4)
    vmapped_apply(template, params, state, x)
    for model in (template, *models):
        model[1] = nn.Sigmoid()  # no attributes of its own: only its class tells it apart
    out, _ = vmapped_apply(template, params, state, x)
    close(out, torch.stack([m(x) for m in models]), "after Tanh -> Sigmoid")


def test_threads_training_one_module_functionally_each_get_their_own_gradients():
    models = seeded_members(bn_mlp, MEMBERS)
    template = models[0]
    trees = [stacked(seeded_members(bn_mlp, MEMBERS)[k:] + models[:k]) for k in range(4)]
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))

    def loss(p, s):
        out, new_state = ms.apply(template, p, s, x)
        return F.cross_entropy(out, y), new_state

    step = torch.vmap(ms.grad(loss, has_aux=True))

    def flat(result):
        grads, new_state = result
        return {**ms.flatten(grads), **{f"state.{k}": v for k, v in ms.flatten(new_state).items()}}

    expected = [flat(step(*tree)) for tree in trees]

    def work(i: int) -> int:
        wrong = 0
        for _ in range(100):
            got, want = flat(step(*trees[i])), expected[i]
            wrong += any(not torch.equal(got[path], want[path]) for path in want)
        return wrong

    assert run_together(work) == [0, 0, 0, 0]
    assert kept(template) == 1
