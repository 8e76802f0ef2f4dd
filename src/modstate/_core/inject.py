"""Putting a tree into a module: ``inject`` (for a block) and ``swap`` (for good); ``load``, which
copies values in, is in ``load``."""

from __future__ import annotations

from torch import nn

from modstate._core.errors import (
    PathError,
)
from modstate._core.module.anatomy import anatomy_of, forget
from modstate._core.swap.prepare import prepare, prepare_hooked
from modstate._core.swap.swaps import HookedSwap, Swap
from modstate._core.torch_facts import eager_route
from modstate._core.types import Tree, TreeArg


class inject:
    """Inside the block, ``module`` computes with the tree's tensors; afterwards it holds its own.

    The tree's tensors go in as they are, no copy: gradients reach the tree's leaves, and batched
    tensors under ``torch.vmap`` work. On exit, also when the body raised, the module holds the very
    same objects it held before, with the same ``requires_grad``. A buffer that ``forward``
    reassigns (``self.count = self.count + 1``) is written back into ``tree``. In-place updates
    (BatchNorm statistics) land in the tree's tensors. Tensors the module keeps as plain attributes
    and lazy modules' class and hooks are restored too; other plain attributes that ``forward``
    assigns (counters, a Llama dynamic RoPE's ``max_seq_len_cached``) are not, as with
    ``torch.func.functional_call`` (see [`modstate.call`][modstate.call]). For every thread: while the block
    runs, a plain forward in any thread computes with the tree; a concurrent ``ms.call`` with
    its own tree is not affected (see "Threads" in ``docs/semantics.md``).

    Where the module holds one tensor at several paths (tied weights), one path sets them all;
    giving different tensors at two of them is an error. The tensor at the first of the paths (in
    module order) serves them all: under ``torch.func`` transforms, which wrap a tensor given at
    two paths into two wrappers, the gradient of the tie lands at that first path. A tree may be
    nested, flat (``state_dict()``'s dotted keys: a dotted key is the path it spells) or both, as
    long as it gives each path once.

    Args:
        module: The module to compute with the tree.
        tree: A tree of tensors, or a tuple of trees that together give the paths (a None leaf
            is a hole), such as ``ms.split(module)``'s ``(params, state)``.
        strict: ``True``: the tree's paths are the module's (as ``extract`` gives them) with the
            same shapes and dtypes; non-persistent buffers may be left out (``state_dict`` leaves
            them out; the module keeps its own there), and so may the other paths of a tie group
            given once. ``False``: a partial tree (missing paths keep the module's tensors), other
            shapes and dtypes. Unknown paths are always an error.
        use_state_dict: Read the tree as ``load_state_dict`` reads it: through the module's load
            pre-hooks (renames, legacy keys, lazy materialization) and post-hooks, with its
            ``set_extra_state``; the module is restored on exit all the same.

    Returns:
        A context manager; ``with`` gives ``module`` itself.

    Raises:
        KeyError: An unknown path, or (strict) a missing one (``MissingPaths``, whose ``paths``
            lists them all).
        ValueError: A shape differs (strict), two tied paths get different tensors, or a path is
            given twice.
        TypeError: A dtype differs (strict), or a leaf is not a tensor.
        RuntimeError: The same ``inject`` object is entered twice.

        A refused tree changes nothing.

    Example:
        >>> import torch, modstate as ms
        >>> lin = torch.nn.Linear(2, 2)
        >>> with ms.inject(lin, {"weight": torch.zeros(2, 2), "bias": torch.ones(2)}):
        ...     lin(torch.randn(1, 2))
        tensor([[1., 1.]])
    """

    __slots__ = ("_module", "_strict", "_swap", "_tree", "_use_state_dict")

    def __init__(
        self,
        module: nn.Module,
        tree: TreeArg,
        *,
        strict: bool = True,
        use_state_dict: bool = False,
    ) -> None:
        self._module = module
        self._tree = tree
        self._strict = strict
        self._use_state_dict = use_state_dict
        self._swap: Swap | None = None

    def __enter__(self) -> nn.Module:
        return eager_route(self._enter)

    def _enter(self) -> nn.Module:
        if self._swap is not None:
            raise RuntimeError(
                "inject: this inject(...) block is already active; make a new inject(...) for "
                "each with statement"
            )
        try:
            if self._use_state_dict:
                sharding = anatomy_of(self._module).sharding
                if sharding is not None:
                    sharding.refuse_state_dict_route("inject")
                plan, guard = prepare_hooked(self._module, self._tree, self._strict, in_place=False)
                swap: Swap = HookedSwap(plan, self._tree, guard)
            else:
                swap = prepare(self._module, self._tree, self._strict, compute=True)
        except PathError as error:
            raise error.within("inject") from None
        swap.apply()
        self._swap = swap
        return self._module

    def __exit__(self, *exc_info: object) -> None:
        swap, self._swap = self._swap, None
        if swap is not None:
            eager_route(swap.undo)


def swap(
    module: nn.Module,
    tree: TreeArg,
    *,
    strict: bool = True,
    use_state_dict: bool = False,
) -> Tree:
    """Put the tree's tensors into ``module`` for good; return a tree of what they replaced.

    The permanent form of [`inject`][modstate.inject], with the same checks, so ``swap(module, old)`` undoes it.
    The tree's objects go in as they are (a plain tensor stays a plain tensor in ``_parameters``;
    pass ``nn.Parameter`` leaves to keep parameters parameters). It changes the module for every
    thread that uses it.

    Args:
        module: The module to change.
        tree: A tree of tensors, or a tuple of trees (as for [`inject`][modstate.inject]).
        strict: As for [`inject`][modstate.inject].
        use_state_dict: As for [`inject`][modstate.inject].

    Returns:
        A new tree of the objects the module held at the tree's paths.

    Raises:
        KeyError: An unknown path, or (strict) a missing one.
        ValueError: A shape differs (strict), tied paths get different tensors, a path is given
            twice, or a parameter is one that FSDP2 owns (it gathers its own before each forward).
        TypeError: A dtype differs (strict), or a leaf is not a tensor.

        A refused tree changes nothing.

    Example:
        >>> import torch, modstate as ms
        >>> lin = torch.nn.Linear(2, 2)
        >>> old = ms.swap(lin, {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)})
        >>> _ = ms.swap(lin, old)  # back to the original Parameters
    """
    try:
        if use_state_dict:
            plan, guard = prepare_hooked(module, tree, strict, in_place=False)
            guard.restore()  # the replaced tensors stay unmaterialized: swapping back restores all
            prepared: Swap = HookedSwap(plan, tree, None)
        else:
            prepared = prepare(module, tree, strict)
    except PathError as error:
        raise error.within("swap") from None
    sharding = anatomy_of(module).sharding
    if sharding is not None:
        sharding.check_swappable(prepared.tables, prepared.names)
    prepared.apply()
    forget(module)
    return prepared.replaced()
