"""Calls from several threads that run one at a time, and what threads share.

Modules that rewrite tensors kept in ``__dict__`` (RNNs, legacy ``weight_norm``), lazy modules
before their first forward, and modules running ``torch.compile``d code take calls one at a time;
the others are not serialized. Plain attributes that ``forward`` assigns are shared: a data race
under threads, as with ``torch.func.functional_call``. As in test_threads.py, real threads start
together and every output is compared exactly."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

import modstate as ms

from threaded import (
    CALLS,
    THREADS,
    X,
    assert_holds,
    mlp,
    one_intra_op_thread_per_calling_thread,  # noqa: F401  (an autouse fixture)
    own_objects,
    random_tree,
)
from together import run_together


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
