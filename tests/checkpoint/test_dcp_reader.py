"""A distributed checkpoint from anyone runs no code: crafted DCP directories, loaded in one
process.

Each crafted checkpoint holds a pickle that, if it were unpickled as ``torch.distributed.checkpoint``
does, would create a marker directory. ``load_distributed`` must refuse it with a ``ValueError``
naming the checkpoint and what was refused, the marker must not exist afterwards, and ``like``
must be unchanged. ``weights_only=False`` is the way to load a checkpoint you trust, and the
tests apply it. The same refusals on ranks of a process group are in
tests/distributed/test_distributed_checkpoint.py.
"""

from __future__ import annotations

import builtins
import dataclasses
import operator
import os
import pickle
import re
import subprocess
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import modstate as ms
import modstate.tree  # ms.tree
from modstate import checkpoint


class Calls:
    """Unpickles as ``function(*args)``: what a crafted pickle does."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return (self.function, self.args)


class ThenGives:
    """Unpickles as ``value``, after calling ``first`` (a payload that leaves a valid result)."""

    def __init__(self, first, value):
        self.first, self.value = first, value

    def __reduce__(self):
        return (operator.itemgetter(1), ((self.first, self.value),))


@dataclasses.dataclass
class Config:
    """A value of the user's own class: pickled by DCP, so only loaded when trusted."""

    width: int
    activation: str


def payloads(marker):
    """Pickled calls that create ``marker``, each through another function."""
    return {
        "posix.mkdir": Calls(os.mkdir, str(marker)),
        "builtins.eval": Calls(builtins.eval, f"__import__('os').mkdir({str(marker)!r})"),
        "subprocess.Popen": Calls(subprocess.Popen, ["mkdir", str(marker)]),
    }


@pytest.fixture
def saved(tmp_path):
    """A save_distributed checkpoint (tensors, a step, tuple and dict values) and its like."""
    tree = {
        "model": ms.extract(torch.nn.Linear(3, 2)),
        "step": 12,
        "optimizer": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.999)}]},
    }
    directory = tmp_path / "step-12"
    checkpoint.save_distributed(tree, directory)
    like = {
        "model": ms.tree.zeros_like(tree["model"]),
        "step": None,
        "optimizer": {"param_groups": None},
    }
    return directory, like, tree


def torch_save(state, directory) -> None:
    """What torch's own ``dcp.save`` writes, in this one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(directory), no_dist=True)


def read_metadata(directory) -> Metadata:
    return dcp.FileSystemReader(str(directory)).read_metadata()  # of a checkpoint we wrote


def write_metadata(directory, obj) -> None:
    (directory / ".metadata").write_bytes(pickle.dumps(obj))


def assert_refused(directory, like, marker, match):
    """The load raises a ValueError naming ``directory`` and matching ``match``, creates no
    ``marker``, and leaves ``like`` as it was."""
    before = ms.tree.clone(like)
    with pytest.raises(ValueError) as info:
        checkpoint.load_distributed(directory, like)
    message = str(info.value)
    assert message.startswith(f"checkpoint.load_distributed: {str(directory)!r}: "), message
    assert re.search(match, message), message
    assert not marker.exists()
    assert list(ms.flatten(like)) == list(ms.flatten(before))
    for path, leaf in ms.flatten(before).items():
        now = ms.flatten(like)[path]
        assert torch.equal(now, leaf) if isinstance(leaf, torch.Tensor) else now == leaf, path
    return message


# --- .metadata ----------------------------------------------------------------------------


@pytest.mark.parametrize("function", ["posix.mkdir", "builtins.eval", "subprocess.Popen"])
def test_a_metadata_pickle_that_calls_a_function_is_refused_before_the_call(
    saved, tmp_path, function
):
    directory, like, _ = saved
    marker = tmp_path / "marker"
    metadata = read_metadata(directory)
    metadata.version = payloads(marker)[function]  # hidden in an otherwise valid .metadata
    write_metadata(directory, metadata)

    message = assert_refused(directory, like, marker, rf"\.metadata names {re.escape(function)},")
    assert "refused without being called" in message
    assert "load_distributed(directory, like, weights_only=False)" in message


def test_a_metadata_that_is_only_a_call_is_refused(saved, tmp_path):
    directory, like, _ = saved
    marker = tmp_path / "marker"
    write_metadata(directory, Calls(os.mkdir, str(marker)))
    assert_refused(directory, like, marker, r"\.metadata names posix\.mkdir,")


@pytest.mark.parametrize(
    "content", [b"", b"not a pickle at all", b"\x80\x04\x95garbage", b"\x80\x04N."], ids=repr
)
def test_a_metadata_that_is_not_a_dcp_pickle_is_refused(saved, tmp_path, content):
    directory, like, _ = saved
    (directory / ".metadata").write_bytes(content)
    assert_refused(
        directory, like, tmp_path / "marker", r"\.metadata is not (a readable )?DCP metadata"
    )


def _without_field(metadata: Metadata) -> Metadata:
    bare = Metadata.__new__(Metadata)  # no state_dict_metadata at all
    bare.storage_data = metadata.storage_data
    return bare


def _tensor_with_size(metadata: Metadata, size) -> Metadata:
    entry = metadata.state_dict_metadata["model.weight"]
    metadata.state_dict_metadata["model.weight"] = TensorStorageMetadata(
        entry.properties, size, entry.chunks
    )
    return metadata


def _data_file(metadata: Metadata, relative_path: str) -> Metadata:
    for info in metadata.storage_data.values():
        info.relative_path = relative_path
    return metadata


WRONG_FIELDS = {
    "an index, not a Metadata": (lambda m: MetadataIndex("model.weight"), "holds a MetadataIndex"),
    "entries not a dict": (
        lambda m: Metadata(state_dict_metadata="model.weight"),
        "state_dict_metadata is not a dict",
    ),
    "a missing field": (_without_field, "a field is missing"),
    "an entry of another class": (
        lambda m: Metadata({"model.weight": TensorProperties()}, storage_data={}),
        "'model.weight' is a TensorProperties",
    ),
    "a size that is a string": (
        lambda m: _tensor_with_size(m, "2x3"),
        "'model.weight' has no valid size",
    ),
    "chunks of another rank": (
        lambda m: _tensor_with_size(m, torch.Size([2, 3, 1])),
        "'model.weight' has a chunk that is not 3-d",
    ),
    "an entry without its data": (
        lambda m: Metadata(m.state_dict_metadata, storage_data={}),
        "'model.weight' has no storage record of its data",
    ),
    "a data file outside the directory": (
        lambda m: _data_file(m, "../../elsewhere.distcp"),
        "names the file '../../elsewhere.distcp', which is not inside the checkpoint",
    ),
}


@pytest.mark.parametrize("case", list(WRONG_FIELDS))
def test_a_metadata_of_allowed_classes_with_wrong_fields_is_refused(saved, tmp_path, case):
    directory, like, _ = saved
    make, match = WRONG_FIELDS[case]
    write_metadata(directory, make(read_metadata(directory)))
    message = assert_refused(directory, like, tmp_path / "marker", r"\.metadata is not DCP")
    assert match in message


def test_a_checkpoint_whose_paths_conflict_is_refused_naming_it(tmp_path):
    directory = tmp_path / "flat"
    torch_save({"w": torch.ones(2), "w.x": torch.zeros(3)}, directory)  # DCP allows this
    with pytest.raises(ValueError, match=r"flat': .*'w' is a leaf and 'w\.x' continues it"):
        checkpoint.load_distributed(directory, {}, as_saved=["w"])

    # The fix: one of the two at a time.
    w = checkpoint.load_distributed(directory, {"w": torch.empty(2)}, strict=False)["w"]
    wx = checkpoint.load_distributed(directory, {}, as_saved=["w.x"], strict=False)["w"]["x"]
    assert torch.equal(w, torch.ones(2)) and torch.equal(wx, torch.zeros(3))


def test_weights_only_false_runs_what_a_trusted_metadata_holds(saved, tmp_path):
    directory, like, tree = saved
    marker = tmp_path / "marker"
    # A .metadata that calls os.mkdir and then gives the real metadata: a working checkpoint.
    write_metadata(directory, ThenGives(Calls(os.mkdir, str(marker)), read_metadata(directory)))
    assert_refused(directory, like, marker, r"\.metadata names operator\.itemgetter,")

    loaded = checkpoint.load_distributed(directory, like, weights_only=False)  # the fix

    assert marker.is_dir()  # trusting a checkpoint means running what it holds
    # ... once: a second read (DCP's own, inside dcp.load) would fail on the existing marker.
    assert torch.equal(loaded["model"]["weight"], tree["model"]["weight"])


def test_the_load_never_reads_the_metadata_with_pickle_load(saved, monkeypatch):
    directory, like, tree = saved

    def unrestricted(*args, **kwargs):
        raise AssertionError("pickle.load read a file")

    # DCP's own FileSystemReader.read_metadata reads .metadata with pickle.load.
    monkeypatch.setattr(pickle, "load", unrestricted)
    loaded = checkpoint.load_distributed(directory, like)
    monkeypatch.undo()

    assert loaded["step"] == 12
    assert torch.equal(loaded["model"]["bias"], tree["model"]["bias"])
    with pytest.raises(AssertionError, match="pickle.load read a file"):  # the check can fail
        monkeypatch.setattr(pickle, "load", unrestricted)
        checkpoint.load_distributed(directory, like, weights_only=False)


# --- non-tensor values --------------------------------------------------------------------


def test_a_value_whose_pickle_calls_a_function_is_refused_before_the_call(tmp_path):
    marker = tmp_path / "marker"
    directory = tmp_path / "crafted"
    # torch's own dcp.save pickles whatever it is given; modstate's save would refuse this.
    state = {"w": torch.arange(4.0), "config": Calls(os.mkdir, str(marker))}
    torch_save(state, directory)
    assert not marker.exists()

    message = assert_refused(
        directory, {"w": torch.zeros(4), "config": None}, marker, r"'config': it calls posix\.mkdir"
    )
    assert "weights_only=False" in message


def test_weights_only_false_loads_a_trusted_value_of_your_own_class(tmp_path):
    directory = tmp_path / "trusted"
    config = Config(width=64, activation="gelu")
    torch_save({"w": torch.ones(2), "config": config}, directory)
    like = {"w": torch.zeros(2), "config": None}
    assert_refused(directory, like, tmp_path / "marker", r"'config': it calls [\w.]*Config,")

    loaded = checkpoint.load_distributed(directory, like, weights_only=False)  # the fix

    assert loaded["config"] == config and torch.equal(loaded["w"], torch.ones(2))


def test_every_value_a_checkpoint_holds_round_trips(tmp_path):
    values = {
        "none": None,
        "flag": True,
        "count": 7,
        "rate": 0.25,
        "name": "adam",
        "betas": (0.9, 0.999),
        "shape": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "nested": {"milestones": [10, 20], "pair": (1, torch.arange(3))},
    }
    checkpoint.save_distributed({"values": values}, tmp_path / "values")
    loaded = checkpoint.load_distributed(tmp_path / "values", {}, as_saved=["values"])["values"]

    pair = loaded["nested"].pop("pair")
    assert pair[0] == 1 and torch.equal(pair[1], torch.arange(3))
    del values["nested"]["pair"]
    assert loaded == values
    assert {k: type(v) for k, v in loaded.items()} == {k: type(v) for k, v in values.items()}


def test_save_distributed_refuses_a_value_load_could_not_read_and_writes_nothing(tmp_path):
    config = Config(width=64, activation="gelu")
    tree = {"w": torch.ones(2), "head": {"config": config}}
    with pytest.raises(TypeError, match=r"'head\.config': a Config value .* it calls [\w.]*Config"):
        checkpoint.save_distributed(tree, tmp_path / "never")
    assert not (tmp_path / "never").exists()
    with pytest.raises(TypeError, match=r"'head\.f': a function value .* cannot be pickled"):
        checkpoint.save_distributed({"head": {"f": lambda x: x}}, tmp_path / "never")
    assert os.listdir(tmp_path) == []

    tree["head"]["config"] = dataclasses.asdict(config)  # the fix: the object's fields
    checkpoint.save_distributed(tree, tmp_path / "fields")
    loaded = checkpoint.load_distributed(
        tmp_path / "fields", {"w": torch.zeros(2)}, as_saved=["head"]
    )
    assert Config(**loaded["head"]["config"]) == config
