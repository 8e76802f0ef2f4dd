"""What torch itself cannot do under vmap, on ecosystem models: ``torch.func`` fails with torch's
own error naming the op; ``Ensemble``, and ``vmap_call`` through the module's kept ensemble, fold
the members into the attention batch instead of running attention under vmap, and do not meet
the limit. Under ``torch.func.grad`` (where ``vmap_call`` keeps vmap's rules) it fails as torch's
own call does."""

from __future__ import annotations

import pytest
import torch
from models import params

import modstate as ms

T5 = [p for p in params() if p.id == "t5"]

# Under vmap, aten::scaled_dot_product_attention dispatches to the fused CPU kernel
# aten::_scaled_dot_product_flash_attention_for_cpu, which has no derivative for attn_mask. T5
# feeds its learned relative position bias to SDPA as attn_mask, so a stacked T5 whose bias
# requires grad cannot run under vmap (outside vmap torch picks the math kernel, which can).
OP = "_scaled_dot_product_flash_attention_for_cpu' is not differentiable with respect to argument 'attn_mask'"


@pytest.mark.parametrize("spec", T5)
def test_t5_sdpa_under_vmap_with_gradients_fails_in_torch_func_not_in_modstate(spec):
    models = [spec.build(seed=i) for i in range(2)]
    inputs = spec.inputs()
    stacked = ms.stack_modules(models)
    out = ms.vmap_call(models[0], stacked, *inputs).logits  # the kept ensemble folds attention
    out.sum().backward()
    assert all(leaf.grad is not None for leaf in ms.flatten(stacked).values() if leaf.requires_grad)
    with pytest.raises(RuntimeError, match=OP):  # vmap's rules, as under torch.func.grad
        detached = ms.tree.map(lambda t: t.detach(), stacked)
        torch.func.grad(lambda s: ms.vmap_call(models[0], s, *inputs).logits.sum())(detached)

    distinct = {}  # functional_call wants a tie given once (vmap would wrap each copy apart)
    for path, leaf in ms.flatten(stacked).items():
        if all(leaf is not seen for seen in distinct.values()):
            distinct[path] = leaf
    with pytest.raises(RuntimeError, match=OP):
        torch.vmap(lambda p: torch.func.functional_call(models[0], p, inputs).logits)(distinct)

    # The Ensemble calls the attention kernel once on the members folded into its batch, outside
    # vmap, where torch picks a kernel that has the derivative.
    ensemble = ms.Ensemble(models)
    out = ensemble(*inputs).logits
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * weights).sum().backward()
    for i, model in enumerate(models):
        (model(*inputs).logits * weights[i]).sum().backward()
    torch.testing.assert_close(
        out, torch.stack([m(*inputs).logits for m in models]), rtol=1e-5, atol=1e-5
    )
    for name, parameter in ensemble.named_parameters():
        expected = torch.stack(
            [m.get_parameter(name.removeprefix("stacked.")).grad for m in models]
        )
        torch.testing.assert_close(parameter.grad, expected, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("spec", T5)
def test_t5_sdpa_under_vmap_without_gradients_runs(spec):
    models = [spec.build(seed=i) for i in range(2)]
    inputs = spec.inputs()
    with torch.no_grad():
        out = ms.vmap_call(models[0], ms.stack_modules(models), *inputs).logits
        expected = torch.stack([m(*inputs).logits for m in models])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
