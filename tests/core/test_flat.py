import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import modstate as ms

keys = st.text("abc_0", min_size=1, max_size=3)
trees = st.recursive(
    st.builds(torch.zeros, st.integers(0, 2)),
    lambda children: st.dictionaries(keys, children, min_size=1, max_size=3),
    max_leaves=12,
).filter(lambda t: isinstance(t, dict))


@given(trees)
def test_unflatten_undoes_flatten(tree):
    flat = ms.flatten(tree)
    assert ms.flatten(ms.unflatten(flat)) == flat
    assert all(isinstance(v, torch.Tensor) for v in flat.values())


def test_flatten_keeps_state_dict_order():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    assert list(ms.flatten(ms.extract(model))) == list(model.state_dict())


def test_extra_state_dicts_are_leaves():
    tree = {"block": {"weight": torch.ones(1), "_extra_state": {"calls": 3}}}
    assert ms.flatten(tree) == {
        "block.weight": tree["block"]["weight"],
        "block._extra_state": {"calls": 3},
    }
    assert ms.unflatten(ms.flatten(tree))["block"]["_extra_state"] == {"calls": 3}


def test_unflatten_refuses_a_leaf_that_is_also_a_prefix():
    with pytest.raises(ValueError, match="'a.b'"):
        ms.unflatten({"a": torch.ones(1), "a.b": torch.ones(1)})
    with pytest.raises(ValueError, match="'a'"):
        ms.unflatten({"a.b": torch.ones(1), "a": torch.ones(1)})
