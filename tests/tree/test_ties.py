"""A tied weight stays tied through every tree op, so the result still fits the model.

``extract`` lists a tie (an embedding tied to the output head) at each of its paths, and
``inject`` refuses two different tensors there. These are the ways users meet it: a target
network cloned from a tied model, an EMA of it, a hand-written SGD step.
"""

import torch

import modstate as ms

from zoo import TiedLM

TOKENS = torch.tensor([[1, 2, 3], [4, 5, 6]])


def tied_tree() -> tuple[TiedLM, dict]:
    torch.manual_seed(0)
    lm = TiedLM()
    return lm, ms.extract(lm, detach=True)


def test_a_cloned_tree_of_a_tied_model_keeps_the_tie_and_runs_the_model():
    lm, tree = tied_tree()
    target = ms.tree.clone(tree)
    assert target["embed"]["weight"] is target["head"]["weight"]
    assert target["embed"]["weight"] is not tree["embed"]["weight"]
    torch.testing.assert_close(ms.call(lm, target, TOKENS), lm(TOKENS))


def test_every_op_that_makes_new_leaves_keeps_ties():
    _, tree = tied_tree()
    other = ms.tree.map(torch.ones_like, tree)
    results = {
        "map": ms.tree.map(lambda leaf: leaf * 2, tree),
        "map, two trees": ms.tree.map(torch.add, tree, other),
        "add": ms.tree.add(tree, other),
        "sub with alpha": ms.tree.sub(tree, other, alpha=0.1),
        "mul by a number": ms.tree.mul(tree, 3.0),
        "lerp (EMA)": ms.tree.lerp(tree, other, 0.01),
        "zeros_like": ms.tree.zeros_like(tree),
        "detach": ms.tree.detach(tree),
        "to": ms.tree.to(tree, torch.float64),
        "reshape": ms.tree.reshape(tree, (-1,), batch_ndim=1),
        "view": ms.tree.view(tree, (-1,), batch_ndim=1),
    }
    for name, result in results.items():
        assert result["embed"]["weight"] is result["head"]["weight"], name
    stacked = ms.stack([tree, tree])  # ties kept
    for piece in (
        ms.tree.unbind(stacked) + ms.tree.split(stacked, 1) + ms.tree.split(stacked, [1, 1])
    ):
        assert piece["embed"]["weight"] is piece["head"]["weight"]


def test_the_first_place_of_a_tie_decides():
    # A gradient tree from torch.func holds the whole gradient of a tie at its first path and
    # zero at the others: a hand-written SGD step must use the first.
    lm, params = tied_tree()
    grads = torch.func.grad(lambda p: ms.call(lm, p, TOKENS).square().mean())(params)
    assert grads["head"]["weight"].abs().sum() == 0
    stepped = ms.tree.sub(params, grads, alpha=0.1)
    expected = params["embed"]["weight"] - 0.1 * grads["embed"]["weight"]
    assert torch.equal(stepped["head"]["weight"], expected)
    ms.call(lm, stepped, TOKENS)  # fits the model


def test_a_user_function_runs_once_per_tie():
    _, tree = tied_tree()
    calls = []
    ms.tree.map(lambda leaf: calls.append(leaf.shape) or leaf, tree)
    assert len(calls) == len(ms.flatten(tree)) - 1  # embed.weight and head.weight are one leaf


def test_trees_without_ties_are_unchanged_by_the_rule():
    tree = {"a": torch.zeros(2), "b": torch.zeros(2)}  # equal values, different tensors
    out = ms.tree.add(tree, 1)
    assert out["a"] is not out["b"]


def test_map_with_path_runs_a_tie_once_with_its_first_path():
    _, tree = tied_tree()
    tree["tail"] = {"w": torch.zeros(1)}  # a leaf after the tie's second path
    paths = ms.tree.map_with_path(lambda path, leaf: path, tree)
    assert paths["embed"]["weight"] == paths["head"]["weight"] == "embed.weight"
    assert paths["tail"]["w"] == "tail.w"  # the paths after the tie stay in step
    scaled = ms.tree.map_with_path(lambda path, leaf: leaf * 2, tree)
    assert scaled["embed"]["weight"] is scaled["head"]["weight"]
