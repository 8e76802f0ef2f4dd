"""``Ensemble``: N copies of one model, held as stacked parameters, run at once."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from modstate._core.anatomy import slot_at
from modstate._core.extract import extract
from modstate._core.flat import Layout, flatten
from modstate._core.inject import swap

from ._batched import PlanContext, Slot, compile_plan, layer_names, vmap_runner
from ._stack import stack_modules
from ._vmap import InDims

_RANDOMNESS = ("error", "different", "same")


class Ensemble(nn.Module):
    """N models of one architecture as one module: the stacked state is its parameters and buffers.

    ``Ensemble(models)`` stacks the models' parameters and buffers (they must agree in structure,
    shapes, dtypes and training mode; see [`stack_modules`][modstate.stack_modules]) and registers the stacked tensors
    on ``self.stacked``, a mirror of the model's module tree: the stacked tensor of the members'
    ``"0.weight"`` is ``ensemble.stacked.get_submodule("0").weight`` (leading dim N), and ``state_dict`` keys are
    ``"stacked.0.weight"`` and so on. ``ms.extract(ensemble.stacked)`` is the stacked tree. Hence
    ``ensemble.parameters()`` goes straight into a ``torch.optim`` optimizer, ``state_dict`` /
    ``load_state_dict`` round-trip, and ``.to()`` / ``.double()`` move everything. The models
    themselves are left alone: the ensemble keeps a private copy of the first as a template.

    ``forward(*args, **kwargs)`` runs every member and returns the stacked outputs (dim 0 is the
    member). ``in_dims=None`` (default): all members see the same inputs; ``in_dims=0``: each
    positional input holds one slice per member along dim 0; a tuple: per input, as in
    ``torch.vmap``. Keyword arguments are always shared. ``len(ensemble)`` is N.

    Speed: a model made of layers with a known batched form (``Sequential`` of ``Linear``,
    ``Conv1d/2d/3d``, ``LayerNorm``, ``Dropout``, ``Flatten``, ``Identity`` and elementwise
    activations such as ``ReLU``, ``GELU``, ``Tanh``, ``Sigmoid``, ``SiLU``) runs them as one
    batched kernel each on the stacked tensors (``torch.baddbmm``, grouped convolution), with the
    same results and gradients as the per-model loop; any other submodule runs under
    ``torch.vmap`` over [`modstate.call`][modstate.call] with its slice of the stacked state (BatchNorm
    statistics update per member). ``fast=False`` runs the whole model under vmap (the reference
    path). ``compile=True`` wraps the forward in ``torch.compile(dynamic=False)`` (a new input
    shape compiles again); eager is faster for small models, where guards cost more than they
    save. ``randomness`` is vmap's, with
    the default of [`vmap_call`][modstate.vmap_call] and ``torch.vmap``, ``"error"``: a random op in a member
    (dropout in training mode) is refused until you choose ``"different"`` (an independent mask
    per member, like a loop over the models) or ``"same"`` (one mask shared by all). A layer with
    hooks of its own runs under vmap, so that its hooks run; the plan is made once, when the
    ensemble is built (global module hooks are not seen by the batched kernels).

    ``mesh=`` (a 1-D ``DeviceMesh``) spreads the members over its ranks: the stacked tensors are
    ``DTensor`` s sharded on the member dim, each rank builds and runs only its members, and
    ``from_factory`` builds member ``i`` under ``torch.manual_seed(i)`` (see
    `MemberParallelEnsemble`).

    >>> import torch, modstate as ms
    >>> ens = ms.Ensemble.from_factory(lambda: torch.nn.Sequential(
    ...     torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)), 5)
    >>> ens(torch.randn(16, 3)).shape
    torch.Size([5, 16, 1])
    >>> opt = torch.optim.Adam(ens.parameters(), lr=1e-3)
    >>> ens.member(2)  # an ordinary module with member 2's weights
    Sequential(
      (0): Linear(in_features=3, out_features=8, bias=True)
      (1): ReLU()
      (2): Linear(in_features=8, out_features=1, bias=True)
    )
    """

    def __new__(cls, *args: Any, mesh: Any = None, **kwargs: Any) -> Ensemble:
        # mesh= (a 1-D DeviceMesh) makes the member-parallel form (ensemble/_sharded.py).
        if mesh is not None and cls is Ensemble:
            from ._sharded import MemberParallelEnsemble

            cls = MemberParallelEnsemble
        return super().__new__(cls)

    def __init__(
        self,
        modules: Iterable[nn.Module],
        *,
        compile: bool = False,
        in_dims: InDims = None,
        randomness: str = "error",
        fast: bool = True,
    ) -> None:
        super().__init__()
        modules = list(modules)
        if randomness not in _RANDOMNESS:
            raise ValueError(f"randomness must be one of {_RANDOMNESS}, got {randomness!r}")
        if in_dims is not None and not isinstance(in_dims, (int, tuple, list)):
            raise TypeError(
                f"in_dims must be None, an int or a tuple, got {type(in_dims).__name__}"
            )
        stacked = stack_modules(modules)
        template = _private_copy(modules[0])
        self.count = len(modules)
        self._in_dims = in_dims
        self._randomness = randomness
        self.compiled = compile
        self.fast = fast
        self.stacked = nn.Module()
        _register_stacked(self.stacked, template, stacked)
        # Kept out of the module registry on purpose: its tensors are a template, not state.
        self.__dict__["_template"] = template
        self.training = template.training
        self._bind()

    def _bind(self) -> None:
        """Build what forward needs (the steps, the tree reader); again after a copy or unpickling,
        since the steps are closures over this ensemble's own tensor tables."""
        template = self._template
        self._context = PlanContext(self.count, self._randomness, _slots_of(template, self.stacked))
        shares = self._in_dims is None
        by_member = not shares and self._in_dims in (0, (0,), [0])
        plan = compile_plan(template, self._context) if self.fast else None
        self._plan = plan if shares or by_member else None
        self._shared = shares
        flat = flatten(extract(template))
        self._slots = [self._context.slot(t) for t in flat.values()]
        self._layout = Layout(list(flat))
        self._vmapped = vmap_runner(template, self._context, self._randomness)
        run: Callable[..., Any] = self._run
        self._forward_impl = torch.compile(run, dynamic=False) if self.compiled else run

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        for name in ("_context", "_plan", "_slots", "_layout", "_vmapped", "_forward_impl"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._bind()

    @classmethod
    def from_factory(cls, factory: Callable[[], nn.Module], n: int, **kwargs: Any) -> Ensemble:
        """An ensemble of ``n`` models built by ``factory()``, each initialized independently.

        >>> import torch, modstate as ms
        >>> ens = ms.Ensemble.from_factory(lambda: torch.nn.Linear(4, 2), 8)
        >>> ens.stacked.weight.shape
        torch.Size([8, 2, 4])
        """
        if kwargs.get("mesh") is not None and cls is Ensemble:
            from ._sharded import MemberParallelEnsemble

            return MemberParallelEnsemble.from_factory(factory, n, **kwargs)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        return cls([factory() for _ in range(n)], **kwargs)

    # -- running -----------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_impl(*args, **kwargs)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        plan = self._plan
        if plan is not None and len(args) == 1 and not kwargs and isinstance(args[0], Tensor):
            if not self._shared and (args[0].dim() == 0 or args[0].shape[0] != self.count):
                got = args[0].shape[0] if args[0].dim() else "no"
                raise ValueError(
                    f"input 0 has {got} members along dim 0 (in_dims), but the ensemble has "
                    f"{self.count}: give one slice per member, or in_dims=None to share the input"
                )
            return plan(args[0], self._shared)
        return self._vmapped(args, kwargs, self._in_dims)

    @property
    def in_dims(self) -> InDims:
        """How inputs map to members (fixed when the ensemble is built)."""
        return self._in_dims

    @property
    def randomness(self) -> str:
        """vmap's randomness mode for random layers (fixed when the ensemble is built)."""
        return self._randomness

    def tree(self) -> dict[str, Any]:
        """The stacked state as a tree shaped like ``extract(model)``: the registered tensors
        themselves (leading dim N), ties kept. Same as ``ms.extract(self.stacked)``."""
        return self._layout.nest([table[name] for table, name in self._slots])

    # -- members -----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.count

    def member(self, i: int) -> nn.Module:
        """Member ``i`` as an ordinary module: a copy of the model holding copies of member ``i``'s
        tensors (parameters stay parameters, with their ``requires_grad``), independent of the
        ensemble."""
        if not isinstance(i, int) or not -self.count <= i < self.count:
            raise IndexError(f"member index {i!r} out of range for an ensemble of {self.count}")
        copies: dict[int, Tensor] = {}

        def copy_of(tensor: Tensor) -> Tensor:
            out = copies.get(id(tensor))
            if out is None:
                piece = tensor[i].detach().clone()
                if isinstance(tensor, nn.Parameter):
                    piece = nn.Parameter(piece, requires_grad=tensor.requires_grad)
                out = copies[id(tensor)] = piece
            return out

        module = _private_copy(self._template)
        swap(module, self._layout.nest([copy_of(table[name]) for table, name in self._slots]))
        return module

    def members(self) -> list[nn.Module]:
        """Every member as an ordinary module (see `member`)."""
        return [self.member(i) for i in range(self.count)]

    # -- keeping the template in step --------------------------------------------------------------

    def train(self, mode: bool = True) -> Ensemble:
        super().train(mode)
        self._template.train(mode)
        return self

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Ensemble:
        super()._apply(fn, recurse)
        # dtype and device of the template must follow the stacked tensors: call checks dtypes.
        self._template._apply(fn, recurse)
        return self

    def __repr__(self) -> str:
        _, slow = layer_names(self._template, self._context) if self._plan is not None else ([], [])
        if self._plan is None:
            path = "vmap over the whole model"
        elif slow:
            path = f"batched kernels, vmap for {', '.join(dict.fromkeys(slow))}"
        else:
            path = "batched kernels"
        model = repr(self._template).replace("\n", "\n  ")
        values = sum(t.numel() for t in self.stacked.parameters())
        return (
            f"Ensemble(\n  members={self.count}, parameters={values:,} (stacked), path={path}"
            f"{', compiled' if self.compiled else ''}\n  model={model}\n)"
        )


def _private_copy(module: nn.Module) -> nn.Module:
    """``copy.deepcopy(module)``, also for modules that keep a computed tensor in ``__dict__``
    (legacy ``weight_norm`` / ``spectral_norm`` after a forward), which deepcopy refuses.

    The copy has the original's flags whatever its ``__deepcopy__`` does (some re-run
    ``__init__`` and come back in training mode, as torchvision's feature extractors do): every
    submodule's ``training`` and every tensor's ``requires_grad`` are set from the original."""
    memo: dict[int, Any] = {}
    for owner in module.modules():
        for value in vars(owner).values():
            if isinstance(value, Tensor) and not value.is_leaf:
                memo[id(value)] = value.detach().clone()
    copied = copy.deepcopy(module, memo)
    originals = dict(module.named_modules(remove_duplicate=False))
    for path, owner in copied.named_modules(remove_duplicate=False):
        if path in originals:
            owner.training = originals[path].training
    flags = {name: p.requires_grad for name, p in module.named_parameters(remove_duplicate=False)}
    for name, parameter in copied.named_parameters(remove_duplicate=False):
        wanted = flags.get(name)
        if wanted is not None and parameter.requires_grad != wanted:
            parameter.requires_grad_(wanted)
    return copied


def _register_stacked(root: nn.Module, template: nn.Module, stacked: dict[str, Any]) -> None:
    """Register the stacked tensors on a mirror of the template's module tree, as parameters
    where the template has parameters and as (non-)persistent buffers where it has buffers."""
    owners = {"": root}
    registered: dict[int, Tensor] = {}
    for path, value in flatten(stacked).items():
        prefix, _, name = path.rpartition(".")
        owner = owners.get(prefix)
        if owner is None:
            owner = _mirror(owners, prefix)
        original = slot_at(template, path)
        tensor = registered.get(id(value))
        if not original.is_buffer:
            if tensor is None:
                tensor = nn.Parameter(value, requires_grad=value.requires_grad)
            owner.register_parameter(name, tensor)
        else:
            if tensor is None:
                tensor = value
            owner.register_buffer(name, tensor, persistent=original.persistent)
        registered[id(value)] = tensor


def _mirror(owners: dict[str, nn.Module], prefix: str) -> nn.Module:
    parent_prefix, _, name = prefix.rpartition(".")
    parent = owners.get(parent_prefix)
    if parent is None:
        parent = _mirror(owners, parent_prefix)
    owner = owners[prefix] = nn.Module()
    parent.add_module(name, owner)
    return owner


def _slots_of(template: nn.Module, root: nn.Module) -> dict[int, Slot]:
    """Where the stacked form of each of the template's tensors lives (its first path)."""
    slot_of: dict[int, Slot] = {}
    for path, tensor in flatten(extract(template)).items():
        slot = slot_at(root, path)
        slot_of.setdefault(id(tensor), (slot.table, slot.name))
    return slot_of
