"""Sharded optimizer state for a torch optimizer (``train(shard_optimizer_state=True)``).

Each member holds the optimizer state of its slices of the flat parameter space only (its own
and its buddy's: :mod:`fabric_model.state.slices`) and updates only those elements. The user's
own optimizer does the update: for the step, its param groups hold the held *pieces* (a whole
parameter, or a view of part of one at a slice's edge) and its ``state`` the held state, so
its hooks, an LR scheduler's step counting and its own kernels all run as in a plain loop. An
elementwise optimizer gives each element the value the unsharded optimizer would, bit for bit.
The members then gather the slices they own, so every replica holds all the weights again.

Moving the state between members (a new division, a snapshot, the end of training) goes
parameter by parameter through sum-allreduces in which each stretch of the space is written by
exactly one holder (``slices.sources``): at most one parameter's state is whole at a time.

Between steps the user's optimizer's ``state`` is a :class:`HiddenState`: a callback that reads
it (or ``state_dict()``) gets :class:`ShardedStateError`, not a silently empty state. The
framework reads the optimizer's param groups through :meth:`ShardedOptimizer.user_state_dict`.
See docs/elasticity.md, "Sharded optimizer state".
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...state import slices
from ...state.slices import Holding
from .precision import GradientStep
from .steps.update import ShardedUpdate, WholeUpdate

#: torch.optim classes whose update of an element reads only that element's gradient and state
#: (and per-tensor step counts, which are the same on every piece of a tensor).
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Rprop", "ASGD")

#: Why the optimizers known not to be elementwise cannot have their state sharded.
NOT_ELEMENTWISE = {
    "LBFGS": "it keeps a history of whole-gradient vectors and searches along their direction",
    "Adafactor": "it factors each matrix's second moment into row and column sums, so an element's update "
    "reads its whole row and column",
    "SparseAdam": "it takes only sparse gradients",
    "Muon": "it orthogonalizes each matrix's update as a whole",
    "LAMB": "it scales each tensor's update by the ratio of the tensor's norm to its update's norm",
    "LARS": "it scales each tensor's update by the tensor's norm",
}


def check_shardable(optimizer: Any) -> None:
    """Raise, naming the optimizer and why, unless its state can be sharded by elements.

    A subclass of an elementwise ``torch.optim`` class that does not define its own ``step()``
    is accepted: its update is the base's. The answer is the same in any process, whatever
    optimizers were built before (see :func:`step_overrider`)."""
    cls = type(optimizer)
    base = next(
        (c for c in cls.__mro__ if c.__module__.startswith("torch.optim") and c.__name__ in ELEMENTWISE),
        None,
    )
    overrider = step_overrider(cls, base) if base is not None else None
    if base is not None and overrider is None:
        _check_params(optimizer)
        return
    if cls.__name__ in NOT_ELEMENTWISE:
        why = NOT_ELEMENTWISE[cls.__name__]
    elif base is not None and overrider is not None:
        where = "" if overrider is cls else f" (in its base class {overrider.__name__})"
        why = (
            f"it subclasses {base.__name__} and overrides step(){where}, whose update may read more than one "
            "element of a parameter"
        )
    else:
        why = (
            "fabric_model does not know that it updates each element from that element's own gradient and state "
            "(LAMB and LARS, for one, scale by a whole tensor's norm)"
        )
    raise ValueError(
        "Expected `optimizer` to update each element of the parameters from its own gradient and state, so that "
        f"its state can be sharded (train(shard_optimizer_state=True)). Received: optimizer={cls.__name__}: {why}. "
        f"Accepted: torch.optim's {', '.join(ELEMENTWISE)}. HINT: train without shard_optimizer_state; clipping "
        "by the global norm (FabricModel(gradient_clip_norm=...)) works with it."
    )


def step_overrider(cls: type[Any], base: type[torch.optim.Optimizer]) -> type[Any] | None:
    """The class between ``cls`` and ``base`` in ``cls``'s MRO (``cls`` included, ``base`` not)
    that defines its own ``step``, or None where the update is ``base``'s.

    Comparing ``cls.step`` with ``base.step`` is not enough: torch wraps ``step`` on the class of
    the first optimizer built of it (``Optimizer._patch_step_function``, its profiling and hooks
    wrapper), storing the wrapper in *that* class's ``__dict__`` unless an inherited ``step`` is
    wrapped already. So a plain subclass built first carries a ``step`` of its own, and one
    built after its base does not. Unwrapped (``functools.wraps``' ``__wrapped__``), a ``step``
    that is only torch's wrapper around the base's is the base's function itself."""
    inherited = inspect.unwrap(base.step)
    below = cls.__mro__[: cls.__mro__.index(base)]
    for c in below:
        own = c.__dict__.get("step")
        if own is not None and inspect.unwrap(own) is not inherited:
            return c
    return None


def _check_params(optimizer: Any) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.is_contiguous():
                raise ValueError(
                    "Expected the optimizer's parameters to be contiguous tensors to shard their state "
                    f"(train(shard_optimizer_state=True)). Received: a parameter of shape {tuple(p.shape)} with "
                    f"strides {p.stride()}. HINT: make it with .contiguous() before building the optimizer."
                )


class ShardedStateError(RuntimeError):
    """The user's optimizer's state was read (or written) on a worker during a sharded run."""


class HiddenState(dict[Any, Any]):
    """The user's optimizer's ``state`` on a worker between the steps of a sharded run.

    The worker holds only its slices of the state, under keys the user never sees (views of
    parts of parameters). An empty dict in its place would read as "no state yet", and the
    slices in the whole state's form (``state[p]["exp_avg"]`` shaped like ``p``) do not exist,
    so every read or write raises :class:`ShardedStateError`, naming ``shard_optimizer_state``.
    torch's own ``state_dict()`` reads ``state.items()``, so it raises too; ``load_state_dict``
    replaces ``state`` without reading it."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise ShardedStateError(
            "Expected the optimizer's state to be read on a worker only outside a sharded run "
            "(train(shard_optimizer_state=True)). Received: a read or write of `optimizer.state` or "
            "`optimizer.state_dict()` during the run, on a worker, which holds only its own slices of the state, "
            "not whole per-parameter tensors. HINT: read it after train() returns (the whole state is then "
            "gathered into your optimizer, also in a worker's on_train_end), or from a checkpoint "
            '(torch.load(path)["optimizer"]); fabric_model.worker_context().optimizer_state_bytes says how '
            "much of it this worker holds; or train without shard_optimizer_state."
        )

    __getitem__ = __setitem__ = __delitem__ = __contains__ = __iter__ = __reversed__ = __len__ = _refuse
    get = keys = values = items = pop = popitem = setdefault = update = clear = copy = _refuse
    __or__ = __ror__ = __ior__ = __eq__ = __ne__ = __reduce__ = __reduce_ex__ = _refuse  # copy, pickle too

    def __repr__(self) -> str:  # a debugger or a log line shows it without raising
        return "<optimizer state held in slices by the workers: train(shard_optimizer_state=True)>"


@dataclasses.dataclass
class Piece:
    """Elements ``[lo, hi)`` of parameter ``index`` (flattened), and the tensor the optimizer
    updates for them: the parameter itself when the piece is whole, else a view of it."""

    index: int
    lo: int
    hi: int
    key: torch.Tensor
    whole: bool


@dataclasses.dataclass(frozen=True)
class Kinds:
    """A param group's state keys: per element (tensors shaped like the parameter), 0-d tensors
    (their dtypes), plain numbers, and keys the optimizer sets to None."""

    elements: tuple[str, ...]
    tensors: tuple[tuple[str, torch.dtype], ...]
    numbers: tuple[tuple[str, type], ...]
    nones: tuple[str, ...]

    @property
    def n_scalars(self) -> int:
        return len(self.tensors) + len(self.numbers)


class WholeOptimizer:
    """The user's optimizer holding its whole state (a replicated state): what
    :class:`ShardedOptimizer` is in place of, with the same questions answered plainly."""

    sliced_params: Sequence[torch.Tensor] = ()  # no parameter travels by slices

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def user_state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def bind(self, grad_views: dict[int, torch.Tensor]) -> None:
        """(The user's optimizer reads ``.grad`` itself.)"""

    def update(self, grad_step: GradientStep, params: Sequence[torch.Tensor], world: int) -> WholeUpdate:
        """How a generation of ``world`` members applies a step: every member the whole update."""
        return WholeUpdate(grad_step, self.optimizer, params)


class ShardedOptimizer:
    """The user's optimizer, stepping over the held pieces of the flat parameter space."""

    #: The most elements one round of the gather of updated slices moves, all members' together
    #: (16 MiB of float32; two such buffers are kept).
    SPREAD_ELEMENTS = 1 << 22

    def __init__(self, optimizer: torch.optim.Optimizer, grad_views: dict[int, torch.Tensor]) -> None:
        self.optimizer = optimizer
        self.params: list[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        self.group_of = [gi for gi, g in enumerate(optimizer.param_groups) for _ in g["params"]]
        self.offsets: list[int] = []
        total = 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.total = total
        self.bind(grad_views)
        # This member's position in the cycle of slices, the division's size, and every rank's position.
        self.position, self.world, self.positions = 0, 1, [0]
        # At the start every worker holds the whole state (the user's optimizer's own, often empty).
        self.holding = Holding(0, 0, 1)
        self.state: dict[Any, dict[str, Any]] = collections.defaultdict(dict)
        for p in self.params:
            if p in optimizer.state:
                self.state[p] = optimizer.state[p]
        self._hide()
        self._kinds: dict[int, Kinds] = {}
        self._arrange(slices.held_intervals(0, 1, total))
        self._spread_out: list[torch.Tensor] = []
        self.whole = True  # every parameter holds the current step's values

    # -- the user's optimizer's own state -------------------------------------------------------
    def _hide(self) -> None:
        """The user's optimizer shows a :class:`HiddenState` between steps: this member's state is
        ``self.state``, in pieces (see :class:`HiddenState` for why not an empty dict)."""
        self.optimizer.state = HiddenState()  # type: ignore[assignment]

    def user_state_dict(self) -> dict[str, Any]:
        """The user's optimizer's ``state_dict()`` with no state: its param groups (hyperparameters),
        for the framework (a join's handover, snapshots, replica fingerprints)."""
        optimizer = self.optimizer
        hidden = optimizer.state
        optimizer.state = collections.defaultdict(dict)
        try:
            return optimizer.state_dict()
        finally:
            optimizer.state = hidden

    @property
    def sliced_params(self) -> Sequence[torch.Tensor]:
        """The parameters whose state and updated values travel by slices (all of them)."""
        return self.params

    def update(self, grad_step: GradientStep, params: Sequence[torch.Tensor], world: int) -> WholeUpdate:
        """How a generation of ``world`` members applies a step: each member its slices, then the gather."""
        return ShardedUpdate(grad_step, self, params, world)

    def release(self) -> None:
        """The end of sharding: the user's optimizer gets a plain state dict back, to be filled."""
        self.optimizer.state = collections.defaultdict(dict)

    def bind(self, grad_views: dict[int, torch.Tensor]) -> None:
        """Where each parameter's reduced gradient lives (the step buffer's views; a fresh buffer after an abort)."""
        self._grad_of = [grad_views.get(id(p)) for p in self.params]

    # -- the pieces ------------------------------------------------------------------------
    def _pieces_of(self, intervals: Sequence[tuple[int, int]]) -> list[Piece]:
        pieces = []
        for start, end in intervals:
            for i, (p, off) in enumerate(zip(self.params, self.offsets)):
                lo, hi = max(start, off) - off, min(end, off + p.numel()) - off
                if hi <= lo:
                    continue
                whole = lo == 0 and hi == p.numel()
                key = p if whole else torch.nn.Parameter(p.detach().view(-1)[lo:hi])
                pieces.append(Piece(i, lo, hi, key, whole))
        return pieces

    def _arrange(self, intervals: list[tuple[int, int]], pieces: list[Piece] | None = None) -> None:
        """Hold ``intervals`` from now on, as ``pieces`` (made here when None), whose state
        ``self.state`` holds under their keys."""
        self.intervals = intervals
        self.pieces = pieces if pieces is not None else self._pieces_of(intervals)
        self._parts = [piece for piece in self.pieces if not piece.whole]
        self._group_keys: list[list[torch.Tensor]] = [[] for _ in self.optimizer.param_groups]
        for piece in self.pieces:
            self._group_keys[self.group_of[piece.index]].append(piece.key)
        cuts = slices.bounds(self.total, self.world)
        held = set(slices.held_slices(self.position, self.world))
        self._own = cuts[self.position]
        # What each other rank's gathered row holds that this member does not: (rank, slice's bounds).
        self._others = [(r, cuts[s]) for r, s in enumerate(self.positions) if s not in held]

    def state_bytes(self) -> int:
        """Bytes of optimizer state this member holds."""
        return sum(v.numel() * v.element_size() for s in self.state.values() for v in s.values() if torch.is_tensor(v))

    # -- a step ----------------------------------------------------------------------------
    def step(self, apply: Callable[[], bool]) -> bool:
        """Run ``apply`` (which ends in ``optimizer.step()``) with the optimizer over the held pieces."""
        optimizer = self.optimizer
        for piece in self._parts:
            grad = self.params[piece.index].grad
            if grad is None:
                piece.key.grad = None
            else:
                view = self._grad_of[piece.index]
                source = view if view is not None else grad
                piece.key.grad = source.view(-1)[piece.lo : piece.hi]
        saved_params = [g["params"] for g in optimizer.param_groups]
        for group, keys in zip(optimizer.param_groups, self._group_keys):
            group["params"] = keys
        optimizer.state = self.state  # type: ignore[assignment]
        try:
            return apply()
        finally:
            for group, params in zip(optimizer.param_groups, saved_params):
                group["params"] = params
            self._hide()

    def spread(self, collective: Any) -> None:
        """Every member's owned slice of the updated weights to every member. With one or two
        members there is nothing to gather: each holds, and has updated, every slice.

        The gather goes in rounds of at most :attr:`SPREAD_ELEMENTS` elements in all, through two
        buffers in turn (a round's gather runs while the previous round's rows are copied into
        the weights): a worker's scratch for it is bounded, not the size of the parameters,
        which would give back much of what sharding the state saves."""
        if self.world <= 2 or self.total == 0:
            return
        world, rank = self.world, collective.rank
        width = max(end - start for start, end in slices.bounds(self.total, world))
        chunk = min(width, max(1, self.SPREAD_ELEMENTS // world))
        rounds = -(-width // chunk)
        buffers = self._spread_buffers(world, chunk, min(rounds, 2))
        own_start, own_end = self._own

        def launch(k: int) -> Any:
            out = buffers[k % len(buffers)]
            lo = own_start + k * chunk
            self._copy(lo, min(own_end, lo + chunk), out[rank], to_params=False)
            return collective.spread_start(out, out[rank])

        self.whole = False  # until the gather is through
        try:
            pending = launch(0)
            for k in range(rounds):
                following = launch(k + 1) if k + 1 < rounds else None
                collective.wait(pending)
                out = buffers[k % len(buffers)]
                for other, (start, end) in self._others:
                    lo = start + k * chunk
                    self._copy(lo, min(end, lo + chunk), out[other], to_params=True)
                pending = following
        except BaseException:
            self._spread_out = []  # an abandoned gather may still write into them
            raise
        self.whole = True

    def _spread_buffers(self, world: int, chunk: int, count: int) -> list[torch.Tensor]:
        """``count`` buffers of one row of ``chunk`` elements per member, kept across steps."""
        device = self.params[0].device
        kept = self._spread_out
        if len(kept) != count or kept[0].shape != (world, chunk) or kept[0].device != device:
            kept = self._spread_out = [
                torch.zeros(world, chunk, dtype=torch.float32, device=device) for _ in range(count)
            ]
        return kept

    def _copy(self, start: int, end: int, flat: torch.Tensor, to_params: bool) -> None:
        """Copy elements ``[start, end)`` of the flat space between the parameters and ``flat``."""
        if end <= start:
            return
        with torch.no_grad():
            for i in range(max(0, bisect.bisect_right(self.offsets, start) - 1), len(self.params)):
                p, off = self.params[i], self.offsets[i]
                if off >= end:
                    break
                lo, hi = max(start, off), min(end, off + p.numel())
                if hi <= lo or not p.requires_grad:  # one that needs no gradient never changes (nor is written)
                    continue
                part = p.detach().view(-1)[lo - off : hi - off]
                there = flat[lo - start : hi - start]
                (part if to_params else there).copy_(there if to_params else part)

    # -- moving the state ------------------------------------------------------------------
    def kinds(self, group: int) -> Kinds:
        """What state the optimizer keeps for a parameter of ``group`` (probed once on a 2-element tensor)."""
        if group not in self._kinds:
            options = {k: v for k, v in self.optimizer.param_groups[group].items() if k != "params"}
            device = self.params[0].device if self.params else torch.device("cpu")
            probe = torch.nn.Parameter(torch.zeros(2, device=device))
            probe.grad = torch.ones(2, device=device)
            cls = type(self.optimizer)
            accepted = inspect.signature(cls.__init__).parameters  # defaults may hold more (AdamW's)
            trial = cls([probe], **{k: v for k, v in self.optimizer.defaults.items() if k in accepted})
            trial.param_groups[0].update(options)
            trial.step()
            state = trial.state[probe]
            elements, tensors, numbers, nones = [], [], [], []
            for key in sorted(state):
                value = state[key]
                if value is None:
                    nones.append(key)
                elif torch.is_tensor(value) and value.shape == probe.shape:
                    elements.append(key)
                elif torch.is_tensor(value):
                    tensors.append((key, value.dtype))
                else:
                    numbers.append((key, type(value)))
            self._kinds[group] = Kinds(tuple(elements), tuple(tensors), tuple(numbers), tuple(nones))
        return self._kinds[group]

    def _piece_at(self, index: int, lo: int, hi: int) -> Piece | None:
        """The held piece of parameter ``index`` that contains its elements ``[lo, hi)``."""
        for piece in self.pieces:
            if piece.index == index and piece.lo <= lo and hi <= piece.hi:
                return piece
        return None

    def _scalars(self, collective: Any, stretches: list[tuple[int, int, int]], rank: int) -> torch.Tensor:
        """Per parameter, whether it has state, then its 0-d and plain values, from the holder of
        its first element, summed across the group: one float64 row per parameter."""
        width = 1 + max((self.kinds(g).n_scalars for g in range(len(self.optimizer.param_groups))), default=0)
        device = self.params[0].device if self.params else torch.device("cpu")
        table = torch.zeros(len(self.params), width, dtype=torch.float64, device=device)
        for i, off in enumerate(self.offsets):
            if self.params[i].numel() == 0 or _holder(stretches, off) != rank:
                continue
            piece = self._piece_at(i, 0, 1)
            state = self.state.get(piece.key) if piece is not None else None
            if not state:
                continue
            kinds = self.kinds(self.group_of[i])
            values = [float(state[k]) for k, _ in kinds.tensors] + [float(state[k]) for k, _ in kinds.numbers]
            table[i, : 1 + len(values)] = torch.tensor([1.0, *values], dtype=torch.float64)
        if collective.world_size > 1:
            collective.all_reduce_sum(table)
        return table

    def exchange(
        self,
        collective: Any,
        stretches: list[tuple[int, int, int]],
        keep: list[tuple[int, int]] | None,
        with_params: bool,
        full: bool,
    ) -> dict[int, dict[str, Any]] | None:
        """Move the state between the members of ``collective``: each stretch ``(start, end, rank)``
        is written by ``rank``. ``keep``: the intervals this member holds afterwards (None: the same);
        ``with_params``: also set every parameter from the holders; ``full``: return the whole state
        (``state_dict``'s ``state``: by parameter index, tensors shaped like the parameter)."""
        rank = collective.rank
        scalars = self._scalars(collective, stretches, rank)
        new_pieces = self._pieces_of(keep) if keep is not None else None
        new_state: dict[Any, dict[str, Any]] = collections.defaultdict(dict)
        whole: dict[int, dict[str, Any]] = {}
        device = self.params[0].device if self.params else torch.device("cpu")
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            n = p.numel()
            if n == 0:
                continue
            kinds = self.kinds(self.group_of[i])
            present = bool(scalars[i, 0] > 0)
            # A parameter that needs no gradient never changes: every member has its value.
            params = with_params and p.requires_grad
            rows = (1 if params else 0) + (len(kinds.elements) if present else 0)
            wanted = [piece for piece in new_pieces or () if piece.index == i]
            if rows == 0 or (not wanted and not full and not params):
                continue
            buffer = torch.zeros(rows, n, dtype=torch.float32, device=device)
            for start, end, holder in stretches:
                lo, hi = max(start, off) - off, min(end, off + n) - off
                if hi <= lo or holder != rank:
                    continue
                row = 0
                if params:
                    buffer[0, lo:hi] = p.detach().view(-1)[lo:hi]
                    row = 1
                if present:
                    piece = self._piece_at(i, lo, hi)
                    assert piece is not None, f"rank {rank} was named to hand on elements it does not hold"
                    state = self.state[piece.key]
                    for k, key in enumerate(kinds.elements):
                        buffer[row + k, lo:hi] = state[key].view(-1)[lo - piece.lo : hi - piece.lo]
            if collective.world_size > 1:
                collective.all_reduce_sum(buffer)
            if params:
                with torch.no_grad():
                    p.detach().view(-1).copy_(buffer[0])
            if not present:
                continue
            numbers = scalars[i, 1:].tolist()

            rows_of_state = buffer[1:] if params else buffer
            for piece in wanted:
                shape = p.shape if piece.whole else None
                new_state[piece.key] = _state_of(kinds, rows_of_state, numbers, piece.lo, piece.hi, shape)
            if full:
                whole[i] = _state_of(kinds, rows_of_state, numbers, 0, n, p.shape)
        if keep is not None:
            self.state = new_state
            self._arrange(keep, new_pieces)
        if with_params:
            self.whole = True
        return whole if full else None

    def redivide(self, collective: Any, holdings: list[Holding], unit: int) -> None:
        """Hold this generation's slices of the state of ``unit``: from this member's own copy
        where every member has what it needs, else handed on by the holders
        (:class:`~fabric_model.state.slices.StateLost` where none is left)."""
        world = collective.world_size
        positions = slices.cycle([h.host for h in holdings])
        keep = slices.held_intervals(positions[collective.rank], world, self.total)
        needs = [
            not h.whole or not slices.covers(h.intervals(self.total, unit), slices.held_intervals(k, world, self.total))
            for h, k in zip(holdings, positions)
        ]
        stretches = slices.sources(holdings, unit, self.total)  # raises StateLost first, on every member alike
        old = self.position, self.world, self.positions
        self.position, self.world, self.positions = positions[collective.rank], world, positions
        try:
            if any(needs):
                self.exchange(collective, stretches, keep, with_params=True, full=False)
            else:
                self._slice_locally(keep)
        except BaseException:
            self.position, self.world, self.positions = old
            raise
        finally:  # a joining member's load_state_dict put a plain (empty) state in the user's optimizer
            self._hide()
        self.holding = Holding(unit, self.position, world)

    def _slice_locally(self, keep: list[tuple[int, int]]) -> None:
        """Re-cut this member's own state to ``keep`` (which it holds all of)."""
        new_state: dict[Any, dict[str, Any]] = collections.defaultdict(dict)
        pieces = self._pieces_of(keep)
        for piece in pieces:
            old = self._piece_at(piece.index, piece.lo, piece.hi)
            state = self.state.get(old.key) if old is not None else None
            if not state or old is None:
                continue
            shape = self.params[piece.index].shape if piece.whole else None
            moved: dict[str, Any] = {}
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    part = value.view(-1)[piece.lo - old.lo : piece.hi - old.lo]
                    moved[key] = part.view(shape) if shape is not None else part.clone()
                else:
                    moved[key] = value
            new_state[piece.key] = moved
        self.state = new_state
        self._arrange(keep, pieces)

    def full_state(self, collective: Any) -> dict[int, dict[str, Any]]:
        """The whole state, by parameter index as ``state_dict`` numbers them, on every member
        (each of the members takes part; at most one parameter's state is whole at a time)."""
        world = collective.world_size
        holdings = [Holding(self.holding.unit, k, world) for k in self.positions]
        stretches = slices.sources(holdings, self.holding.unit, self.total)
        result = self.exchange(collective, stretches, None, with_params=False, full=True)
        assert result is not None
        return result

    def adopt_whole(self, unit: int) -> None:
        """The user's optimizer was loaded with a complete state (a resume, a rollback): hold it all."""
        self.state = collections.defaultdict(dict)
        for p in self.params:
            if p in self.optimizer.state:
                self.state[p] = self.optimizer.state[p]
        self._hide()
        self.position, self.world, self.positions = 0, 1, [0]
        self._arrange(slices.held_intervals(0, 1, self.total))
        self.holding = Holding(unit, 0, 1)
        self.whole = True


def _state_of(
    kinds: Kinds, rows: torch.Tensor, numbers: list[float], lo: int, hi: int, shape: torch.Size | None
) -> dict[str, Any]:
    """A piece's state from a parameter's assembled rows (one per element key) and its scalars."""
    out: dict[str, Any] = {}
    for k, key in enumerate(kinds.elements):
        part = rows[k, lo:hi].clone()
        out[key] = part.view(shape) if shape is not None else part
    for k, (key, dtype) in enumerate(kinds.tensors):
        out[key] = torch.tensor(numbers[k], dtype=dtype, device=rows.device)
    for k, (key, kind) in enumerate(kinds.numbers):
        out[key] = kind(numbers[len(kinds.tensors) + k])
    for key in kinds.nones:
        out[key] = None
    return out


def _holder(stretches: list[tuple[int, int, int]], element: int) -> int:
    """The rank that hands on ``element``."""
    for start, end, rank in stretches:
        if start <= element < end:
            return rank
    return -1
