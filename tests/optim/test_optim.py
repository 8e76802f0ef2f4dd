"""modstate.optim: pure optimizers on trees (torch.optim state as a tree: test_torch_state.py)."""

from __future__ import annotations

import copy

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import modstate as ms
from modstate import optim

from sample_trees import grads_like, make_params

STEPS = 20


def run_both(torch_factory, opt, *, steps: int = STEPS, dtype: torch.dtype = torch.float32):
    """Step `opt` and a torch.optim optimizer on the same gradients; return both final params."""
    params = make_params(dtype=dtype)
    leaves = optree.tree_leaves(params)
    torch_params = [leaf.clone().requires_grad_() for leaf in leaves]
    torch_opt = torch_factory(torch_params)
    state = opt.init(params)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grads = grads_like(params, generator)
        for param, grad in zip(torch_params, optree.tree_leaves(grads), strict=True):
            param.grad = grad.clone()
        torch_opt.step()
        params, state = opt.step(params, grads, state)
    return optree.tree_leaves(params), [p.detach() for p in torch_params], state


def assert_matches_torch(torch_factory, opt, **kwargs) -> None:
    ours, theirs, _ = run_both(torch_factory, opt, **kwargs)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# -- same numbers as torch.optim ----------------------------------------------------------------


SGD_OPTIONS = [
    {},
    {"momentum": 0.9},
    {"momentum": 0.9, "dampening": 0.3},
    {"momentum": 0.8, "nesterov": True},
    {"weight_decay": 0.1},
    {"momentum": 0.9, "weight_decay": 0.05, "maximize": True},
    {"momentum": 0.5, "nesterov": True, "weight_decay": 0.1, "maximize": True},
]


@pytest.mark.parametrize("options", SGD_OPTIONS, ids=str)
def test_sgd_matches_torch(options):
    assert_matches_torch(
        lambda p: torch.optim.SGD(p, lr=0.05, **options), optim.sgd(lr=0.05, **options)
    )


ADAM_OPTIONS = [
    {},
    {"amsgrad": True},
    {"weight_decay": 0.1},
    {"maximize": True},
    {"betas": (0.5, 0.9), "eps": 1e-3},
    {"amsgrad": True, "weight_decay": 0.05, "maximize": True},
]


@pytest.mark.parametrize("options", ADAM_OPTIONS, ids=str)
def test_adam_matches_torch(options):
    assert_matches_torch(
        lambda p: torch.optim.Adam(p, lr=0.05, **options), optim.adam(lr=0.05, **options)
    )


@pytest.mark.parametrize("options", ADAM_OPTIONS, ids=str)
def test_adamw_matches_torch(options):
    assert_matches_torch(
        lambda p: torch.optim.AdamW(p, lr=0.05, **options), optim.adamw(lr=0.05, **options)
    )


def test_defaults_match_torch():
    assert_matches_torch(lambda p: torch.optim.Adam(p), optim.adam())
    assert_matches_torch(lambda p: torch.optim.AdamW(p), optim.adamw())


def test_float64_leaves_match_torch():
    assert_matches_torch(
        lambda p: torch.optim.Adam(p, lr=0.1, amsgrad=True),
        optim.adam(lr=0.1, amsgrad=True),
        dtype=torch.float64,
    )


def test_complex_leaves_match_torch():
    params = {
        "z": torch.randn(3, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    }
    theirs = params["z"].clone().requires_grad_()
    torch_opt = torch.optim.Adam([theirs], lr=0.1)
    opt = optim.adam(lr=0.1)
    state = opt.init(params)
    for step in range(5):
        grad = torch.randn(3, dtype=torch.complex64, generator=torch.Generator().manual_seed(step))
        theirs.grad = grad.clone()
        torch_opt.step()
        params, state = opt.step(params, {"z": grad}, state)
    assert params["z"].dtype == torch.complex64
    torch.testing.assert_close(params["z"], theirs.detach(), atol=1e-5, rtol=1e-5)


@settings(max_examples=15, deadline=None)
@given(
    lr=st.floats(1e-3, 0.5),
    momentum=st.sampled_from([0.0, 0.5, 0.9]),
    dampening=st.sampled_from([0.0, 0.1]),
    nesterov=st.booleans(),
    weight_decay=st.sampled_from([0.0, 0.01, 0.2]),
    maximize=st.booleans(),
)
def test_sgd_matches_torch_for_any_hyperparameters(
    lr, momentum, dampening, nesterov, weight_decay, maximize
):
    nesterov = nesterov and momentum > 0 and dampening == 0
    options = dict(
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        nesterov=nesterov,
        weight_decay=weight_decay,
        maximize=maximize,
    )
    assert_matches_torch(lambda p: torch.optim.SGD(p, **options), optim.sgd(**options), steps=8)


@settings(max_examples=15, deadline=None)
@given(
    lr=st.floats(1e-4, 0.2),
    beta1=st.floats(0.0, 0.95),
    beta2=st.floats(0.5, 0.9999),
    eps=st.sampled_from([1e-8, 1e-6, 1e-3]),
    weight_decay=st.sampled_from([0.0, 0.01, 0.2]),
    amsgrad=st.booleans(),
    maximize=st.booleans(),
    decoupled=st.booleans(),
)
def test_adam_matches_torch_for_any_hyperparameters(
    lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled
):
    options = dict(
        lr=lr,
        betas=(beta1, beta2),
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
    )
    torch_class = torch.optim.AdamW if decoupled else torch.optim.Adam
    factory = optim.adamw if decoupled else optim.adam
    assert_matches_torch(lambda p: torch_class(p, **options), factory(**options), steps=8)


# -- the state ----------------------------------------------------------------------------------


def test_state_is_a_step_counter_and_one_tree_per_buffer():
    params = make_params()
    state = optim.adam(amsgrad=True).init(params)
    assert set(state) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert state["step"].shape == () and state["step"].item() == 0
    assert ms.flatten(state["exp_avg"]).keys() == ms.flatten(params).keys()
    assert set(optim.sgd(lr=0.1).init(params)) == {"step"}
    assert set(optim.sgd(lr=0.1, momentum=0.9).init(params)) == {"step", "momentum_buffer"}

    _, _, state = run_both(lambda p: torch.optim.Adam(p), optim.adam(), steps=3)
    assert state["step"].item() == 3


# -- purity -------------------------------------------------------------------------------------


def snapshot(*trees):
    leaves = [leaf for tree in trees for leaf in optree.tree_leaves(tree)]
    return leaves, [leaf.clone() for leaf in leaves], [leaf._version for leaf in leaves]


def assert_untouched(snap) -> None:
    leaves, copies, versions = snap
    for leaf, copied, version in zip(leaves, copies, versions, strict=True):
        assert torch.equal(leaf, copied)
        assert leaf._version == version


OPTIMIZERS = [
    optim.sgd(lr=0.1),
    optim.sgd(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.1, maximize=True),
    optim.sgd(lr=0.1, momentum=0.9, nesterov=True),
    optim.adam(lr=0.1, weight_decay=0.1, maximize=True, amsgrad=True),
    optim.adamw(lr=0.1),
    optim.adamw(lr=torch.tensor(0.1), betas=(torch.tensor(0.8), 0.99)),
]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("recording", [False, True], ids=["foreach", "per-leaf"])
def test_step_mutates_no_input(opt, recording):
    params = make_params()
    if recording:  # autograd records the step: the per-leaf path
        params = optree.tree_map(lambda leaf: leaf.requires_grad_(), params)
    state = opt.init(params)
    generator = torch.Generator().manual_seed(0)
    params, state = opt.step(params, grads_like(params, generator), state)
    grads = grads_like(params, generator)
    snap = snapshot(params, grads, state)
    new_params, _ = opt.step(params, grads, state)
    assert_untouched(snap)
    inputs = {id(leaf) for leaf in snap[0]}
    assert optree.tree_structure(new_params) == optree.tree_structure(params)
    assert not any(id(leaf) in inputs for leaf in optree.tree_leaves(new_params))


def test_foreach_and_per_leaf_paths_agree():
    for opt in OPTIMIZERS:
        params = make_params()
        recorded = optree.tree_map(lambda leaf: leaf.clone().requires_grad_(), params)
        state = recorded_state = opt.init(params)
        generator = torch.Generator().manual_seed(0)
        for _ in range(5):
            grads = grads_like(params, generator)
            params, state = opt.step(params, grads, state)
            recorded, recorded_state = opt.step(recorded, grads, recorded_state)
        assert recorded["head"]["weight"].grad_fn is not None
        for a, b in zip(
            optree.tree_leaves((params, state)),
            optree.tree_leaves((recorded, recorded_state)),
            strict=True,
        ):
            assert torch.equal(a, b.detach())  # on CPU the _foreach_ kernels loop the same ops


def test_none_gradient_leaves_a_leaf_and_its_state_alone():
    params = make_params()
    opt = optim.adam(lr=0.1)
    state = opt.init(params)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        grads = grads_like(params, generator)
        grads["encoder"]["bias"] = None
        new_params, new_state = opt.step(params, grads, state)
        assert new_params["encoder"]["bias"] is params["encoder"]["bias"]
        assert new_state["exp_avg"]["encoder"]["bias"] is state["exp_avg"]["encoder"]["bias"]
        assert not torch.equal(new_params["head"]["weight"], params["head"]["weight"])
        params, state = new_params, new_state

    no_grads = optree.tree_map(lambda _: None, params)
    new_params, new_state = opt.step(params, no_grads, state)
    assert all(
        a is b
        for a, b in zip(optree.tree_leaves(new_params), optree.tree_leaves(params), strict=True)
    )
    assert new_state["step"].item() == 4


def test_frozen_leaves_match_torch_skipping_them():
    params = make_params()
    leaves, _ = optree.tree_flatten(params)
    torch_params = [leaf.clone().requires_grad_() for leaf in leaves]
    torch_opt = torch.optim.SGD(torch_params, lr=0.1, momentum=0.9)
    opt = optim.sgd(lr=0.1, momentum=0.9)
    state = opt.init(params)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        grads = grads_like(params, generator)
        grads["encoder"]["bias"] = None  # sorted leaf order: encoder.bias is leaf 0
        for i, (param, grad) in enumerate(
            zip(torch_params, optree.tree_leaves(grads, none_is_leaf=True), strict=True)
        ):
            param.grad = None if i == 0 else grad.clone()
        torch_opt.step()
        params, state = opt.step(params, grads, state)
    for a, b in zip(optree.tree_leaves(params), torch_params, strict=True):
        torch.testing.assert_close(a, b.detach())


# -- refused calls -------------------------------------------------------------------------------


def test_bad_hyperparameters_are_refused():
    with pytest.raises(ValueError, match=r"^sgd: 'lr': invalid value -1\.0 .*; pass a lr >= 0"):
        optim.sgd(lr=-1.0)
    with pytest.raises(ValueError, match="Nesterov"):
        optim.sgd(lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="beta2"):
        optim.adam(betas=(0.9, 1.0))
    with pytest.raises(
        ValueError, match=r"a tensor of shape \(2, 1\); a hyperparameter is a number"
    ):
        optim.adam(lr=torch.tensor([[0.1], [0.2]]))  # 1-D: one value per member (test_per_member)
    with pytest.raises(TypeError, match="eps"):
        optim.adam(eps="small")


def test_trees_that_do_not_fit_name_the_path():
    opt = optim.adam()
    params = make_params()
    state = opt.init(params)
    grads = optree.tree_map(torch.ones_like, params)

    missing = copy.copy(grads)
    missing["encoder"] = {"weight": grads["encoder"]["weight"]}
    with pytest.raises(ValueError, match=r"^adam\.step: 'encoder\.bias': a path of params"):
        opt.step(params, missing, state)

    wrong_shape = {**grads, "head": {"weight": torch.ones(4, 2)}}
    with pytest.raises(ValueError, match=r"^adam\.step: 'head\.weight': grads has shape \(4, 2\)"):
        opt.step(params, wrong_shape, state)

    with pytest.raises(ValueError, match=r"^adam\.step: 'state': .* keeps"):
        opt.step(params, grads, optim.sgd(lr=0.1).init(params))

    with pytest.raises(TypeError, match=r"^adam\.init: 'head\.weight': a str leaf, not a tensor"):
        opt.init({"head": {"weight": "w"}})
    # The fix the message names: None is an empty subtree.
    assert opt.init({"head": {"weight": None}})["exp_avg"] == {"head": {"weight": None}}


@pytest.mark.parametrize(
    "factory",
    [
        optim.sgd,
        optim.adam,
        optim.adamw,
        optim.rmsprop,
        optim.adagrad,
        optim.adamax,
        optim.nadam,
        optim.radam,
        optim.adadelta,
    ],
)
def test_grads_of_another_dtype_are_refused_before_the_step_and_the_cast_works(factory):
    opt = factory(lr=0.1)
    params = make_params()  # float32
    state = opt.init(params)
    grads = grads_like(make_params(dtype=torch.float64), torch.Generator().manual_seed(1))
    kept = copy.deepcopy((params, state))
    with pytest.raises(
        ValueError,
        match=r"^\w+\.step: 'encoder\.weight': grads is torch\.float64, but the param there is "
        r"torch\.float32; cast the gradients to the params' dtype first: grads = "
        r"ms\.tree\.to\(grads, torch\.float32\)",
    ):
        opt.step(params, grads, state)
    after = optree.tree_leaves((params, state))
    for leaf_before, leaf_after in zip(optree.tree_leaves(kept), after, strict=True):
        assert torch.equal(leaf_before, leaf_after)  # nothing ran

    new_params, _ = opt.step(params, ms.tree.to(grads, torch.float32), state)  # the fix
    assert all(leaf.dtype == torch.float32 for leaf in optree.tree_leaves(new_params))
    assert not torch.equal(new_params["head"]["weight"], params["head"]["weight"])


def test_state_of_another_dtype_is_refused_and_init_from_the_params_fits():
    opt = optim.adam(lr=0.1)
    params = make_params()
    grads = grads_like(params, torch.Generator().manual_seed(1))
    state = opt.init(make_params(dtype=torch.float64))
    with pytest.raises(
        ValueError,
        match=r"^adam\.step: 'encoder\.weight': state\['exp_avg'\] is torch\.float64, but the param "
        r"there is torch\.float32; make the state from these params: state = opt\.init\(params\)",
    ):
        opt.step(params, grads, state)
    new_params, new_state = opt.step(params, grads, opt.init(params))  # the fix
    assert new_state["exp_avg"]["head"]["weight"].dtype == torch.float32
    assert new_params["head"]["weight"].dtype == torch.float32


# -- tied weights -------------------------------------------------------------------------------
# extract and split list a tie (an embedding tied to the output head) at each of its paths. The
# step takes the tie once, with the gradient at its first path (where torch.func puts it), and
# gives one new tensor for all its paths, so the new params still fit the model.


class _SortsHeadFirst(nn.Module):
    """Tied as GPT-2 is: the embedding comes first in module order, the head first in sorted
    order (optree sorts dict keys), so the two orders disagree about the tie's first path."""

    def __init__(self) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(10, 4)
        self.lm_head = nn.Linear(4, 10, bias=False)
        self.lm_head.weight = self.token_embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.token_embedding(tokens)))


def _tied_lm(kind: str = "TiedLM") -> nn.Module:
    from zoo import TiedLM

    torch.manual_seed(0)
    return TiedLM() if kind == "TiedLM" else _SortsHeadFirst()


TOKENS = torch.tensor([[1, 2, 3], [4, 5, 6]])


@pytest.mark.parametrize("kind", ["TiedLM", "sorts head first"])
@pytest.mark.parametrize("donate", [False, True])
def test_a_tied_model_trains_functionally_as_with_torch_optim(donate, kind):
    lm = _tied_lm(kind)
    reference = copy.deepcopy(lm)  # deepcopy keeps the tie
    params, state = ms.split(lm, detach=True)
    opt = optim.adam(lr=0.1)
    opt_state = opt.init(params)
    first, second = [
        path for path in ms.flatten(params) if path.endswith("weight") and "body" not in path
    ]
    assert ms.flatten(opt_state["exp_avg"])[first] is ms.flatten(opt_state["exp_avg"])[second]
    torch_opt = torch.optim.Adam(reference.parameters(), lr=0.1)

    def loss(p: dict) -> torch.Tensor:
        return ms.call(lm, (p, state), TOKENS).square().mean()

    for _ in range(3):
        grads = torch.func.grad(loss)(params)
        params, opt_state = opt.step(params, grads, opt_state, donate=donate)
        torch_opt.zero_grad()
        reference(TOKENS).square().mean().backward()
        torch_opt.step()
    assert ms.flatten(params)[first] is ms.flatten(params)[second]
    for path, want in ms.flatten(ms.extract(reference, detach=True)).items():
        torch.testing.assert_close(ms.flatten(params)[path], want, msg=path)


def test_a_tie_with_one_gradient_object_at_both_paths_is_stepped_once():
    # torch.autograd.grad gives the whole gradient at each path of a tie (one tensor twice).
    lm = _tied_lm()
    params = ms.tree.map(torch.Tensor.requires_grad_, ms.split(lm, detach=True)[0])
    leaves = list(ms.flatten(params).values())
    gradients = torch.autograd.grad(ms.call(lm, params, TOKENS).sum(), leaves)
    grads = ms.unflatten(dict(zip(ms.flatten(params), gradients, strict=True)))
    with torch.no_grad():
        new, _ = optim.sgd(lr=0.5).step(params, grads, optim.sgd(lr=0.5).init(params))
    expected = params["embed"]["weight"] - 0.5 * grads["embed"]["weight"]
    assert new["head"]["weight"] is new["embed"]["weight"]
    assert torch.equal(new["embed"]["weight"], expected)
