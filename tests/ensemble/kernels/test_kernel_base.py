"""What every kernel shares (``_kernels/base.py``): here, `fresh_view`, which lets an in-place
activation after a kernel cost what it costs after the layer itself."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from modstate.ensemble._kernels.base import fresh_view

from loop_reference import assert_like_the_loop, backward_nodes


class LinearThenInPlaceRelu(nn.Module):
    """``relu_`` written in ``forward`` on what the Linear kernel returns (members first)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(x).relu_())


IN_PLACE_AFTER_KERNELS = {
    # A Sequential's chain runs its activations in place right after a fresh kernel.
    "linear, batch norm, relu": (
        lambda: nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3)),
        (8, 5),
    ),
    "conv, batch norm, relu, pool": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.ReLU(inplace=True),
            nn.Flatten(),
            nn.Linear(36, 3),
        ),
        (4, 2, 6, 6),
    ),
    # A model's own forward, members first: vmap's in-place rule writes into the kernel's output.
    "forward with relu_": (LinearThenInPlaceRelu, (2, 8, 5)),
}


@pytest.mark.parametrize("case", IN_PLACE_AFTER_KERNELS)
@pytest.mark.parametrize("in_dims", [None, 0])
def test_in_place_ops_on_kernel_outputs_equal_the_loop_and_rewrite_no_view(case, in_dims):
    factory, shape = IN_PLACE_AFTER_KERNELS[case]
    lead = () if in_dims is None else (3,)
    ensemble = assert_like_the_loop(factory, lambda: (torch.randn(*lead, *shape),), in_dims=in_dims)
    ensemble.train()
    out = ensemble(torch.randn(*lead, *shape))
    # A view written in place would have put CopySlices (a clone and a copy of the gradient in
    # backward) into the graph.
    assert "CopySlices" not in backward_nodes(out)


def test_fresh_view_owns_its_history_only_where_nothing_else_can_see_the_storage():
    source = torch.randn(4, 6, requires_grad=True)
    made = source * 2  # new, and kept by nothing else
    out = fresh_view(made, 2, 2, -1)
    assert out.shape == (2, 2, 6) and out._base is None
    out.relu_()
    out.sum().backward()
    torch.testing.assert_close(source.grad, 2.0 * (source > 0))

    # A view of something else stays a view: the in-place op bumps what it is a view of.
    base = torch.randn(4, 6, requires_grad=True) * 1
    window = base[:2]
    viewed = fresh_view(window, 2, 2, 3)
    assert viewed._base is base
    viewed.relu_()
    assert base._version == 1

    # Without autograd it is a plain view.
    with torch.no_grad():
        plain = fresh_view(torch.randn(4, 6), 24)
    assert plain._base is not None
