"""checkpoint.load(path, mmap=True): tensors backed by the file, as torch.load(mmap=True) gives;
with ms.load(model, tree, assign=True), a big checkpoint goes into a meta-device model at almost
no memory cost until the weights are used (measured in fresh processes by
benchmarks/checkpoint_memory.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import modstate as ms
from modstate import checkpoint

MEMORY = Path(__file__).resolve().parents[2] / "benchmarks" / "checkpoint_memory.py"
linux_only = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc")


def file_mappings(path) -> list[tuple[int, int]]:
    """The address ranges at which this process maps ``path``."""
    target = os.path.realpath(path)
    ranges = []
    with open("/proc/self/maps") as handle:
        for line in handle:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == target:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def backed_by(tensor: torch.Tensor, path) -> bool:
    pointer = tensor.data_ptr()
    return any(start <= pointer < end for start, end in file_mappings(path))


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 8))
    model[2].weight = nn.Parameter(torch.randn(8, 64, dtype=torch.bfloat16))
    path = tmp_path / "model.safetensors"
    checkpoint.save(ms.extract(model), path)
    return path, model


@linux_only
def test_mmap_tensors_are_backed_by_the_file_and_equal_a_plain_load(saved):
    path, _ = saved
    mapped, plain = checkpoint.load(path, mmap=True), checkpoint.load(path)
    for (key, leaf), other in zip(
        ms.flatten(mapped).items(), ms.flatten(plain).values(), strict=True
    ):
        assert backed_by(leaf, path), key
        assert not backed_by(other, path), key  # a plain load owns its memory
        assert leaf.dtype == other.dtype and torch.equal(leaf, other), key


@linux_only
def test_writing_into_a_mapped_tensor_never_changes_the_file(saved):
    path, _ = saved
    mapped = checkpoint.load(path, mmap=True)
    original = mapped["0"]["weight"].clone()
    mapped["0"]["weight"].add_(1)  # copy-on-write, as torch.load(mmap=True)
    assert torch.equal(checkpoint.load(path)["0"]["weight"], original)


def test_a_plain_load_does_not_follow_the_file_afterwards(saved):
    path, _ = saved
    tree = checkpoint.load(path)
    before = tree["0"]["weight"].clone()
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(len(data)))  # overwritten in place by another tool
    assert torch.equal(tree["0"]["weight"], before)


def test_mmap_keeps_ties_and_device_works(tmp_path):
    tied = torch.arange(6.0)
    path = tmp_path / "t.safetensors"
    checkpoint.save({"a": tied, "b": tied, "c": torch.ones(2)}, path)
    tree = checkpoint.load(path, mmap=True)
    assert tree["a"] is tree["b"]
    moved = checkpoint.load(path, mmap=True, device="meta")  # any other device copies there
    assert moved["a"].device.type == "meta" and moved["a"] is moved["b"]


def test_mmap_checks_the_header_but_not_the_checksums(saved):
    """Verifying checksums would read every byte, which mapping avoids: documented, and pinned."""
    path, _ = saved
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # inside the last tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="do not match their checksum"):
        checkpoint.load(path)
    checkpoint.load(path, mmap=True)  # loads; the damage shows in the values
    path.write_bytes(b"\x80\x04junk")
    with pytest.raises(ValueError, match="a pickle"):
        checkpoint.load(path, mmap=True)


def test_the_meta_device_recipe(saved):
    path, source = saved
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 8))
    model[2].weight = nn.Parameter(torch.empty(8, 64, dtype=torch.bfloat16, device="meta"))
    ms.load(model, checkpoint.load(path, mmap=True), assign=True)
    model.eval(), source.eval()
    x = torch.randn(4, 64)
    assert torch.equal(model[:2](x), source[:2](x))
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in model.parameters())
    assert model[2].weight.dtype == torch.bfloat16


@linux_only
@pytest.mark.skipif(not MEMORY.exists(), reason="needs the source checkout's benchmarks/")
def test_a_big_checkpoint_goes_into_a_meta_model_at_almost_no_memory_cost():
    done = subprocess.run(
        [sys.executable, str(MEMORY), "--mib", "128", "--json",
         "--cases", "modstate mmap+assign", "modstate load (copy)"],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    figures = json.loads(done.stdout)
    size = figures["file bytes"]
    mapped, copied = (
        figures["cases"]["modstate mmap+assign"],
        figures["cases"]["modstate load (copy)"],
    )
    assert mapped["peak rise"] <= 0.10 * size, figures  # the bound: 10% of the file
    assert mapped["after use"] >= 0.9 * size, figures  # used, the weights are read in
    assert copied["peak rise"] >= 0.9 * size, figures  # the measurement sees a whole copy
