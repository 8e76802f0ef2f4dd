"""`TreeReader` (``_core/readers.py``): reads trees of one structure by a program made once, and
builds new trees of that structure from a flat list."""

from __future__ import annotations

import torch

from modstate._core.trees.readers import TreeReader


def test_a_tree_read_and_built_again_keeps_its_structure_and_key_order():
    a, b, c = torch.ones(1), torch.zeros(2), torch.full((3,), 2.0)
    template = {"z": a, "enc": {"b": {"w": b}, "a": None}, "empty": {}, "m": c}
    reader = TreeReader(template)
    assert reader.paths == ["z", "enc.b.w", "enc.a", "m"]
    leaves, _ = reader.read(template)
    assert leaves == [a, b, None, c]
    built = reader.build(leaves)
    assert built == template and built is not template and built["enc"] is not template["enc"]
    assert list(built) == ["z", "enc", "empty", "m"] and list(built["enc"]) == ["b", "a"]
    other = reader.build(["z", "w", "a", "m"])
    assert other == {"z": "z", "enc": {"b": {"w": "w"}, "a": "a"}, "empty": {}, "m": "m"}


def test_a_tree_shaped_otherwise_is_not_read():
    reader = TreeReader({"a": {"b": 1}, "c": 2})
    assert reader.read({"a": {"b": 5}, "c": 6})[0] == [5, 6]
    assert reader.read({"a": {"b": 5}}) is None  # a key left out
    assert reader.read({"a": {"b": 5, "x": 0}, "c": 6}) is None  # a key more
    assert reader.read({"a": 5, "c": 6}) is None  # a leaf where a node was
    assert reader.read({"a": {"x": 5}, "c": 6}) is None  # another key


def test_two_entries_that_make_one_path_are_told():
    assert TreeReader({"a": {"b": 1}, "c": 2}).paths_are_distinct()
    assert not TreeReader({"a.b": 1, "a": {"b": 2}}).paths_are_distinct()
