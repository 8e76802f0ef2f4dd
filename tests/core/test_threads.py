"""Stateless calls from several threads on one module: each computes with its own tree.

Every test starts real threads together (a barrier), runs hundreds of calls in each, compares
every output exactly (``torch.equal``) with one computed beforehand in a single thread, counts the
wrong ones (there must be none), and checks that the module holds its own objects afterwards.
What is *not* per call (plain attributes that ``forward`` assigns), and the modules whose calls
run one at a time, are in test_serialized_calls.py.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import modstate as ms

from threaded import (
    CALLS,
    THREADS,
    X,
    assert_holds,
    leaves,
    mlp,
    one_intra_op_thread_per_calling_thread,  # noqa: F401  (an autouse fixture)
    own_objects,
    random_tree,
)
from together import run_together
from zoo import forward_with


def test_calls_compute_with_their_own_trees_and_a_plain_forward_with_the_modules_own():
    model = mlp()
    objects = own_objects(model)
    trees = [random_tree(model, seed) for seed in range(THREADS - 1)]
    with torch.no_grad():
        expected = [ms.call(model, tree, X) for tree in trees] + [model(X)]

    def work(i: int) -> int:
        with torch.no_grad():
            if i == THREADS - 1:  # a plain forward meanwhile
                return sum(not torch.equal(model(X), expected[i]) for _ in range(CALLS))
            return sum(
                not torch.equal(ms.call(model, trees[i], X), expected[i]) for _ in range(CALLS)
            )

    assert run_together(work) == [0] * THREADS
    assert_holds(model, objects)


def test_call_partial_fills_the_rest_with_the_modules_own():
    model = mlp()
    objects = own_objects(model)
    trees = [{"2": random_tree(model, seed)["2"]} for seed in range(THREADS)]
    with torch.no_grad():
        expected = [ms.call_partial(model, tree, X) for tree in trees]

    def work(i: int) -> int:
        with torch.no_grad():
            return sum(
                not torch.equal(ms.call_partial(model, trees[i], X), expected[i])
                for _ in range(CALLS)
            )

    assert run_together(work) == [0] * THREADS
    assert_holds(model, objects)


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))


def test_apply_in_train_mode_returns_each_calls_own_statistics():
    model = bn_model()  # train mode: BatchNorm updates its statistics in place
    objects = own_objects(model)
    statistics = ms.tree.clone(ms.split(model)[1])
    inputs = [X * (i + 1) for i in range(THREADS)]
    halves = [ms.split(model, detach=True) for _ in range(THREADS)]
    for i, (params, _) in enumerate(halves):
        params["0"]["weight"] = params["0"]["weight"] * (i + 1)
    expected = [ms.apply(model, *halves[i], inputs[i]) for i in range(THREADS)]

    def work(i: int) -> int:
        wrong = 0
        for _ in range(CALLS):
            out, new_state = ms.apply(model, *halves[i], inputs[i])
            same = torch.equal(out, expected[i][0]) and all(
                torch.equal(a, b)
                for a, b in zip(leaves(new_state), leaves(expected[i][1]), strict=True)
            )
            wrong += not same
        return wrong

    assert run_together(work) == [0] * THREADS
    assert_holds(model, objects)
    assert all(
        torch.equal(a, b)
        for a, b in zip(leaves(ms.split(model)[1]), leaves(statistics), strict=True)
    )


def test_in_place_statistics_land_in_each_calls_tree():
    model = bn_model()
    objects = own_objects(model)
    trees = [ms.tree.clone(random_tree(model, seed)) for seed in range(THREADS)]
    references = [ms.tree.clone(tree) for tree in trees]
    calls = CALLS // 2
    with torch.no_grad():
        for tree in references:
            for _ in range(calls):
                ms.call(model, tree, X)

    def work(i: int) -> int:
        with torch.no_grad():
            for _ in range(calls):
                ms.call(model, trees[i], X)
        return 0

    run_together(work)
    for tree, reference in zip(trees, references, strict=True):
        assert int(tree["1"]["num_batches_tracked"]) == calls
        assert torch.equal(tree["1"]["running_mean"], reference["1"]["running_mean"])
        assert torch.equal(tree["1"]["running_var"], reference["1"]["running_var"])
    assert_holds(model, objects)
    assert int(model[1].num_batches_tracked) == 0


class Counter(nn.Module):
    """Reassigns a buffer in forward: the new tensor is written back into the call's tree."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 1
        return self.lin(x) * self.count


def test_a_buffer_forward_reassigns_goes_back_into_each_calls_tree():
    model = Counter()
    objects = own_objects(model)
    trees = [ms.extract(model, detach=True) for _ in range(THREADS)]

    def work(i: int) -> int:
        wrong = 0
        with torch.no_grad():
            for n in range(1, CALLS + 1):
                out = ms.call(model, trees[i], X)
                wrong += int(trees[i]["count"]) != n or not torch.equal(out, model.lin(X) * n)
        return wrong

    assert run_together(work) == [0] * THREADS
    assert_holds(model, objects)
    assert int(model.count) == 0


def test_vmap_call():
    model = mlp()
    objects = own_objects(model)
    stacks = [ms.stack([random_tree(model, 10 * i + j) for j in range(3)]) for i in range(THREADS)]
    with torch.no_grad():
        expected = [ms.vmap_call(model, stacked, X) for stacked in stacks]

    def work(i: int) -> int:
        with torch.no_grad():
            return sum(
                not torch.equal(ms.vmap_call(model, stacks[i], X), expected[i])
                for _ in range(CALLS // 2)
            )

    assert run_together(work) == [0] * THREADS
    assert_holds(model, objects)


class Residual(nn.Module):
    """Not a Sequential: an Ensemble runs its forward under vmap, its layers as batched kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) + x)


@pytest.mark.parametrize("make", [Residual, mlp], ids=["vmap route", "sequential route"])
def test_an_ensemble_shared_by_threads(make):
    torch.manual_seed(0)
    ensemble = ms.Ensemble([make() for _ in range(3)])
    assert ("without vmap" in ensemble.plan.summary) == (make is mlp)
    objects = own_objects(ensemble)
    template = ensemble.__dict__["_template"]  # the model that vmap runs ms.call on
    template_objects = own_objects(template)
    inputs = [X + i for i in range(THREADS)]
    with torch.no_grad():
        expected = [ensemble(x) for x in inputs]

    def work(i: int) -> int:
        with torch.no_grad():
            return sum(not torch.equal(ensemble(inputs[i]), expected[i]) for _ in range(CALLS))

    assert run_together(work) == [0] * THREADS
    assert_holds(ensemble, objects)
    assert_holds(template, template_objects)


def test_grad_through_call():
    model = mlp()
    objects = own_objects(model)
    trees = [random_tree(model, seed) for seed in range(THREADS)]

    def loss(tree: dict) -> torch.Tensor:
        return ms.call(model, tree, X).square().sum()

    expected = [torch.func.grad(loss)(tree) for tree in trees]

    def work(i: int) -> int:
        wrong = 0
        for _ in range(CALLS // 4):
            grads = torch.func.grad(loss)(trees[i])
            wrong += not all(
                torch.equal(a, b) for a, b in zip(leaves(grads), leaves(expected[i]), strict=True)
            )
        return wrong

    assert run_together(work) == [0] * THREADS
    assert_holds(model, objects)


def test_backward_through_call():
    model = mlp()
    objects = own_objects(model)
    trees = [ms.tree.map(lambda t: t.requires_grad_(), random_tree(model, s)) for s in range(3)]

    def grads_of(tree: dict) -> list[torch.Tensor]:
        ms.call(model, tree, X).square().sum().backward()
        out = [leaf.grad for leaf in leaves(tree)]
        for leaf in leaves(tree):
            leaf.grad = None
        return out

    expected = [grads_of(tree) for tree in trees]
    reference = model(X).square().sum()
    reference.backward()
    own_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    def work(i: int) -> int:
        wrong = 0
        for _ in range(CALLS // 2):
            if i == 3:  # plain training step meanwhile: grads into the module's own parameters
                model(X).square().sum().backward()
                wrong += not all(
                    torch.equal(p.grad, g)
                    for p, g in zip(model.parameters(), own_grads, strict=True)
                )
                model.zero_grad(set_to_none=True)
            else:
                grads = grads_of(trees[i])
                wrong += not all(torch.equal(a, b) for a, b in zip(grads, expected[i], strict=True))
        return wrong

    assert run_together(work) == [0] * THREADS
    assert_holds(model, objects)


def test_a_call_while_another_thread_holds_inject_open():
    """Thread A calls with its tree; thread B holds ``inject`` open; thread C's plain forward
    sees B's injected tree, and so do the paths a ``call_partial`` in A leaves out."""
    model = mlp()
    objects = own_objects(model)
    tree_a, tree_b = random_tree(model, 1), random_tree(model, 2)
    partial_a = {"4": tree_a["4"]}
    with torch.no_grad():  # the module's own forward with each tree loaded
        expected_a = forward_with(model, tree_a, X)
        expected_b = forward_with(model, tree_b, X)
        expected_mix = forward_with(model, {**tree_b, "4": tree_a["4"]}, X)
    injected, done = threading.Event(), threading.Event()
    wrong = {"a": 0, "a partial": 0, "c": 0}
    seen: dict[str, dict[str, torch.Tensor]] = {}

    def holder() -> None:
        with ms.inject(model, tree_b):
            injected.set()
            done.wait()
            seen["extract"] = ms.flatten(ms.extract(model))

    def caller() -> None:
        injected.wait()
        with torch.no_grad():
            for _ in range(CALLS):
                wrong["a"] += not torch.equal(ms.call(model, tree_a, X), expected_a)
                mix = ms.call_partial(model, partial_a, X)
                wrong["a partial"] += not torch.equal(mix, expected_mix)

    def plain() -> None:
        injected.wait()
        with torch.no_grad():
            for _ in range(CALLS):
                wrong["c"] += not torch.equal(model(X), expected_b)

    threads = [threading.Thread(target=f) for f in (holder, caller, plain)]
    for thread in threads:
        thread.start()
    threads[1].join()
    threads[2].join()
    done.set()
    threads[0].join()
    assert wrong == {"a": 0, "a partial": 0, "c": 0}
    assert seen["extract"].keys() == ms.flatten(tree_b).keys()
    assert all(v is ms.flatten(tree_b)[k] for k, v in seen["extract"].items())
    assert_holds(model, objects)


def test_calls_with_their_own_trees_are_not_affected_by_load_in_another_thread():
    model = mlp()
    objects = own_objects(model)
    trees = [random_tree(model, seed) for seed in range(THREADS - 1)]
    sources = [random_tree(model, 10), random_tree(model, 11)]
    with torch.no_grad():
        expected = [ms.call(model, tree, X) for tree in trees]

    def work(i: int) -> int:
        with torch.no_grad():
            if i == THREADS - 1:  # loads new values into the module's own tensors meanwhile
                for n in range(CALLS):
                    ms.load(model, sources[n % 2])
                return 0
            return sum(
                not torch.equal(ms.call(model, trees[i], X), expected[i]) for _ in range(CALLS)
            )

    assert run_together(work) == [0] * THREADS
    assert_holds(model, objects)
    assert torch.equal(model[0].weight, sources[(CALLS - 1) % 2]["0"]["weight"])
