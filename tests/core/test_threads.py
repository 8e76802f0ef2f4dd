"""Stateless calls from several threads on one module: each computes with its own tree.

Every test starts real threads together (a barrier), runs hundreds of calls in each, compares
every output exactly (``torch.equal``) with one computed beforehand in a single thread, counts the
wrong ones (there must be none), and checks that the module holds its own objects afterwards.
What is *not* per call (plain attributes that ``forward`` assigns) has its own test at the end.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

import modstate as ms

from zoo import forward_with

THREADS = 4
CALLS = 200


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread_per_calling_thread():
    """As a server would run (and fast on a machine with few cores): calling threads are the
    parallelism, torch's intra-op pool is one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_together(work: Callable[[int], int], threads: int = THREADS) -> list[int]:
    """Run ``work(i)`` in ``threads`` threads started at once; return what each returned (its
    count of wrong results), re-raising the first exception a thread met."""
    barrier = threading.Barrier(threads)
    results: list[int] = [0] * threads
    errors: list[BaseException] = []

    def target(i: int) -> None:
        barrier.wait()
        try:
            results[i] = work(i)
        except BaseException as error:  # re-raised in the main thread
            errors.append(error)

    pool = [threading.Thread(target=target, args=(i,)) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if errors:
        raise errors[0]
    return results


def leaves(tree: dict) -> list[torch.Tensor]:
    return list(ms.flatten(tree).values())


def own_objects(module: nn.Module) -> dict[str, torch.Tensor]:
    return ms.flatten(ms.extract(module))


def assert_holds(module: nn.Module, objects: dict[str, torch.Tensor]) -> None:
    now = own_objects(module)
    assert now.keys() == objects.keys()
    assert all(now[path] is tensor for path, tensor in objects.items())


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def random_tree(module: nn.Module, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return ms.tree.map(
        lambda t: (
            torch.randn(t.shape, generator=generator, dtype=t.dtype)
            if t.is_floating_point()
            else t.clone()
        ),
        ms.extract(module, detach=True),
    )


X = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))


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


class Meet(nn.Module):
    """Two calls meet inside forward (a barrier): if calls were serialized, neither would get
    past it. The layer is a parametrization (torch.nn.utils.parametrizations), which needs no
    lock, unlike the legacy weight_norm."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.utils.parametrizations.weight_norm(nn.Linear(8, 3))
        self.meet = threading.Barrier(2, timeout=10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self.meet.wait()
        return h + self.lin(x)  # the weights after meeting the other call: still this call's


def test_calls_are_not_serialized():
    model = Meet()
    objects = own_objects(model)
    trees = [random_tree(model, seed) for seed in range(2)]
    with torch.no_grad():
        expected = [2 * ms.call(model.lin, tree["lin"], X) for tree in trees]

    def work(i: int) -> int:
        with torch.no_grad():
            return sum(not torch.equal(ms.call(model, trees[i], X), expected[i]) for _ in range(50))

    assert run_together(work, threads=2) == [0, 0]
    assert_holds(model, objects)


class Flat(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x)
        return (out[0] if isinstance(out, tuple) else out).flatten(1)


def serialized_models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {
        "lstm": Flat(nn.LSTM(8, 4, batch_first=True)),
        "legacy weight_norm": Flat(nn.utils.weight_norm(nn.Linear(8, 4))),
        # eval: no power iteration, so every call of one tree gives the same output
        "legacy spectral_norm": Flat(nn.utils.spectral_norm(nn.Linear(8, 4))).eval(),
    }


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
@pytest.mark.parametrize("name", ["lstm", "legacy weight_norm", "legacy spectral_norm"])
def test_modules_that_rewrite_tensors_in_their_dict_run_calls_one_at_a_time(name):
    """An RNN rewrites ``_flat_weights``, legacy weight_norm ``module.weight``, in ``__dict__``
    where every thread sees them: modstate runs calls on them one at a time, so they stay exact,
    and puts those attributes back."""
    model = serialized_models()[name]
    x = torch.randn(2, 3, 8) if name == "lstm" else X
    model(x)  # the attributes exist, computed from the module's own tensors
    attributes = dict(vars(model.layer))
    objects = own_objects(model)
    trees = [random_tree(model, seed) for seed in range(THREADS)]
    with torch.no_grad():
        expected = [ms.call(model, tree, x) for tree in trees]

    def work(i: int) -> int:
        with torch.no_grad():
            return sum(
                not torch.equal(ms.call(model, trees[i], x), expected[i]) for _ in range(CALLS // 2)
            )

    assert run_together(work) == [0] * THREADS
    assert_holds(model, objects)
    kept = ("_flat_weights",) if name == "lstm" else ("weight",)
    assert all(vars(model.layer)[key] is attributes[key] for key in kept)


def test_a_lazy_module_stays_lazy_under_concurrent_calls():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(3))
    trees = [{"0": {"weight": torch.randn(3, 8), "bias": torch.randn(3)}} for _ in range(THREADS)]
    with torch.no_grad():
        expected = [ms.call_partial(model, tree, X) for tree in trees]
    assert nn.parameter.is_lazy(model[0].weight)

    def work(i: int) -> int:
        with torch.no_grad():
            return sum(
                not torch.equal(ms.call_partial(model, trees[i], X), expected[i])
                for _ in range(CALLS // 2)
            )

    assert run_together(work) == [0] * THREADS
    assert isinstance(model[0], nn.LazyLinear)
    assert nn.parameter.is_lazy(model[0].weight)


# -- what is shared: plain attributes that forward assigns -----------------------------------------


class RemembersBatch(nn.Module):
    """Assigns a plain attribute in forward and reads it back later in the same forward."""

    def __init__(self, pause: Callable[[int], None]) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)
        self.batch = 0
        self.pause = pause

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.batch = x.shape[0]  # a plain attribute: one for every thread
        self.pause(x.shape[0])
        return self.lin(x) * self.batch


def test_a_plain_attribute_forward_assigns_is_a_data_race():
    """Slots are per call; a plain attribute is not. Thread A (batch 2) assigns ``batch``, then
    thread B (batch 3) runs a whole call; A goes on with B's value, and its own weights."""
    a_assigned, b_done = threading.Event(), threading.Event()

    def pause(batch: int) -> None:
        if batch == 2:
            a_assigned.set()
            b_done.wait()

    model = RemembersBatch(pause)
    tree_a, tree_b = random_tree(model, 1), random_tree(model, 2)
    x_a, x_b = X[:2], X[:3]
    out: dict[str, torch.Tensor] = {}

    def call_a() -> None:
        with torch.no_grad():
            out["a"] = ms.call(model, tree_a, x_a)

    def call_b() -> None:
        a_assigned.wait()
        with torch.no_grad():
            out["b"] = ms.call(model, tree_b, x_b)
        b_done.set()

    threads = [threading.Thread(target=call_a), threading.Thread(target=call_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    def lin(tree: dict, x: torch.Tensor) -> torch.Tensor:
        return x @ tree["lin"]["weight"].T + tree["lin"]["bias"]

    assert torch.equal(out["b"], lin(tree_b, x_b) * 3)
    assert torch.equal(out["a"], lin(tree_a, x_a) * 3)  # A's weights, B's batch: the race
    assert not torch.equal(out["a"], lin(tree_a, x_a) * 2)  # what A computes alone
    assert model.batch == 3  # and afterwards, the value of whichever call assigned it last


@pytest.mark.slow
def test_compiled_calls_from_threads():
    """A ``torch.compile``d ``ms.call`` takes the tree as graph inputs: also exact from threads,
    beside a plain forward."""
    model = mlp()
    objects = own_objects(model)
    trees = [random_tree(model, seed) for seed in range(THREADS - 1)]
    compiled = torch.compile(lambda tree, x: ms.call(model, tree, x), fullgraph=True)
    with torch.no_grad():
        expected = [compiled(tree, X) for tree in trees] + [model(X)]

    def work(i: int) -> int:
        with torch.no_grad():
            if i == THREADS - 1:
                return sum(not torch.equal(model(X), expected[i]) for _ in range(CALLS))
            return sum(not torch.equal(compiled(trees[i], X), expected[i]) for _ in range(CALLS))

    assert run_together(work) == [0] * THREADS
    assert_holds(model, objects)


class FastHead(nn.Module):
    """Keeps a torch.compile'd submodule, as models that compile their blocks do."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = torch.compile(nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


@pytest.mark.slow
@pytest.mark.parametrize(
    "make",
    ["torch.compile(model)", "model.compile() after a call", "compiled submodule", "Ensemble"],
)
def test_modules_running_compiled_code_compute_with_the_tree_one_call_at_a_time(make):
    """Compiled code reads a module's dicts directly, past the per-thread layers: calls on a
    module that keeps compiled code swap for every thread (as before) and run one at a time."""
    torch.manual_seed(0)
    if make == "torch.compile(model)":
        model: nn.Module = torch.compile(mlp())
    elif make == "model.compile() after a call":
        model = mlp()
        ms.call(model, ms.extract(model), X)
        model.compile()
    elif make == "compiled submodule":
        model = FastHead()
    else:
        model = ms.Ensemble([mlp() for _ in range(2)], compile=True)
    model(X)
    objects = own_objects(model)
    trees = [random_tree(model, seed) for seed in range(3)]
    reference = copy.deepcopy(model)
    with torch.no_grad():
        expected = []
        for tree in trees:
            ms.swap(reference, tree)  # the tree put in for good: what the call must compute
            expected.append(reference(X))

    def work(i: int) -> int:
        with torch.no_grad():
            return sum(
                not torch.allclose(ms.call(model, trees[i], X), expected[i], atol=1e-6)
                for _ in range(CALLS // 4)
            )

    assert run_together(work, threads=3) == [0, 0, 0]
    assert_holds(model, objects)


@pytest.mark.slow
def test_a_compiled_function_kept_outside_the_module_reads_the_modules_own_tensors():
    """The limit of the above: modstate cannot see a compiled function that the module does not
    keep; run inside a call, it reads the module's own tensors (pass them as arguments)."""
    model = mlp()
    first_layer = torch.compile(lambda x: model[0](x))
    tree = random_tree(model, 1)
    with torch.no_grad():
        first_layer(X)
        inside: dict[str, torch.Tensor] = {}
        handle = model[0].register_forward_hook(lambda *_: inside.setdefault("out", first_layer(X)))
        ms.call(model, tree, X)
        handle.remove()
        assert torch.equal(inside["out"], model[0](X))
