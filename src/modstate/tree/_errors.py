"""How `modstate.tree` names the place of an error: one wrapper on the way up, one message format.

A leaf operation that fails raises its plain error; each container it passes through on the way
up adds its key (`at_key`), so paths cost nothing unless something fails. The public function
runs its walk through `naming_paths`, which catches the wrapper once and raises the library's one error format::

    tree.<function>: '<dotted.path>': <what>; <fix>

(``'<path>'`` is left out when the error concerns no single place, such as a bad argument; see
``docs/semantics.md``, "Errors").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from modstate._core.errors import message as core_message

# Errors from modstate's own leaf operations, re-raised as the same class with the path in front.
_PLAIN_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError)


class AtPath(Exception):
    """An error raised somewhere inside a tree, on its way up to the public function.

    ``keys`` collects the path innermost first; `path` reads it as a dotted string.
    """

    def __init__(self, error: BaseException, *keys: Any) -> None:
        super().__init__(error)
        self.error = error
        self.keys: list[Any] = list(keys)

    @property
    def path(self) -> str:
        return ".".join(str(key) for key in reversed(self.keys))


class StructureMismatch(ValueError):
    """Two trees that should have the same structure differ (raised inside an `AtPath`)."""


def at_key(error: Exception, key: Any) -> AtPath:
    """``error``, raised under ``key`` of a container, as the `AtPath` its parent re-raises."""
    if isinstance(error, AtPath):
        error.keys.append(key)
        return error
    return AtPath(error, key)


def refuse_non_tensor(leaf: Any) -> NoReturn:
    raise TypeError(f"expected a tensor leaf, got {type(leaf).__name__}")


def message(op: str, what: str, path: str | None = None) -> str:
    """``"tree.<op>: '<path>': <what>"``: the library's one error format (`_core.errors.message`)
    for the public function ``tree.<op>``, the path left out when there is none."""
    return core_message(f"tree.{op}", path or "", what)


Result = TypeVar("Result")


def naming_paths(op: str, walk: Callable[..., Result], *args: Any, user_fn: bool = False) -> Result:
    """``walk(*args)``, with an `AtPath` or `StructureMismatch` from it raised as ``tree.<op>``'s
    error.

    Errors from modstate's own leaf operations come out as the same builtin class with the
    message in the library's format. An exception from a user's function (``user_fn``), or of an
    uncommon class, is re-raised as the very same object with the path added as a note (Python
    3.11+), so that callers catching it still can.
    """
    try:
        return walk(*args)
    except AtPath as wrapped:
        _raise_at(op, wrapped, user_fn=user_fn)
    except StructureMismatch as error:
        _raise_at(op, AtPath(error))


def _raise_at(op: str, wrapped: AtPath, *, user_fn: bool = False) -> NoReturn:
    error = wrapped.error
    path = wrapped.path if wrapped.keys else None
    if isinstance(error, StructureMismatch):
        what = "structure mismatch" + (": " if path is not None else " at the root: ")
        raise ValueError(message(op, what + str(error), path)) from None
    if not user_fn and type(error) in _PLAIN_ERRORS:
        what = str(error) if path is not None else f"at the root: {error}"
        raise type(error)(message(op, what, path)) from error
    where = repr(path) if path is not None else "the root"
    error.add_note(f"raised by the function given to tree.{op}, at leaf {where}")
    raise error
