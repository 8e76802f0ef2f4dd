"""Linear layers as one batched matmul (``_kernels/linear.py``): ``nn.Linear`` alone, inside
residual blocks, read directly by the model's own code, and Hugging Face's ``Conv1D``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loop_reference import assert_like_the_loop


class Residual(nn.Module):
    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.inner = nn.Linear(width, 2 * width)
        self.outer = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.relu(self.inner(x)))


class ReadsItsWeight(nn.Module):
    """Code that reads a layer's weight itself, beside calling the layer (as tied heads do)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + F.linear(x, self.fc.weight.t())


@pytest.mark.parametrize(
    ("factory", "shape"),
    [
        (lambda: nn.Linear(5, 3), (4, 5)),
        (lambda: nn.Linear(5, 3, bias=False), (2, 4, 5)),
        (lambda: nn.Linear(5, 3), (5,)),
        (lambda: nn.Linear(5, 3), (2, 3, 4, 5)),
        (Residual, (3, 6)),
        (lambda: nn.Sequential(Residual(), Residual()), (2, 3, 6)),
        (ReadsItsWeight, (3, 4)),
    ],
    ids=["linear", "no_bias_3d", "unbatched", "4d", "residual", "residual_stack", "reads_weight"],
)
@pytest.mark.parametrize("in_dims", [None, 0])
def test_linear_layers_equal_the_members_one_by_one(factory, shape, in_dims):
    lead = () if in_dims is None else (3,)
    ensemble = assert_like_the_loop(factory, lambda: (torch.randn(*lead, *shape),), in_dims=in_dims)
    linears = [r for r in ensemble.plan.routes if r.layer.startswith("Linear")]
    assert linears and all(r.how == "batched matmul" for r in linears)


def test_hugging_face_conv1d_is_a_batched_matmul():
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")

    class Projection(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = pytorch_utils.Conv1D(8, 5)  # 5 -> 8, weight stored (5, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.proj(x))

    ensemble = assert_like_the_loop(Projection, lambda: (torch.randn(2, 3, 5),))
    assert ensemble.plan.routes[0].how == "batched matmul"
