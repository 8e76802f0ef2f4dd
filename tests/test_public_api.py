"""Every public name of the API contract imports from its documented place, and is listed there."""

import importlib

import pytest

PUBLIC = {
    "modstate": [
        "extract", "inject", "swap", "load", "call", "call_partial", "split", "apply", "flatten",
        "unflatten", "grad", "grad_and_value",
        "stack", "unstack", "stack_modules", "vmap_call", "Ensemble", "update_bn",
    ],
    "modstate.tree": [
        "map", "map_with_path", "reshape", "view", "unbind", "split", "add", "sub", "mul",
        "lerp", "zeros_like", "clone", "detach", "to", "select", "exclude", "summary",
        "partition", "combine", "is_float", "is_trainable", "mean",
    ],
    "modstate.optim": [
        "sgd", "adam", "adamw", "rmsprop", "adagrad", "adamax", "nadam", "radam", "adadelta",
        "clip_grad_norm", "masked", "optimizer_state", "load_optimizer_state", "schedules",
        "Optimizer",
    ],
    "modstate.optim.schedules": [
        "constant", "step", "multistep", "exponential", "cosine", "linear_warmup",
        "warmup_cosine", "onecycle",
    ],
    "modstate.checkpoint": ["save", "load", "save_distributed", "load_distributed"],
}  # fmt: skip

CASES = [(module, name) for module, names in PUBLIC.items() for name in names]


@pytest.mark.parametrize(("module", "name"), CASES, ids=[f"{m}.{n}" for m, n in CASES])
def test_public_name_imports_from_its_documented_place(module, name):
    namespace = importlib.import_module(module)
    assert hasattr(namespace, name), f"{module} has no {name!r}"
    assert name in namespace.__all__, f"{module}.__all__ does not list {name!r}"


def test_the_version_is_the_distribution_version():
    import importlib.metadata

    import modstate

    assert modstate.__version__ == importlib.metadata.version("modstate")
