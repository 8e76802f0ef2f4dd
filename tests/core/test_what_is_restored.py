"""What a stateless call restores, and what it documents it does not: one test for each."""

from __future__ import annotations

import copy

import torch
from torch import nn

import modstate as ms


class Stateful(nn.Module):
    """A forward that changes state in every way a module can."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("total", torch.zeros(2))
        self.scale = torch.ones(2)  # a plain tensor attribute
        self.calls = 0  # a plain non-tensor attribute

    def forward(self, x):
        self.count = self.count + 1  # reassigns a buffer
        self.total.add_(x.sum(0))  # updates a buffer in place
        self.scale = self.scale * 2  # reassigns a tensor attribute
        self.calls += 1  # reassigns a plain int
        return self.lin(x) * self.scale


def test_slots_and_flags_are_restored_and_a_reassigned_buffer_goes_into_the_tree():
    model = Stateful()
    weight, count = model.lin.weight, model.count
    tree = ms.extract(model, detach=True)
    ms.call(model, tree, torch.ones(1, 2))
    assert model.lin.weight is weight and weight.requires_grad
    assert model.count is count and count.item() == 0
    assert tree["count"].item() == 1  # written back into the tree passed in


def test_in_place_updates_land_in_the_trees_tensors_not_the_modules():
    model = Stateful()
    tree = ms.tree.clone(ms.extract(model, detach=True))
    ms.call(model, tree, torch.ones(3, 2))
    assert torch.equal(tree["total"], torch.full((2,), 3.0))
    assert torch.equal(model.total, torch.zeros(2))


def test_tensor_attributes_are_restored():
    model = Stateful()
    scale = model.scale
    ms.call(model, ms.extract(model, detach=True), torch.ones(1, 2))
    assert model.scale is scale and torch.equal(scale, torch.ones(2))


def test_plain_non_tensor_attributes_keep_what_forward_gave_them_as_in_torch_func():
    model, twin = Stateful(), Stateful()
    ms.call(model, ms.extract(model, detach=True), torch.ones(1, 2))
    torch.func.functional_call(twin, dict(twin.state_dict()), (torch.ones(1, 2),))
    assert model.calls == twin.calls == 1  # documented: not restored


def test_calling_a_copy_leaves_such_attributes_alone():
    model = Stateful()
    ms.call(copy.deepcopy(model), ms.extract(model, detach=True), torch.ones(1, 2))
    assert model.calls == 0
