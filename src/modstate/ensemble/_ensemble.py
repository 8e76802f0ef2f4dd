"""``Ensemble``: N copies of one model, held as stacked parameters, run at once."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from modstate._core.extract import extract
from modstate._core.inject import swap
from modstate._core.torch_facts import functorch_active
from modstate._core.trees.flat import Layout, flatten
from modstate._core.types import Tree

from ._chain import Chain, build_chain
from ._choice import ForwardChoice
from ._declared import check_declared_layers
from ._factory import build_members, checked_seeds, draw_base_seed, member_seed
from ._kernels import KernelContext
from ._kernels.forms import LayerForms
from ._loop import MemberCopies, loop_forward, member_trees
from ._options import checked_options, on_ranks
from ._plan import Plan
from ._runner import ThreadRunners, VmapRunner
from ._sharded import MemberShards
from ._stack import stack_modules
from ._stacked_state import homes_of, private_copy, register_stacked
from ._vmap import InDims


class Ensemble(nn.Module):
    """N models of one architecture as one module: the stacked state is its parameters and
    buffers, and ``forward`` runs every member at once.

    The stacked tensors are registered on ``self.stacked``, a mirror of the model's module tree:
    the members' ``"0.weight"`` stacked is ``ensemble.stacked.get_submodule("0").weight``
    (leading dim N), and ``state_dict`` keys are ``"stacked.0.weight"`` and so on. Hence
    ``ensemble.parameters()`` goes straight into a ``torch.optim`` optimizer, ``state_dict`` /
    ``load_state_dict`` round-trip, and ``.to()`` / ``.double()`` move everything. The models
    given are left alone: the ensemble keeps a private copy of the first as a template.

    How it runs (``ensemble.plan`` shows it, layer by layer): the members' own ``forward`` runs
    once, under ``torch.vmap``, on member-stacked activations, and every layer with a batched
    form runs as one kernel on the stacked weights wherever it sits in the model: ``Linear``
    (batched matmul), ``Conv1d/2d/3d`` (grouped convolution; on the CPU a batched matmul when
    the output maps have at most 16 positions), ``BatchNorm1d/2d/3d`` (one batch norm over the
    members' channels: per-member statistics, train and eval), ``LayerNorm``, ``RMSNorm``,
    ``GroupNorm``, ``Embedding``, ``MultiheadAttention`` and ``F.scaled_dot_product_attention``
    (members folded into the attention batch), ``TransformerEncoderLayer`` and
    ``TransformerDecoderLayer`` (one kernel each), Hugging Face's ``Conv1D``, pooling (in
    inference on the CPU a CNN runs channels-last from its stem on). Code between layers is
    batched by vmap; a layer with tensors but no batched form runs as its own code under vmap,
    with the same results (the plan says why); a plain ``nn.Sequential`` of them runs without vmap.
    Outputs, gradients and BatchNorm statistics equal the members run one by one.

    Args:
        modules: the members: models of one architecture (same submodule types and training
            mode, same tensor paths, shapes, dtypes and devices; see
            [`stack_modules`][modstate.stack_modules]).
        compile: wrap the forward in ``torch.compile(dynamic=False)`` (a new input shape
            compiles again; eager is faster for small models). ``torch.compile(ensemble)``
            works too; give it ``dynamic=False`` where a process compiles several ensembles
            (inductor 2.13 fails on their convolutions under dynamic shapes).
        in_dims: how positional inputs map to members, as ``torch.vmap``'s: None (default)
            shares every input; 0: each input holds one slice per member along dim 0; a tuple
            gives one entry per input. Keyword arguments are always shared.
        randomness: ``torch.vmap``'s, with its default ``"error"``: a random op in a member
            (dropout in training mode) is refused until you choose ``"different"`` (a draw per
            member, like a loop over the models) or ``"same"`` (one draw shared by all).
            ``nn.Dropout``'s masks depend only on the random state and the member, not on the
            route (``fast``, the plan): the mask ``F.dropout`` draws on the CPU for the
            activations laid out ``(members, *activation shape)``, row i for member i (with
            ``"same"``, one mask of a member's shape).
        fast: False runs the whole model under ``torch.vmap`` without batched kernels (the
            reference path, for comparison; ``nn.Dropout`` still draws its masks members
            first, as every route does).
        mesh: None (default) for a one-process ensemble; a 1-D ``DeviceMesh`` spreads the
            members over its ranks: the stacked tensors are ``DTensor`` s sharded on the member
            dim, each rank stores and runs only its members, and ``forward`` returns outputs
            sharded on the member dim (every rank passes all N models and keeps its own).
        kernels: layer classes of yours mapped to the torch layer class whose computation each
            has, ``{MyNorm: nn.LayerNorm}``: their layers (and those of subclasses that keep
            their ``forward``) run that class's batched kernel, and the plan says so; for this
            ensemble only, nothing is registered. A subclass of a torch layer that keeps the
            methods its ``forward`` runs needs no declaration; one that overrides them runs its
            own code under vmap until declared. A declared layer must hold the torch class's
            settings and tensors (checked before the ensemble is built).
        route: how ``forward`` runs: ``"auto"`` (default) measures, at the first call with new
            inputs (shapes, dtypes, other arguments, train or eval, grad or not), the batched
            forward and a loop over the members (each member a plain call of a copy of the
            model holding views of the stacked tensors), and keeps the batched forward unless
            the loop measured 5% faster or more, or the batched forward's peak of tensor memory
            exceeds the loop's plus the stacked tensors plus 64 MiB, for those inputs (the
            first 8 signatures; later new ones take the route chosen most, unmeasured);
            ``"batched"`` or ``"loop"`` pin one, whatever its memory. The choices, their times
            and peaks are in ``plan``. Measuring (a warm-up, a memory pass and 3 to 12 timed runs of each route,
            forward and backward, once per input signature) changes no tensor and no random
            state; it is skipped (batched) while compiling, under
            ``torch.func``, with ``compile=True`` or ``fast=False``, in training mode with a
            ``randomness`` other than ``"error"``, and on a mesh's ranks.
        measure: True (default) lets the ensemble time what it chooses between: the route
            (with ``route="auto"``) and, on the batched route, a layer's batched forms where it
            has two (a CPU convolution with output maps of at most 4x4 runs as a grouped
            convolution or a batched matmul; each is timed forward and backward at the layer's
            first input of each signature, and the faster kept). False measures nothing: the
            route is ``"batched"`` unless pinned, and the forms follow the documented cost
            model (output-map sizes, see ``docs/semantics.md``). The forms chosen and their
            times are in ``plan``.

    Raises:
        TypeError: an entry of ``modules`` is not an ``nn.Module``, a submodule's type differs,
            or ``in_dims`` or an entry of ``kernels`` has the wrong type.
        ValueError: no models, models that differ (the message names the first path where one
            differs from the first model), an unknown ``randomness``, a mesh that would leave a
            rank without members, or a declared kernel that a layer does not fit (the message
            names the layer's path).

    Example:
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

    count: int
    stacked: nn.Module
    local: Ensemble  # a member-parallel ensemble's computing part (this rank's members)
    _template: nn.Module
    _runners: ThreadRunners[VmapRunner]
    _member_copies: ThreadRunners[MemberCopies]
    _chain: Chain | None
    _shards: MemberShards | None

    def __init__(
        self,
        modules: Iterable[nn.Module],
        *,
        compile: bool = False,
        in_dims: InDims = None,
        randomness: str = "error",
        fast: bool = True,
        mesh: Any = None,
        kernels: Mapping[type, type[nn.Module]] | None = None,
        route: str = "auto",
        measure: bool = True,
    ) -> None:
        super().__init__()
        options = checked_options(
            "Ensemble", compile, in_dims, randomness, fast, route, kernels, measure
        )
        modules = list(modules)
        if not modules:
            raise ValueError("Ensemble: no models; give at least one")
        if mesh is None:
            stacked = stack_modules(modules)
            check_declared_layers(modules[0], options["kernels"], "Ensemble")
            self._own(private_copy(modules[0]), stacked, len(modules), options)
            return
        shards = MemberShards(mesh, len(modules), "Ensemble")
        local = Ensemble([modules[i] for i in shards.here], **on_ranks(options))
        self._shard(local, shards)

    @classmethod
    def from_factory(
        cls,
        factory: Callable[[], nn.Module],
        n: int,
        *,
        compile: bool = False,
        in_dims: InDims = None,
        randomness: str = "error",
        fast: bool = True,
        mesh: Any = None,
        seeds: Sequence[int] | None = None,
        kernels: Mapping[type, type[nn.Module]] | None = None,
        route: str = "auto",
        measure: bool = True,
    ) -> Ensemble:
        """An ensemble of ``n`` models built by ``factory()``, each initialized independently.

        Without ``seeds``, member ``i`` is built under a seed made of one draw from the global
        random state and ``i``: the global seed decides every member, two ensembles built in a
        row differ, and member ``i`` is the same model with or without a mesh, on any number of
        ranks (a mesh takes the draw of its first rank). The caller's random state advances by
        that one draw. With ``seeds``, member ``i`` is bit for bit the model that
        ``torch.manual_seed(seeds[i]); factory()`` builds (a separate run with that seed), and
        the global random state is not drawn from: after the call it is as it was before (the
        CPU's, and CUDA's where CUDA is initialized; each member is built with the caller's
        state set aside, ``torch.random.fork_rng``). With a mesh, every rank passes the same
        seeds and builds its own members from them. Each member is copied into the stacked
        tensors as soon as it is built and dropped, so the memory needed stays near the
        stacked state's size, not twice it.

        Args:
            factory: builds one member (called ``n`` times, or once per member this rank holds
                with a mesh).
            n: the number of members.
            compile: see [`Ensemble`][modstate.Ensemble].
            in_dims: see [`Ensemble`][modstate.Ensemble].
            randomness: see [`Ensemble`][modstate.Ensemble].
            fast: see [`Ensemble`][modstate.Ensemble].
            mesh: see [`Ensemble`][modstate.Ensemble]; every rank of the mesh calls
                ``from_factory`` (a collective: the seed is the first rank's).
            seeds: one ``torch.manual_seed`` seed per member (``n`` ints), for members that
                are reproducible on their own; None (default) seeds them from the global
                random state.
            kernels: see [`Ensemble`][modstate.Ensemble].
            route: see [`Ensemble`][modstate.Ensemble].
            measure: see [`Ensemble`][modstate.Ensemble].

        Returns:
            The ensemble.

        Raises:
            ValueError: ``n`` is not a positive int, ``seeds`` does not give ``n`` seeds (or
                one is outside ``torch.manual_seed``'s range), the factory's models differ
                (see [`stack_modules`][modstate.stack_modules]), or the options are refused
                (see [`Ensemble`][modstate.Ensemble]).
            TypeError: the factory returned something that is not an ``nn.Module``, or a
                seed is not an int.

        Example:
            >>> import torch, modstate as ms
            >>> torch.manual_seed(0)  # decides every member
            <torch._C.Generator object at ...>
            >>> ens = ms.Ensemble.from_factory(lambda: torch.nn.Linear(4, 2), 8)
            >>> ens.stacked.weight.shape
            torch.Size([8, 2, 4])
            >>> ens = ms.Ensemble.from_factory(lambda: torch.nn.Linear(4, 2), 3, seeds=[7, 8, 9])
            >>> _ = torch.manual_seed(8)
            >>> torch.equal(ens.member(1).weight, torch.nn.Linear(4, 2).weight)
            True
        """
        caller = "Ensemble.from_factory"
        options = checked_options(
            caller, compile, in_dims, randomness, fast, route, kernels, measure
        )
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{caller}: n={n!r}; give a positive int, the number of members")
        given = None if seeds is None else checked_seeds(seeds, n, caller)
        shards = None if mesh is None else MemberShards(mesh, n, caller)
        indices = range(n) if shards is None else shards.here
        if given is None:
            base = draw_base_seed(None if mesh is None else mesh.get_group())
            given = [member_seed(base, i) for i in range(n)]
        template, stacked = build_members(factory, [given[i] for i in indices], caller)
        check_declared_layers(template, options["kernels"], caller)
        local = cls._assembled(
            template, stacked, len(indices), options if shards is None else on_ranks(options)
        )
        if shards is None:
            return local
        ensemble = cls._assembled(None, None, n, options)
        ensemble._shard(local, shards)
        return ensemble

    @classmethod
    def _assembled(
        cls, template: nn.Module | None, stacked: Tree | None, count: int, options: dict
    ) -> Ensemble:
        """An ensemble built from a template (kept as it is) and its stacked tree, or an empty
        shell for a member-parallel ensemble (``template`` None)."""
        ensemble = cls.__new__(cls)
        nn.Module.__init__(ensemble)
        if template is not None and stacked is not None:
            ensemble._own(template, stacked, count, options)
        return ensemble

    # -- building ----------------------------------------------------------------------------------

    def _own(self, template: nn.Module, stacked: Tree, count: int, options: dict) -> None:
        """Hold ``stacked`` as registered tensors, with ``template`` as the private model."""
        self.count = count
        self._in_dims = options["in_dims"]
        self._randomness = options["randomness"]
        self.compiled = options["compile"]
        self.fast = options["fast"]
        self.route = options["route"]
        self.measure = options["measure"]
        self._kernels = options["kernels"]
        self._shards = None
        self.stacked = nn.Module()
        register_stacked(self.stacked, template, stacked)
        # Kept out of the module registry on purpose: its tensors are a template, not state.
        self.__dict__["_template"] = template
        self.training = template.training
        self._bind()

    def _shard(self, local: Ensemble, shards: MemberShards) -> None:
        """Hold the members of ``shards`` as ``DTensor`` s computed by ``local``."""
        self.count = shards.count
        self._shards = shards
        self.__dict__["local"] = local  # computes; its own tensors are placeholders
        self.stacked = nn.Module()
        shards.register(local.stacked, self.stacked)
        self.training = local.training
        # Tells the swap engine not to gather the DTensors: forward takes them as they are.
        self._modstate_computes_with_dtensors = True

    def _bind(self) -> None:
        """Build what forward needs (kernels, the chain or the runner, the tree reader); again
        after a copy or unpickling, since kernels read this ensemble's own tensor tables."""
        template = self._template
        homes = homes_of(template, self.stacked)
        # compiled or the reference path: the batched forward, unmeasured
        pinned = self.compiled or not self.fast
        forms = LayerForms(measure=self.measure and not pinned)
        context = KernelContext(self.count, self._randomness, homes, self._kernels, forms)
        by_member = self._in_dims in (0, (0,), [0])
        chain = build_chain(template, context) if self.fast else None
        self._chain = chain if self._in_dims is None or by_member else None
        self._runners = ThreadRunners(
            lambda: VmapRunner(
                template, homes, self.count, self._randomness, self.fast, self._kernels, forms
            )
        )
        flat = flatten(extract(template))
        self._tree_homes = [homes[id(t)] for t in flat.values()]
        self._layout = Layout(list(flat))
        layout, count = self._layout, self.count
        self._member_copies = ThreadRunners(lambda: MemberCopies(template, layout, count))
        unmeasured = pinned or (self.route == "auto" and not self.measure)
        self._choice = ForwardChoice("batched" if unmeasured else self.route, self._randomness)
        run: Callable[..., Any] = self._run
        self._forward_impl = torch.compile(run, dynamic=False) if self.compiled else run

    def __getstate__(self) -> dict[str, Any]:
        if self._shards is not None:
            raise TypeError(
                "Ensemble: a member-parallel ensemble holds a DeviceMesh and cannot be pickled or "
                "deep-copied; save it with modstate.checkpoint.save_distributed"
            )
        state = dict(super().__getstate__())
        for name in (
            "_chain", "_runners", "_member_copies", "_tree_homes", "_layout", "_forward_impl",
            "_choice",
        ):  # fmt: skip
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._bind()

    # -- running -----------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run every member on the inputs and return the stacked outputs.

        Args:
            *args: the model's positional inputs, shared by every member or split per member
                as ``in_dims`` says.
            **kwargs: the model's keyword inputs, shared by every member.

        Returns:
            What the model's ``forward`` returns, with a leading member dim on every tensor
            (``DTensor`` s sharded on it for a member-parallel ensemble).

        Raises:
            ValueError: an input mapped by ``in_dims`` has another member count.
            RuntimeError: a member drew random numbers and ``randomness="error"``.
        """
        if self._shards is not None:
            return self._shards.forward(self.local, self.stacked, self.in_dims, args, kwargs)
        return self._forward_impl(*args, **kwargs)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        return self._choice.run(self, args, kwargs, self._batched, self._loop, self._stacked_leaves)

    def _loop(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        flat = self._stacked_leaves()
        if not (functorch_active() or torch.compiler.is_compiling()):
            # eager: plain calls of this thread's member copies (see _loop.py)
            return self._member_copies.mine()(flat, self._in_dims, args, kwargs)
        trees = member_trees(self._layout, flat, self.count)
        return loop_forward(self._template, trees, self._in_dims, args, kwargs)

    def _stacked_leaves(self) -> list[Tensor]:
        """The stacked tensors in ``tree()``'s order, as this thread sees them."""
        return [home.get() for home in self._tree_homes]

    def _batched(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        chain = self._chain
        if chain is not None and len(args) == 1 and not kwargs and isinstance(args[0], Tensor):
            x = args[0]
            shared = self._in_dims is None
            if not shared and (x.dim() == 0 or x.shape[0] != self.count):
                got = x.shape[0] if x.dim() else "no"
                raise ValueError(
                    f"Ensemble: input 0 has {got} members along dim 0 (in_dims=0), but the "
                    f"ensemble has {self.count}; give one slice per member, or build the "
                    "ensemble with in_dims=None to share the input"
                )
            return chain(x, shared)
        return self._runners.mine()(args, kwargs, self._in_dims)

    @property
    def in_dims(self) -> InDims:
        """How inputs map to members (fixed when the ensemble is built)."""
        return self.local.in_dims if self._shards is not None else self._in_dims

    @property
    def randomness(self) -> str:
        """vmap's randomness mode for random layers (fixed when the ensemble is built)."""
        return self.local.randomness if self._shards is not None else self._randomness

    @property
    def plan(self) -> Plan:
        """How ``forward`` runs the members: each layer with its route, and for a layer that
        falls back to plain ``torch.vmap``, why (see `Plan`)."""
        if self._shards is not None:
            return self.local.plan
        runner = self._runners.mine()
        batched = sum(route.fallback is None for route in runner.routes)
        fallbacks = len(runner.routes) - batched
        if not self.fast:
            summary = "the whole model under torch.vmap (fast=False, the reference path)"
        elif self._chain is not None:
            summary = self._chain.summary()
        else:
            summary = (
                "the model's forward under torch.vmap, batched kernels where the layers have "
                f"them ({fallbacks} of {len(runner.routes)} layers fall back)"
            )
        chosen = [f"forward for {choice.line()}" for choice in self._choice.choices]
        return Plan(summary, runner.routes, runner.notes() + chosen)

    @property
    def members_here(self) -> range:
        """The members this process holds and runs: all of them, or this rank's with a mesh."""
        return self._shards.here if self._shards is not None else range(self.count)

    def tree(self) -> dict[str, Any]:
        """The stacked state as a tree shaped like ``extract(model)``.

        Returns:
            The registered tensors themselves (leading dim N; ``DTensor`` s for a
            member-parallel ensemble), ties kept: the same as ``ms.extract(self.stacked)``.
        """
        if self._shards is not None:
            return extract(self.stacked)
        return self._layout.nest(self._stacked_leaves())

    # -- members -----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.count

    def member(self, i: int) -> nn.Module:
        """Member ``i`` as an ordinary module, independent of the ensemble.

        Args:
            i: the member's index (negative counts from the end).

        Returns:
            A copy of the model holding copies of member ``i``'s tensors (parameters stay
            parameters, with their ``requires_grad``). For a member-parallel ensemble this is a
            collective: every rank calls it and gets the member.

        Raises:
            IndexError: ``i`` is out of range.
        """
        if not isinstance(i, int) or not -self.count <= i < self.count:
            raise IndexError(
                f"Ensemble.member: index {i!r} is out of range for an ensemble of {self.count}; "
                f"give 0 to {self.count - 1}"
            )
        if self._shards is not None:
            return self._shards.member(self.stacked, self.local.member(0), i)
        copies: dict[int, Tensor] = {}

        def copy_of(tensor: Tensor) -> Tensor:
            out = copies.get(id(tensor))
            if out is None:
                piece = tensor[i].detach().clone()
                if isinstance(tensor, nn.Parameter):
                    piece = nn.Parameter(piece, requires_grad=tensor.requires_grad)
                out = copies[id(tensor)] = piece
            return out

        module = private_copy(self._template)
        swap(module, self._layout.nest([copy_of(home.get()) for home in self._tree_homes]))
        return module

    def members(self) -> list[nn.Module]:
        """Every member as an ordinary module (see `member`).

        Returns:
            ``[self.member(i) for i in range(len(self))]``.
        """
        return [self.member(i) for i in range(self.count)]

    # -- keeping the template in step --------------------------------------------------------------

    def train(self, mode: bool = True) -> Ensemble:
        """Set training mode on the ensemble and every member's layers (``nn.Module.train``).

        Args:
            mode: True for training mode, False for eval mode.

        Returns:
            The ensemble itself.
        """
        super().train(mode)
        if self._shards is not None:
            self.local.train(mode)
        else:
            self._template.train(mode)
            self._runners.train(mode)
            self._member_copies.train(mode)
        return self

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Ensemble:
        super()._apply(fn, recurse)
        if self._shards is not None:
            self.local._apply(fn, recurse)
            return self
        # dtype and device of the template must follow the stacked tensors: call checks dtypes.
        self._template._apply(fn, recurse)
        self._bind()  # buffers may be new objects: the runner shares the template's tensors
        return self

    def __repr__(self) -> str:
        if self._shards is not None:
            local = repr(self.local).replace("\n", "\n  ")
            return f"Ensemble(\n  {self._shards.describe()}\n  local={local}\n)"
        values = sum(t.numel() for t in self.stacked.parameters())
        plan = "\n  ".join(self.plan.lines())
        return (
            f"Ensemble(\n  members={self.count}, parameters={values:,} (stacked)"
            f"{', compiled' if self.compiled else ''}\n  plan: {plan}\n)"
        )
