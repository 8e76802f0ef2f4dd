"""The slot tables a stateless call overlays per thread: what torch and other threads see.

Once modstate has seen a module, its ``_parameters`` / ``_buffers`` dicts are ``SlotTable``s (the
same entries; see ``_core/tables.py``). Pickling, ``torch.save``, ``copy.deepcopy``,
``state_dict``, ``named_parameters`` and ``torch.compile`` must see exactly what they saw before,
also while another thread is inside a call; inside a call, the calling thread sees the call's
tree, as if it had been swapped in.
"""

from __future__ import annotations

import copy
import io
import pickle
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

import modstate as ms
from modstate._core.module.tables import SlotTable

X = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Linear(5, 2)).eval()


def other_tree(module: nn.Module) -> dict:
    return ms.tree.map(lambda t: t + 1, ms.extract(module, detach=True))


def own(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def test_modstate_lays_slot_tables_over_a_modules_dicts_once():
    m = model()
    assert type(m[0]._parameters) is dict
    ms.call(m, other_tree(m), X)
    tables = [m[0]._parameters, m[1]._buffers]
    assert type(tables[0]).__name__ == "SlotTable" and isinstance(tables[0], dict)
    ms.call(m, other_tree(m), X)
    assert m[0]._parameters is tables[0] and m[1]._buffers is tables[1]


def test_pickle_torch_save_and_deepcopy_give_plain_modules():
    m = model()
    ms.call(m, other_tree(m), X)
    expected = m(X)
    data = pickle.dumps(m)
    assert b"modstate" not in data  # unpickling imports nothing of modstate
    buffer = io.BytesIO()
    torch.save(m, buffer)
    buffer.seek(0)
    copies = [pickle.loads(data), torch.load(buffer, weights_only=False), copy.deepcopy(m)]
    for twin in copies:
        assert all(type(sub._parameters) is dict for sub in twin.modules())
        assert all(type(sub._buffers) is dict for sub in twin.modules())
        assert torch.equal(twin(X), expected)
        assert all(a is not b for a, b in zip(own(twin).values(), own(m).values(), strict=True))
    buffer = io.BytesIO()
    torch.save(m.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded.keys() == m.state_dict().keys()


class Pause:
    """A forward pre-hook that holds one thread (``ident``) until ``release`` is set; a pickled or
    copied one holds no thread."""

    def __init__(self) -> None:
        self.inside, self.release = threading.Event(), threading.Event()
        self.ident: int | None = None

    def __call__(self, module: nn.Module, args: Any) -> None:
        if threading.get_ident() == self.ident:
            self.inside.set()
            self.release.wait()

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]


@contextmanager
def paused_inside_a_call(m: nn.Module, tree: dict) -> Iterator[dict[str, Any]]:
    """Run ``ms.call(m, tree, X)`` in another thread and hold it inside ``forward`` (in the last
    layer's pre-hook) for the body of the block; the call's output is in ``result["out"]``."""
    pause = Pause()
    result: dict[str, Any] = {}

    def target() -> None:
        pause.ident = threading.get_ident()
        result["out"] = ms.call(m, tree, X)

    handle = m[-1].register_forward_pre_hook(pause)
    thread = threading.Thread(target=target)
    thread.start()
    try:
        assert pause.inside.wait(10)
        yield result
    finally:
        pause.release.set()
        thread.join()
        handle.remove()


def test_while_another_thread_is_inside_a_call_this_one_sees_the_modules_own():
    m = model()
    tree = other_tree(m)
    objects = own(m)
    expected, expected_call = m(X), ms.call(m, tree, X)
    with paused_inside_a_call(m, tree) as result:
        assert all(v is objects[k] for k, v in m.state_dict(keep_vars=True).items())
        assert all(v is objects[k] for k, v in own(m).items())
        assert ms.flatten(ms.extract(m)).keys() == objects.keys()
        assert all(v is objects[k] for k, v in ms.flatten(ms.extract(m)).items())
        assert m[0].weight is objects["0.weight"]
        assert torch.equal(m(X), expected)
        assert torch.equal(pickle.loads(pickle.dumps(m))(X), expected)
        assert torch.equal(copy.deepcopy(m)(X), expected)
        buffer = io.BytesIO()
        torch.save(m, buffer)
        buffer.seek(0)
        assert torch.equal(torch.load(buffer, weights_only=False)(X), expected)
    assert torch.equal(result["out"], expected_call)


def test_inside_a_call_the_calling_thread_sees_the_calls_tree():
    """As if the tree were swapped in: attributes, state_dict, parameters(), extract."""
    m = model()
    tree = other_tree(m)
    flat = ms.flatten(tree)
    seen: dict[str, Any] = {}

    def hook(module: nn.Module, args: Any) -> None:
        seen["weight"] = m[0].weight
        seen["state_dict"] = m.state_dict(keep_vars=True)
        seen["parameters"] = dict(m.named_parameters())
        seen["extract"] = ms.flatten(ms.extract(m))

    handle = m[-1].register_forward_pre_hook(hook)
    ms.call(m, tree, X)
    handle.remove()
    assert seen["weight"] is flat["0.weight"]
    assert all(seen["state_dict"][k] is v for k, v in flat.items())
    assert seen["parameters"].keys() == dict(m.named_parameters()).keys()
    assert all(seen["parameters"][k] is flat[k] for k in seen["parameters"])
    assert all(seen["extract"][k] is v for k, v in flat.items())
    assert ms.flatten(ms.extract(m)).keys() == own(m).keys()
    assert all(v is own(m)[k] for k, v in ms.flatten(ms.extract(m)).items())


class Outer(nn.Module):
    """Runs ``inner`` on its second layer with another tree, from inside its own forward."""

    def __init__(self, inner: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.inner(self.b, h) + self.b(h)  # the second self.b: the outer call's again


def linear(tree: dict, x: torch.Tensor) -> torch.Tensor:
    return x @ tree["weight"].T + tree["bias"]


@pytest.mark.parametrize("how", ["call", "call_partial", "inject", "functional_call"])
def test_a_nested_swap_of_a_submodule_is_seen_by_the_body_and_undone(how):
    torch.manual_seed(0)
    inner_tree = ms.extract(nn.Linear(3, 3), detach=True)

    def inner(b: nn.Module, h: torch.Tensor) -> torch.Tensor:
        if how == "call":
            return ms.call(b, inner_tree, h)
        if how == "call_partial":
            return ms.call_partial(b, {"weight": inner_tree["weight"]}, h)
        if how == "functional_call":
            return torch.func.functional_call(b, inner_tree, (h,))
        with ms.inject(b, inner_tree):
            return b(h)

    m = Outer(inner)
    objects = own(m)
    tree = other_tree(m)
    out = ms.call(m, tree, X)
    h = linear(tree["a"], X)
    given = inner_tree if how != "call_partial" else {**tree["b"], "weight": inner_tree["weight"]}
    assert torch.allclose(out, linear(given, h) + linear(tree["b"], h))
    assert all(v is objects[k] for k, v in own(m).items())


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 1
        return self.lin(x)


def test_a_buffer_reassigned_in_a_nested_call_of_a_submodule_goes_to_the_enclosing_calls_tree():
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.counter = Counter()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # The inner call gives only the Linear: the buffer is the outer call's.
            return ms.call_partial(self.counter, {"lin": lin_tree}, x)

    lin_tree = ms.extract(nn.Linear(3, 3), detach=True)
    m = Wrapper()
    tree = ms.extract(m, detach=True)
    ms.call(m, tree, X)
    ms.call(m, tree, X)
    assert int(tree["counter"]["count"]) == 2
    assert int(m.counter.count) == 0


@pytest.mark.slow
def test_torch_compile_of_a_called_module_even_while_another_thread_is_inside_a_call():
    m = model()
    tree = other_tree(m)
    ms.call(m, tree, X)  # the tables are SlotTables from here on
    expected = m(X)
    compiled = torch.compile(m, fullgraph=True)
    assert torch.allclose(compiled(X), expected)
    with torch._dynamo.config.patch(error_on_recompile=True):
        with paused_inside_a_call(m, tree):
            assert torch.allclose(compiled(X), expected)
    traced = torch.compile(lambda t, x: ms.call(m, t, x), fullgraph=True)
    assert torch.allclose(traced(tree, X), ms.call(m, tree, X))


class Tracked(dict):
    """A dict subclass another library might put in ``_parameters``."""


def test_a_table_of_another_dict_type_is_left_alone_and_calls_swap_for_everyone():
    m = nn.Linear(3, 2)
    m.__dict__["_parameters"] = Tracked(m._parameters)
    tree = other_tree(m)
    out = ms.call(m, tree, X)
    assert type(m._parameters) is Tracked
    assert torch.equal(out, X @ tree["weight"].T + tree["bias"])
    assert m.weight is own(m)["weight"] and not torch.equal(m.weight, tree["weight"])


@pytest.mark.filterwarnings("ignore:`torch.jit.*is deprecated:DeprecationWarning")
def test_torchscript_fx_and_export_of_a_called_module():
    m = model()
    ms.call(m, other_tree(m), X)
    expected = m(X)
    assert torch.equal(torch.jit.script(m)(X), expected)
    assert torch.equal(torch.jit.trace(m, (X,))(X), expected)
    assert torch.equal(torch.fx.symbolic_trace(m)(X), expected)
    assert torch.allclose(torch.export.export(m, (X,)).module()(X), expected)


def test_a_table_tells_its_watchers_when_an_own_entry_is_replaced_or_deleted_not_a_layers():
    # How an anatomy learns that the module let go of a tensor (see anatomy.py's Stale).
    net = model()
    ms.extract(net)  # the tables are SlotTables from here on
    table = net[0]._parameters
    assert isinstance(table, SlotTable)
    told: list[str] = []

    class Watcher:
        def __call__(self) -> None:
            told.append("changed")

    watcher = Watcher()
    table.watch(watcher)
    net[0].weight = net[0].weight  # the same object again: nothing changed
    assert told == []
    with torch.no_grad():
        ms.call(net, other_tree(net), X)  # a call writes its thread's layer, not the table
    assert told == []
    net[0].weight = nn.Parameter(torch.zeros(5, 3))
    assert told == ["changed"]
    table.watch(watcher)
    del net[0].bias
    assert told == ["changed", "changed"]
    net[0].bias = nn.Parameter(torch.zeros(5))
    assert told == ["changed", "changed"]  # told once, then forgotten until watched again
