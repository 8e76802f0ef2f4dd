"""Every property modstate promises, on real models of torchvision, timm, Hugging Face transformers,
peft and torch parametrizations (tiny configurations, random weights, nothing downloaded).

For every model: extraction equals ``state_dict``; ``call`` equals ``forward``; ``torch.func.grad``
through ``call`` equals autograd; README's functional training step (``split``, ``grad`` of
``apply``, ``ms.optim``) equals ``backward`` and ``torch.optim``, tied embeddings included; ``inject`` and ``swap`` give the model back exactly (same objects,
same flags, same values), also when the body raises; ``vmap_call`` and ``Ensemble`` equal a loop
over the copies, forward and gradients; checkpoints round-trip, ours and the ecosystem's files.
"""

from __future__ import annotations

import copy

import pytest
import safetensors.torch
import torch
from models import MODELS, Model, params
from torch import nn

import modstate as ms

from zoo import assert_unchanged, snapshot

MEMBERS = 2


def run(spec: Model, model: nn.Module, *args) -> torch.Tensor:
    return spec.output(model(*(args or spec.inputs())))


def weights_for(out: torch.Tensor) -> torch.Tensor:
    """Fixed random weights, so that every output element matters to the loss."""
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)


def trainable_and_rest(model: nn.Module) -> tuple[dict, dict]:
    """Detached trees: the trainable parameters (each tie once, at its first path), and every
    other leaf of ``extract`` but the tied copies of trainable parameters."""
    trainable = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    trained_ids = {id(p) for p in model.parameters() if p.requires_grad}
    rest = {
        path: leaf.detach()
        for path, leaf in ms.flatten(ms.extract(model)).items()
        if id(leaf) not in trained_ids
    }
    return ms.unflatten(trainable), ms.unflatten(rest)


def autograd_grads(spec: Model, model: nn.Module) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = run(spec, model)
    (out * weights_for(out)).sum().backward()
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


# t5_eager, T5 with eager attention, stands in for T5 where torch cannot run its SDPA attention
# under vmap with gradients (test_torch_limits.py); vmap_call and ms.apply under vmap run T5's
# attention with the members folded into its batch, where it can, so they take T5 itself.
parametrize_models = pytest.mark.parametrize("spec", params(leave_out={"t5_eager"}))


@parametrize_models
def test_extraction_equals_state_dict(spec):
    model = spec.build()
    state = model.state_dict(keep_vars=True)
    by_state_dict = ms.flatten(ms.extract(model, use_state_dict=True))
    assert list(by_state_dict) == list(state)
    assert all(by_state_dict[key] is value for key, value in state.items())
    plain = ms.flatten(ms.extract(model))
    non_persistent = {
        f"{prefix}.{name}" if prefix else name
        for prefix, owner in model.named_modules(remove_duplicate=False)
        for name in owner._non_persistent_buffers_set
        if owner._buffers.get(name) is not None
    }
    # extract holds the module's own tensors; for parametrized weights state_dict holds the
    # originals under "parametrizations.*.original*", as extract does.
    assert set(plain) == set(state) | non_persistent
    assert all(plain[key] is value for key, value in state.items())


@parametrize_models
def test_call_equals_forward(spec):
    model = spec.build()
    before = snapshot(model)
    expected = run(spec, model)
    assert torch.equal(spec.output(ms.call(model, ms.extract(model), *spec.inputs())), expected)
    # Detached leaves compute as forward does without autograd (T5 differs in the last bit
    # between the two modes, with or without modstate).
    with torch.no_grad():
        expected = run(spec, model)
    out = spec.output(ms.call(model, ms.extract(model, detach=True), *spec.inputs()))
    assert torch.equal(out, expected)
    assert_unchanged(model, before)


@parametrize_models
def test_grad_through_call_equals_autograd(spec):
    model = spec.build()
    expected = autograd_grads(spec, model)
    trainable, rest = trainable_and_rest(model)
    inputs = spec.inputs()

    def loss(p):
        out = spec.output(ms.call(model, (p, rest), *inputs))
        return (out * weights_for(out)).sum()

    grads = ms.flatten(torch.func.grad(loss)(trainable))
    assert grads.keys() == expected.keys()
    for path, grad in grads.items():
        torch.testing.assert_close(grad, expected[path], rtol=1e-4, atol=1e-5, msg=path)


@parametrize_models
def test_a_functional_training_step_equals_backward_and_torch_optim(spec):
    # split lists a tie at each of its paths; the optimizer steps it once, with the gradient at
    # its first path in module order, so the new params still fit the model on the next step.
    model = spec.build()
    reference = spec.build()  # the same weights (a deepcopy of an fx model comes back training)
    params, state = ms.split(model, detach=True)
    inputs = spec.inputs()
    opt = ms.optim.sgd(lr=0.1, momentum=0.9)
    opt_state = opt.init(params)
    trained = [p for p in reference.parameters() if p.requires_grad]
    torch_opt = torch.optim.SGD(trained, lr=0.1, momentum=0.9)

    def loss(p: dict, s: dict) -> tuple[torch.Tensor, dict]:
        out, new_state = ms.apply(model, p, s, *inputs)
        out = spec.output(out)
        return (out * weights_for(out)).sum(), new_state

    for _ in range(2):
        grads, state = torch.func.grad(loss, has_aux=True)(params, state)
        params, opt_state = opt.step(params, grads, opt_state)
        torch_opt.zero_grad()
        out = run(spec, reference)
        (out * weights_for(out)).sum().backward()
        torch_opt.step()
    got = {**ms.flatten(params), **ms.flatten(state)}
    for path, want in ms.flatten(ms.extract(reference, detach=True)).items():
        torch.testing.assert_close(got[path], want, rtol=1e-4, atol=1e-5, msg=path)


@parametrize_models
def test_inject_restores_the_model_exactly_also_when_the_body_raises(spec):
    model = spec.build()
    other = spec.build(seed=1)
    with torch.no_grad():  # detached leaves compute as forward without autograd
        expected = run(spec, other)
    before = snapshot(model)
    tree = ms.extract(other, detach=True)
    with ms.inject(model, tree):
        torch.testing.assert_close(run(spec, model), expected, rtol=0, atol=0)
    assert_unchanged(model, before)
    with pytest.raises(RuntimeError, match="raised in the body"):
        with ms.inject(model, tree):
            run(spec, model)
            raise RuntimeError("raised in the body")
    assert_unchanged(model, before)


@parametrize_models
def test_swap_round_trips(spec):
    model = spec.build()
    reference = run(spec, model)
    other = spec.build(seed=1)
    before = snapshot(model)
    old = ms.swap(model, ms.extract(other, detach=True))
    with torch.no_grad():  # detached leaves compute as forward without autograd
        torch.testing.assert_close(run(spec, model), run(spec, other), rtol=0, atol=0)
    ms.swap(model, old)
    assert_unchanged(model, before)
    assert torch.equal(run(spec, model), reference)


def copies(spec: Model) -> list[nn.Module]:
    return [spec.build(seed=i) for i in range(MEMBERS)]


def loop_outputs_and_grads(spec: Model, models: list[nn.Module]):
    outs, grads = [], []
    for model in models:
        grads.append(autograd_grads(spec, model))
        with torch.no_grad():
            outs.append(run(spec, model))
    stacked_grads = {path: torch.stack([g[path] for g in grads]) for path in grads[0]}
    return torch.stack(outs), stacked_grads


def assert_stacked_grads(stacked: dict, expected: dict) -> None:
    flat = ms.flatten(stacked)
    for path, grad in expected.items():
        torch.testing.assert_close(flat[path].grad, grad, rtol=1e-4, atol=1e-5, msg=path)


@parametrize_models
def test_vmap_call_equals_a_loop_of_copies(spec):
    models = copies(spec)
    expected_out, expected_grads = loop_outputs_and_grads(spec, models)
    stacked = ms.stack_modules(models)
    before = snapshot(models[0])
    out = spec.output(ms.vmap_call(models[0], stacked, *spec.inputs()))
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    (out * weights_for(out[0])).sum().backward()
    assert_stacked_grads(stacked, expected_grads)
    assert_unchanged(models[0], before)


@parametrize_models
def test_vmap_of_ms_grad_of_apply_equals_a_loop_of_copies(spec):
    # Under a lone vmap, ms.grad takes every member's gradient from one backward and ms.apply
    # runs the members as an Ensemble of the model does (tests/ensemble/test_members_apply.py).
    models = copies(spec)
    expected_out, expected_grads = loop_outputs_and_grads(spec, models)
    halves = [ms.split(model, detach=True) for model in models]
    params, state = ms.stack([p for p, _ in halves]), ms.stack([s for _, s in halves])
    inputs, weights = spec.inputs(), weights_for(expected_out[0])
    before = snapshot(models[0])

    def loss(p: dict, s: dict) -> torch.Tensor:
        out = spec.output(ms.apply(models[0], p, s, *inputs)[0])
        return (out * weights).sum()

    grads = ms.flatten(torch.vmap(ms.grad(loss))(params, state))
    for path, grad in expected_grads.items():
        torch.testing.assert_close(grads[path], grad, rtol=1e-4, atol=1e-5, msg=path)
    assert_unchanged(models[0], before)


ENSEMBLED = {"Linear", "Conv2d", "Embedding", "BatchNorm2d", "MultiheadAttention", "Conv1D"}


@pytest.mark.parametrize("spec", params(leave_out={"t5_eager"}))
def test_ensemble_equals_a_loop_of_copies(spec):
    models = copies(spec)
    expected_out, expected_grads = loop_outputs_and_grads(spec, models)
    ensemble = ms.Ensemble(models, route="batched")
    out = spec.output(ensemble(*spec.inputs()))
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    (out * weights_for(out[0])).sum().backward()
    assert_stacked_grads(ensemble.tree(), expected_grads)
    member = ensemble.member(1)
    torch.testing.assert_close(run(spec, member), expected_out[1], rtol=1e-5, atol=1e-5)
    # Every layer of a kind with a kernel runs it (parametrized layers fall back, and say why).
    for route in ensemble.plan.routes:
        if route.layer.split("(")[0] in ENSEMBLED:
            assert route.fallback is None, route


@pytest.mark.parametrize("spec", params(leave_out={"t5_eager"}))
def test_ensemble_in_inference_equals_a_loop_of_copies(spec):
    # Without autograd, CNNs run channels-last from their stem on (_kernels/conv.py).
    models = copies(spec)
    ensemble = ms.Ensemble(
        copies(spec), route="batched"
    )  # the same seeds (a deep copy of an fx graph trains)
    with torch.no_grad():
        expected = torch.stack([run(spec, model) for model in models])
        out = spec.output(ensemble(*spec.inputs()))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", params([m for m in MODELS if m.library == "torchvision"]))
def test_ensemble_in_training_mode_updates_each_members_batch_norm_statistics(spec):
    models = [m.train() for m in copies(spec)]
    for model in models:  # no random masks: outputs comparable with the members one by one
        for layer in model.modules():
            if isinstance(layer, nn.Dropout):
                layer.eval()
    ensemble = ms.Ensemble(models, route="batched")
    references = [copy.deepcopy(m) for m in models]
    exact = [copy.deepcopy(m).double() for m in models]
    for _ in range(2):
        out = spec.output(ensemble(*spec.inputs()))
        expected = torch.stack([run(spec, m) for m in references])
        truth = torch.stack([run(spec, m, *(x.double() for x in spec.inputs())) for m in exact])
        # Train-mode BatchNorm over the 1x1 maps of the last stage normalizes two values per
        # channel, which magnifies float32 rounding: the members one by one are themselves up
        # to ~5e-5 off the float64 result there. The ensemble (other kernels, other roundings)
        # must be as accurate as they are, not round alike.
        loop_error = (expected.double() - truth).abs().max().item()
        torch.testing.assert_close(out.double(), truth, rtol=0, atol=2 * loop_error + 1e-5)
    stacked = ms.flatten(ms.stack([ms.extract(m) for m in references]))
    for path, leaf in ms.flatten(ensemble.tree()).items():
        torch.testing.assert_close(leaf, stacked[path], rtol=1e-5, atol=1e-5, msg=path)


@parametrize_models
@pytest.mark.parametrize("use_state_dict", [False, True], ids=["plain", "state_dict"])
def test_our_checkpoint_round_trips(spec, use_state_dict, tmp_path):
    model = spec.build()
    path = tmp_path / "model.safetensors"
    ms.checkpoint.save(ms.extract(model, use_state_dict=use_state_dict), path)
    fresh = spec.build(seed=1)
    before = snapshot(fresh)
    ms.load(fresh, ms.checkpoint.load(path), use_state_dict=use_state_dict)
    assert torch.equal(run(spec, fresh), run(spec, model))
    after = snapshot(fresh)  # same objects and flags; only values changed
    assert {k: v[:2] for k, v in after.items()} == {k: v[:2] for k, v in before.items()}
    if use_state_dict:  # the ecosystem reads our file: it is plain safetensors, state_dict keys
        other = spec.build(seed=2)
        safetensors.torch.load_model(other, str(path))
        assert torch.equal(run(spec, other), run(spec, model))


def ecosystem_files(spec: Model, model: nn.Module, folder) -> dict[str, dict]:
    """What the ecosystem writes for this model, read back as flat dicts of tensors."""
    files = {}
    path = folder / "save_model.safetensors"
    safetensors.torch.save_model(model, str(path))
    files["safetensors.save_model"] = safetensors.torch.load_file(str(path))
    if hasattr(model, "save_pretrained") and spec.library == "transformers":
        model.save_pretrained(folder / "pretrained")
        files["save_pretrained"] = safetensors.torch.load_file(
            str(folder / "pretrained" / "model.safetensors")
        )
    if spec.library in ("torchvision", "timm", "torch"):
        torch.save(model.state_dict(), folder / "state_dict.pt")
        files["torch.save(state_dict)"] = torch.load(folder / "state_dict.pt", weights_only=True)
    return files


@parametrize_models
@pytest.mark.parametrize("use_state_dict", [False, True], ids=["plain", "state_dict"])
def test_ecosystem_files_load_strictly(spec, use_state_dict, tmp_path):
    model = spec.build()
    expected = run(spec, model)
    for kind, flat in ecosystem_files(spec, model, tmp_path).items():
        fresh = spec.build(seed=1)
        ms.load(fresh, flat, use_state_dict=use_state_dict)
        assert torch.equal(run(spec, fresh), expected), kind
