"""tree.summary: a table of a tree's paths, shapes, dtypes and sizes."""

from __future__ import annotations

import torch
from torch import nn

import modstate as ms
import modstate.tree


def test_summary_lists_every_leaf_with_an_aligned_total():
    tree = {
        "0": {"weight": torch.zeros(256, 4), "bias": torch.zeros(256, dtype=torch.float64)},
        "extra": [None, "opaque"],
    }
    tree["tied"] = tree["0"]["weight"]
    report = ms.tree.summary(tree)
    assert [row.path for row in report.rows] == ["0.weight", "0.bias", "extra.1", "tied"]
    assert report.rows[0].shape == (256, 4) and report.rows[1].dtype == "float64"
    assert report.rows[2].nbytes is None and report.rows[2].dtype == "str"
    assert report.tensor_count == 2 and report.total_numel == 1280
    assert report.total_bytes == 256 * 4 * 4 + 256 * 8
    text = str(report)
    lines = text.splitlines()
    assert lines[0].split() == ["path", "shape", "dtype", "device", "size"]
    assert (
        "4 KiB" in text
        and "2 KiB" in text
        and lines[-1] == ("total: 2 tensors, 1,280 elements, 6 KiB")
    )
    columns = {line.index("(256") for line in lines if "(256" in line}
    assert len(columns) == 1  # shapes start in one column
    assert repr(report) == text
    html = report._repr_html_()
    assert html.startswith("<table>") and "0.weight" in html and "total: 2 tensors" in html


def test_summary_of_a_module_tree_follows_state_dict_order():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    report = ms.tree.summary(ms.extract(model))
    assert [row.path for row in report.rows] == list(model.state_dict())
    assert report.rows[-1].dtype == "int64"  # num_batches_tracked
