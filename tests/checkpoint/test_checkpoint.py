"""modstate.checkpoint on one machine: safetensors files that never unpickle.

The distributed half (``save_distributed`` / ``load_distributed``) is tested with real process
groups in tests/distributed/.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import warnings
import zlib

import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import modstate as ms
from modstate import checkpoint
from modstate.checkpoint._leaves import SAFETENSORS_DTYPES


def assert_same_tree(actual, expected):
    """Same keys in the same order, same dtypes, shapes and values (bitwise)."""
    assert list(actual) == list(expected)
    for key, want in expected.items():
        got = actual[key]
        if isinstance(want, dict) and key != "_extra_state":
            assert_same_tree(got, want)
        elif isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor), key
            assert (got.dtype, got.shape) == (want.dtype, want.shape), key
            assert torch.equal(_bits(got), _bits(want.detach())), key
        else:
            assert got == want and type(got) is type(want), key


def _bits(tensor):
    """Compare float8 and friends by their bytes (not every dtype implements ==)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def files_in(directory):
    return sorted(os.listdir(directory))


# --- round trips ---------------------------------------------------------------------------


def test_model_tree_round_trips_and_loads_into_a_fresh_model(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.BatchNorm1d(4))
    model(torch.randn(5, 3))  # non-trivial running statistics
    path = tmp_path / "model.safetensors"

    checkpoint.save(ms.extract(model), path)
    tree = checkpoint.load(path)

    assert_same_tree(tree, ms.extract(model))
    assert not any(leaf.requires_grad for leaf in ms.flatten(tree).values())
    fresh = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.BatchNorm1d(4))
    ms.load(fresh, tree)
    x = torch.randn(2, 3)
    assert torch.equal(fresh.eval()(x), model.eval()(x))


@pytest.mark.parametrize("dtype", sorted(SAFETENSORS_DTYPES, key=str), ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (2, 3)], ids=["0-d", "empty", "2x3"])
def test_every_safetensors_dtype_and_shape_round_trips(tmp_path, dtype, shape):
    values = torch.randn(shape) * 10
    if dtype == torch.bool:
        leaf = values > 0
    elif dtype.is_floating_point or dtype.is_complex:
        leaf = values.to(dtype)
    else:
        leaf = values.abs().to(torch.int64).to(dtype)
    checkpoint.save({"block": {"x": leaf}}, tmp_path / "t.safetensors")

    assert_same_tree(checkpoint.load(tmp_path / "t.safetensors"), {"block": {"x": leaf}})


_keys = st.text("abcxyz_0123", min_size=1, max_size=3)
_leaves = st.builds(
    lambda shape, dtype: torch.randn(shape).to(dtype),
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int32]),
)
_trees = st.recursive(
    _leaves, lambda children: st.dictionaries(_keys, children, min_size=1, max_size=3), max_leaves=8
).filter(lambda tree: isinstance(tree, dict))


@settings(max_examples=25, deadline=None)
@given(tree=_trees)
def test_random_trees_round_trip_with_their_order(tmp_path_factory, tree):
    path = tmp_path_factory.mktemp("random") / "tree.safetensors"
    checkpoint.save(tree, path)
    assert_same_tree(checkpoint.load(path), tree)


def test_order_is_the_trees_not_alphabetical(tmp_path):
    tree = {"z": {"weight": torch.ones(1)}, "a": {"weight": torch.zeros(1), "bias": torch.ones(2)}}
    checkpoint.save(tree, tmp_path / "t.safetensors")
    assert ms.flatten(checkpoint.load(tmp_path / "t.safetensors")).keys() == ms.flatten(tree).keys()


def test_load_moves_tensors_to_the_requested_device(tmp_path):
    tied = torch.ones(3)
    checkpoint.save({"a": tied, "b": tied}, tmp_path / "t.safetensors")

    tree = checkpoint.load(tmp_path / "t.safetensors", device="meta")

    assert tree["a"].device.type == "meta"
    assert tree["a"] is tree["b"]  # a tie moves as one tensor


def test_empty_subtrees_hold_no_state_and_are_not_stored(tmp_path):
    checkpoint.save({"empty": {}, "full": {"w": torch.ones(2), "inner": {}}}, tmp_path / "t.st")
    assert_same_tree(checkpoint.load(tmp_path / "t.st"), {"full": {"w": torch.ones(2)}})


def test_a_plain_safetensors_file_from_another_tool_loads_as_a_tree(tmp_path):
    safetensors.torch.save_file(
        {"encoder.layer.weight": torch.ones(2, 2), "head.bias": torch.zeros(2)},
        tmp_path / "hub.safetensors",
    )
    tree = checkpoint.load(tmp_path / "hub.safetensors")
    assert tree["encoder"]["layer"]["weight"].shape == (2, 2)
    assert torch.equal(tree["head"]["bias"], torch.zeros(2))


def test_the_file_is_an_ordinary_safetensors_file(tmp_path):
    checkpoint.save({"0": {"weight": torch.ones(2, 2)}}, tmp_path / "t.safetensors")
    loaded = safetensors.torch.load_file(tmp_path / "t.safetensors")
    assert torch.equal(loaded["0.weight"], torch.ones(2, 2))


# --- non-tensor leaves ---------------------------------------------------------------------


class WithExtraState(nn.Module):
    def __init__(self, extra):
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.extra = extra

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state):
        self.extra = state


def test_json_extra_state_is_kept(tmp_path):
    extra = {"version": 3, "scale": 0.5, "names": ["a", "b"], "flags": {"on": True}, "none": None}
    model = WithExtraState(extra)
    tree = ms.extract(model, use_state_dict=True)
    assert tree["_extra_state"] == extra

    checkpoint.save(tree, tmp_path / "t.safetensors")
    loaded = checkpoint.load(tmp_path / "t.safetensors")

    assert_same_tree(loaded, tree)
    assert ms.flatten(loaded).keys() == model.state_dict().keys()


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3)
        | st.lists(children, max_size=3).map(tuple)  # the record says where tuples were
        | st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=40, deadline=None)
@given(extra=_json_values)
def test_any_json_value_round_trips_as_a_leaf(tmp_path_factory, extra):
    path = tmp_path_factory.mktemp("json") / "t.safetensors"
    checkpoint.save({"block": {"_extra_state": extra, "weight": torch.ones(1)}}, path)
    assert checkpoint.load(path)["block"]["_extra_state"] == extra  # [1] != (1,): kinds kept


def test_tuples_come_back_as_tuples_and_lists_as_lists(tmp_path):
    extra = {"betas": (0.9, 0.999), "shape": [2, (3, [4, ()])], "pair": ([], {"a": (1,)})}
    checkpoint.save({"_extra_state": extra, "w": torch.ones(1)}, tmp_path / "t.safetensors")
    loaded = checkpoint.load(tmp_path / "t.safetensors")["_extra_state"]
    assert loaded == extra
    assert type(loaded["shape"]) is list and type(loaded["shape"][1]) is tuple
    assert type(loaded["shape"][1][1]) is list and type(loaded["pair"][0]) is list


@pytest.mark.parametrize(
    ("extra", "complaint"),
    [
        ({1, 2}, "set value is not JSON"),
        (torch.Size([1, 2]), "Size value is not JSON"),
        ({1: "a"}, "dict key 1"),
        (float("nan"), "not finite"),
        ({"t": torch.ones(1)}, "tensor inside"),
        (object(), "object value is not JSON"),
    ],
    ids=["set", "torch.Size", "int-key", "nan", "tensor-inside", "object"],
)
def test_non_json_leaves_are_refused_naming_the_path_and_nothing_is_written(
    tmp_path, extra, complaint
):
    tree = {"block": {"weight": torch.ones(1), "_extra_state": extra}}
    with pytest.raises(TypeError, match=complaint) as error:
        checkpoint.save(tree, tmp_path / "t.safetensors")
    assert "'block._extra_state'" in str(error.value)
    assert files_in(tmp_path) == []


# --- refusals before writing ---------------------------------------------------------------


def _quantized():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated, but still exist
        return torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)


@pytest.mark.parametrize(
    ("make_leaf", "complaint"),
    [
        (lambda: torch.ones(2, dtype=torch.complex128), "dtype torch.complex128"),
        (lambda: torch.eye(2).to_sparse(), "not dense"),
        (_quantized, "quantized"),
        (lambda: torch.empty(2, device="meta"), "meta tensor"),
    ],
    ids=["complex128", "sparse", "quantized", "meta"],
)
def test_tensors_safetensors_cannot_hold_are_refused_naming_the_path(
    tmp_path, make_leaf, complaint
):
    tree = {"ok": torch.ones(1), "layer": {"w": make_leaf()}}
    with pytest.raises((TypeError, ValueError), match=complaint) as error:
        checkpoint.save(tree, tmp_path / "t.safetensors")
    assert "'layer.w'" in str(error.value)
    assert files_in(tmp_path) == []


def test_keys_with_dots_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"'a\.b' under 'outer'"):
        checkpoint.save({"outer": {"a.b": torch.ones(1)}}, tmp_path / "t.safetensors")
    assert files_in(tmp_path) == []


def test_a_tree_must_be_a_dict(tmp_path):
    with pytest.raises(TypeError, match="got list"):
        checkpoint.save([torch.ones(1)], tmp_path / "t.safetensors")


# --- shared memory -------------------------------------------------------------------------


@pytest.mark.parametrize("from_state_dict", [False, True], ids=["extract", "state_dict"])
def test_tied_weights_are_stored_once_and_load_as_one_tensor(tmp_path, from_state_dict):
    embed = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "head": head})
    # extract gives the tie as one object at two paths; state_dict() as two distinct objects
    # viewing the same memory. Both are ties.
    if from_state_dict:
        tree = ms.unflatten(model.state_dict())
        assert tree["embed"]["weight"] is not tree["head"]["weight"]
    else:
        tree = ms.extract(model)
        assert tree["embed"]["weight"] is tree["head"]["weight"]
    path = tmp_path / "tied.safetensors"

    checkpoint.save(tree, path)
    loaded = checkpoint.load(path)

    with safetensors.safe_open(path, framework="pt") as handle:
        assert list(handle.keys()) == ["embed.weight"]
    assert loaded["embed"]["weight"] is loaded["head"]["weight"]
    assert torch.equal(loaded["head"]["weight"], embed.weight)


def test_overlapping_views_are_stored_as_independent_copies(tmp_path):
    base = torch.arange(10.0)
    tree = {"front": base[:6], "back": base[4:], "strided": base[::3], "whole": base}

    checkpoint.save(tree, tmp_path / "views.safetensors")
    loaded = checkpoint.load(tmp_path / "views.safetensors")

    assert_same_tree(loaded, tree)
    loaded["front"][5] = -1.0
    assert loaded["back"][1] == 5.0 and loaded["whole"][5] == 5.0


def test_non_contiguous_tensors_round_trip(tmp_path):
    matrix = torch.randn(3, 4)
    tree = {"transposed": matrix.t(), "expanded": torch.ones(3, 1).expand(3, 5)}
    checkpoint.save(tree, tmp_path / "t.safetensors")
    assert_same_tree(checkpoint.load(tmp_path / "t.safetensors"), tree)


def test_parameters_that_require_grad_save_as_their_values(tmp_path):
    weight = nn.Parameter(torch.randn(2, 2))
    checkpoint.save({"w": weight * 1}, tmp_path / "t.safetensors")  # a non-leaf, with grad_fn
    loaded = checkpoint.load(tmp_path / "t.safetensors")["w"]
    assert torch.equal(loaded, weight.detach()) and not loaded.requires_grad


# --- untrusted and damaged files -----------------------------------------------------------


class CreatesAFileWhenUnpickled:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_pickle_renamed_to_safetensors_is_refused_and_runs_no_code(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "model.safetensors"
    evil.write_bytes(pickle.dumps(CreatesAFileWhenUnpickled(marker)))
    assert not marker.exists()

    with pytest.raises(ValueError, match=r"^checkpoint\.load: '.*model\.safetensors': a pickle"):
        checkpoint.load(evil)

    assert not marker.exists()


@pytest.mark.parametrize("zipped", [True, False], ids=["torch.save", "legacy torch.save"])
def test_the_fix_for_a_torch_save_file_works(tmp_path, zipped):
    tree = {"w": torch.arange(3.0), "b": torch.ones(2)}
    path = tmp_path / "model.pt"
    torch.save(tree, path, _use_new_zipfile_serialization=zipped)
    with pytest.raises(ValueError, match="torch.load.path, weights_only=True.*checkpoint.save"):
        checkpoint.load(path)
    converted = tmp_path / "model.safetensors"
    checkpoint.save(torch.load(path, weights_only=True), converted)  # the fix, if trusted
    assert_same_tree(checkpoint.load(converted), tree)


def test_a_torch_save_archive_is_refused_and_runs_no_code(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "model.safetensors"
    torch.save({"w": torch.ones(1), "payload": CreatesAFileWhenUnpickled(marker)}, evil)

    with pytest.raises(ValueError, match="zip archive"):
        checkpoint.load(evil)

    assert not marker.exists()


@pytest.mark.parametrize(
    "content", [b"", b"abc", b"\xff" * 64, struct.pack("<Q", 4) + b"[1]!"], ids=repr
)
def test_other_files_are_refused(tmp_path, content):
    (tmp_path / "junk.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match=r"junk\.safetensors"):
        checkpoint.load(tmp_path / "junk.safetensors")


def test_a_missing_file_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothing\.safetensors"):
        checkpoint.load(tmp_path / "nothing.safetensors")


@pytest.fixture
def saved_file(tmp_path):
    path = tmp_path / "t.safetensors"
    checkpoint.save({"layer": {"weight": torch.randn(16, 16), "bias": torch.randn(16)}}, path)
    return path


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_a_truncated_file_is_refused(saved_file, keep):
    data = saved_file.read_bytes()
    saved_file.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match="truncated"):
        checkpoint.load(saved_file)


def test_flipped_tensor_bytes_fail_the_checksum(saved_file):
    data = bytearray(saved_file.read_bytes())
    data[-3] ^= 0xFF  # inside the last tensor's data
    saved_file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"corrupted: the bytes of tensor 'layer\."):
        checkpoint.load(saved_file)


def replace_in_header(path, old, new):
    data = path.read_bytes()
    header_length = struct.unpack("<Q", data[:8])[0]
    header = data[8 : 8 + header_length]
    assert old in header
    path.write_bytes(data[:8] + header.replace(old, new, 1) + data[8 + header_length :])


def test_a_damaged_safetensors_header_is_refused(saved_file):
    replace_in_header(saved_file, b'"dtype"', b'"dtypo"')
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        checkpoint.load(saved_file)


def test_a_damaged_modstate_record_is_refused(saved_file):
    replace_in_header(saved_file, b"order", b"orde!")
    with pytest.raises(ValueError, match="corrupted modstate record"):
        checkpoint.load(saved_file)


def test_a_record_that_places_a_tuple_where_no_list_is_is_refused(tmp_path):
    path = tmp_path / "t.safetensors"
    checkpoint.save({"w": torch.ones(1), "groups": [{"betas": (0.9, 0.99), "decay": 1}]}, path)
    # The same length keeps the header readable; the record escapes its quotes.
    replace_in_header(path, b'\\"betas\\"]', b'\\"decay\\"]')
    with pytest.raises(ValueError, match=r"'groups': the record places a tuple at \[0, 'decay'"):
        checkpoint.load(path)


def write_with_record(path, tensors, record_text):
    """A safetensors file whose modstate record is ``record_text``, made by hand."""
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt", "modstate": record_text})


def test_a_record_nested_too_deep_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "deep.safetensors"
    write_with_record(path, {"w": torch.ones(2)}, "[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"^checkpoint\.load: '.*deep\.safetensors': .*nested"):
        checkpoint.load(path)


_paths = st.sampled_from(["w", "b", "v", "w.x", "v.y", "", "a..b"])
_fields = st.none() | st.integers() | st.text(max_size=3) | st.lists(_paths, max_size=4)
_fields |= st.dictionaries(_paths, _paths | st.integers() | st.none(), max_size=3)


@settings(max_examples=80, deadline=None)
@given(
    extra=st.lists(_paths, max_size=3, unique=True),
    changes=st.dictionaries(st.sampled_from(["order", "ties", "values", "crc32"]), _fields),
)
def test_any_damaged_record_loads_or_is_a_value_error_naming_the_file(
    tmp_path_factory, extra, changes
):
    tensors = {"w": torch.ones(2), "b": torch.zeros(3)}
    record = {
        "version": 1,
        "order": ["w", "b", "v", *extra],  # extra paths hold values: they may conflict
        "ties": {},
        "values": {"v": 1, **dict.fromkeys(extra, 2)},
        "crc32": {path: zlib.crc32(t.numpy().tobytes()) for path, t in tensors.items()},
        **changes,
    }
    path = tmp_path_factory.mktemp("damaged") / "damaged.safetensors"
    write_with_record(path, tensors, json.dumps(record))
    try:
        checkpoint.load(path)
    except ValueError as error:
        assert str(error).startswith(f"checkpoint.load: {str(path)!r}: "), error


def test_a_record_with_an_int_past_pythons_digit_limit_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "digits.safetensors"
    record = '{"version": 1, "order": ["w"], "ties": {}, "values": {}, "crc32": {"w": 1%s}}'
    write_with_record(path, {"w": torch.ones(2)}, record % ("0" * 5000))
    with pytest.raises(
        ValueError, match=r"^checkpoint\.load: '.*digits\.safetensors': .*corrupted"
    ):
        checkpoint.load(path)


def test_a_record_whose_paths_conflict_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "conflict.safetensors"
    weight = torch.ones(2)
    record = {
        "version": 1,
        "order": ["w", "w.x"],
        "ties": {},
        "values": {"w": 1},
        "crc32": {"w.x": zlib.crc32(weight.numpy().tobytes())},
    }
    write_with_record(path, {"w.x": weight}, json.dumps(record))
    with pytest.raises(
        ValueError,
        match=r"^checkpoint\.load: '.*conflict\.safetensors': .*'w' is a leaf and 'w\.x'",
    ):
        checkpoint.load(path)


def test_a_foreign_file_whose_names_conflict_is_refused_and_the_fix_works(tmp_path):
    path = tmp_path / "foreign.safetensors"
    tensors = {"w": torch.ones(2), "w.x": torch.zeros(3)}
    safetensors.torch.save_file(tensors, path)  # no modstate record
    with pytest.raises(
        ValueError, match=r"'.*foreign\.safetensors': .*'w' is a leaf and 'w\.x'.*load_file"
    ):
        checkpoint.load(path)
    flat = safetensors.torch.load_file(path)  # the fix: the flat names
    assert sorted(flat) == ["w", "w.x"] and torch.equal(flat["w.x"], torch.zeros(3))


def test_arguments_in_the_wrong_order_name_the_order_and_the_fix_works(tmp_path):
    tree = ms.extract(torch.nn.Linear(3, 2), detach=True)
    path = str(tmp_path / "linear.safetensors")
    with pytest.raises(TypeError, match=r"the tree comes first.*checkpoint\.save\(tree, '"):
        ms.checkpoint.save(path, tree)
    assert not (tmp_path / "linear.safetensors").exists()
    ms.checkpoint.save(tree, path)  # the order the message names
    assert torch.equal(ms.checkpoint.load(path)["weight"], tree["weight"])
