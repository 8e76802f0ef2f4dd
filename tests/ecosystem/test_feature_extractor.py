"""torchvision's create_feature_extractor gives torch.fx GraphModules, a class per instance and
per copy, whose deepcopy re-runs __init__ and comes back in training mode."""

from __future__ import annotations

import copy

import pytest
import torch

import modstate as ms

pytest.importorskip("torchvision")

from models import MODELS

SPEC = next(m for m in MODELS if m.name == "feature_extractor")


def test_copies_of_a_feature_extractor_stack_though_their_classes_differ():
    extractor = SPEC.build()
    twin = copy.deepcopy(extractor).eval()
    assert isinstance(extractor, torch.fx.GraphModule) and type(twin) is not type(extractor)
    stacked = ms.stack_modules([extractor, twin])
    assert stacked["conv1"]["weight"].shape[0] == 2


def test_an_ensemble_of_feature_extractors_computes_in_the_originals_eval_mode():
    extractors = [SPEC.build(seed=i) for i in range(2)]
    assert copy.deepcopy(extractors[0]).training  # what torchvision's deepcopy does
    ensemble = ms.Ensemble(extractors)
    (x,) = SPEC.inputs()
    with torch.no_grad():
        expected = torch.stack([e(x)["features"] for e in extractors])
        out = ensemble(x)["features"]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert not ensemble.training and not ensemble.member(0).training
