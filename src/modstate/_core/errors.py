"""The errors of the engine that every route raises alike, in the one format of modstate's errors:
``"<function>: '<path>': <what>; <fix>"``.

The engine (``prepare``) does not know which public function it serves, so it raises a
`PathError` without a function name and with the fix that fits the lenient options of
``inject``; each public function re-raises it with `PathError.within`, naming itself and a fix
that works where the user is (``call`` has no ``strict`` option, ``load`` never takes other shapes).
An `OtherModel` (a shape that differs) keeps its own fix: no function's lenient option is right
for a tree of another model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from modstate._core.torch_facts import differentiable_dtype

if TYPE_CHECKING:
    from torch import Tensor


_E = TypeVar("_E", bound="PathError")


def message(function: str, path: str, what: str, fix: str = "") -> str:
    """``"<function>: '<path>': <what>; <fix>"``, leaving out the parts that are empty."""
    text = f"{path!r}: {what}" if path else what
    if function:
        text = f"{function}: {text}"
    return f"{text}; {fix}" if fix else text


class PathError(Exception):
    """An error about one path of a tree: ``path``, ``what`` is wrong there, the ``fix``, and the
    public ``function`` that raised it (empty while the engine raises it)."""

    def __init__(self, path: str, what: str, fix: str = "", function: str = "") -> None:
        self.path = path
        self.what = what
        self.fix = fix
        self.function = function
        super().__init__(message(function, path, what, fix))

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])

    def within(self: _E, function: str, fix: str | None = None) -> _E:
        """The same error as ``function`` raises it, with ``fix`` instead of the engine's fix."""
        error = type(self).__new__(type(self))
        error.__dict__.update(self.__dict__)
        error.function = function
        if fix is not None:
            error.fix = fix
        Exception.__init__(error, message(function, error.path, error.what, error.fix))
        return error

    def __reduce__(self) -> tuple[Any, ...]:  # picklable (multiprocessing) despite __init__'s args
        return (_rebuilt, (type(self), self.__dict__.copy(), self.args))


def _rebuilt(cls: type[PathError], state: dict[str, Any], args: tuple) -> PathError:
    error = cls.__new__(cls)
    error.__dict__.update(state)
    Exception.__init__(error, *args)
    return error


class PathValueError(PathError, ValueError):
    """A `PathError` that is a ``ValueError``: the value at ``path`` is wrong."""


class PathTypeError(PathError, TypeError):
    """A `PathError` that is a ``TypeError``: the value at ``path`` has the wrong type."""


class PathKeyError(PathError, KeyError):
    """A `PathError` that is a ``KeyError``: ``path`` is missing or unknown."""


class MissingPaths(PathKeyError):
    """A strict tree that leaves out some of the module's paths; ``paths`` lists them all, ``path``
    is the first."""

    def __init__(self, paths: list[str], fix: str, function: str = "") -> None:
        self.paths = paths
        others = ", ".join(repr(p) for p in paths[1:5]) + (" ..." if len(paths) > 5 else "")
        what = "the tree has no tensor there" + (
            f", nor at {others} ({len(paths)} paths missing)" if others else ""
        )
        super().__init__(paths[0], what, fix, function)


class ShapeMismatch(PathValueError):
    """The tree's tensor at ``path`` has another shape than the module's."""


class DtypeMismatch(PathTypeError):
    """The tree's tensor at ``path`` has another dtype than the module's."""


class FloatedCounter(DtypeMismatch):
    """The tree has a floating-point tensor where the module has an integer (or bool) one,
    BatchNorm's ``num_batches_tracked`` after an op on every leaf: ``strict=False`` would round
    it or float the module's counter, so the fix is the module's own integer leaves instead."""


class UnknownPath(PathKeyError):
    """The tree gives a path at which the module holds no parameter or buffer."""


class DuplicatePath(PathValueError):
    """The tree gives one path twice (as a dotted key and nested, or in two trees of a tuple)."""


_ANOTHER_MODEL = "the tree is another model's (another architecture or configuration)"
_ANOTHER_MODEL_FIX = (
    "build the model the tree was taken from (the same class and configuration) and use the "
    "tree with it, or take this model's own tree with ms.extract(model)"
)


class OtherModel(ShapeMismatch):
    """A `ShapeMismatch` that says what it means: the tree is another model's (another
    architecture or configuration), or a stack of trees. Its fix is its own, whichever public
    function raises it: ``strict=False`` would run the module at the tree's shapes, another model
    without a word."""

    def within(self: _E, function: str, fix: str | None = None) -> _E:
        return super().within(function)  # the fix of a function's lenient options does not apply


class MetaLeaf(PathValueError):
    """The tree's tensor at ``path`` is on the meta device (shapes only, no data) where the
    module's holds data: computing with it cannot work."""


def shape_mismatch(path: str, leaf: Tensor, current: Tensor, others: int = 0) -> OtherModel:
    """The shape error at ``path``; ``others`` counts the tree's other leaves whose shapes differ
    from the module's."""
    what = f"shape {tuple(leaf.shape)} in the tree, {tuple(current.shape)} in the module"
    if leaf.dim() == current.dim() + 1 and leaf.shape[1:] == current.shape:
        return OtherModel(
            path,
            f"{what}: a stack of {leaf.shape[0]} trees (one per ensemble member, as ms.stack "
            "gives), not one",
            "call all the members at once with ms.vmap_call(module, stacked, x), or take one: "
            "ms.unstack(stacked)[i]",
        )
    if others:
        what += f", and {others} more of the tree's tensors have other shapes than the module's"
    return OtherModel(
        path,
        f"{what}: {_ANOTHER_MODEL}",
        _ANOTHER_MODEL_FIX,
    )


def dtype_mismatch(path: str, leaf: Tensor, current: Tensor) -> DtypeMismatch:
    found = f"dtype {leaf.dtype} in the tree, {current.dtype} in the module"
    if differentiable_dtype(leaf.dtype) and not differentiable_dtype(current.dtype):
        return FloatedCounter(path, found, _FLOATED_COUNTER_FIX)
    return DtypeMismatch(path, found, "strict=False accepts other dtypes")


# strict=False is not offered here: it would cast 2.5 to 2 (load) or give the module a float
# counter (call / inject). combine keeps the first tree's leaf where two trees have one.
_FLOATED_COUNTER_FIX = (
    "an integer counter (BatchNorm's num_batches_tracked) was made floating-point by an op on "
    "every leaf, and strict=False would round it; keep the module's own integer leaves: tree = "
    "ms.tree.combine(ms.tree.partition(ms.extract(model), ms.tree.is_float)[1], tree), and apply "
    "such ops to the floating-point leaves only (ms.tree.partition, then ms.tree.combine)"
)


def meta_leaf(path: str, current: Tensor) -> MetaLeaf:
    return MetaLeaf(
        path,
        f"the tree's tensor is on the meta device (shapes only, no data), the module's on "
        f"{current.device}",
        "materialize the tree first: read it from a checkpoint (tree = "
        "ms.checkpoint.load(path)), or materialize the meta model it came from, "
        f"meta_model.to_empty(device={str(current.device)!r}) then ms.load(meta_model, weights), "
        "or "
        "ms.load(meta_model, weights, assign=True), and take tree = ms.extract(meta_model)",
    )


def not_a_module(function: str, value: object) -> TypeError:
    """The error for a verb that takes a module given something else (a state dict, a tree)."""
    name = type(value).__name__
    found = f"an {name}" if name[:1] in "AEIOU" else f"a {name}"
    if isinstance(value, dict):
        return TypeError(
            message(
                function,
                "",
                f"got {found} (a state dict or a tree), not an nn.Module; {function} takes the "
                f"module itself: ms.{function}(model)",
                "a state dict is already a tree in flat form: ms.unflatten(state_dict) nests "
                "its dotted keys (as ms.extract(model, use_state_dict=True, detach=True) does), "
                "and ms.call, ms.inject and ms.load take it as it is",
            )
        )
    return TypeError(
        message(
            function, "", f"got {found}, not an nn.Module", f"pass the module: ms.{function}(model)"
        )
    )
