"""What a worker holds of the training state, and how it moves between members: the state layouts.

A run has one layout, chosen once from ``train(shard_optimizer_state=...)`` (:func:`layout_for`):

- :class:`Replicated`: every member holds the whole state. A newcomer takes it from the member
  that holds the agreed step, rank 0 uploads it alone, and any one member can hand it back.
- :class:`ShardedOptimizerState`: each member holds its slices of the optimizer state (its own
  and its buddy's: state/slices.py) and the whole of the rest. Entering a generation, the
  members say what they hold and divide the slices anew; every member takes part in an upload
  and in the end's gather; no single member holds the whole state (docs/elasticity.md,
  "Sharded optimizer state").

The worker's loop (worker/loop.py) asks its layout at each of those points and reads no flag of
its own; the uploader asks whether members decide uploads alike (state/uploader.py,
``agreed``); the driver asks whether a halt or a preemption can take the state from one member;
the run's identity names the layout (driver/identity.py, compared by driver/reattach.py).

The adapter (frameworks/) is asked by duck typing: this layer lies below the frameworks; the
step's half of a layout is the adapter's (docs/architecture.md, "Adding a state layout"). Torch
is imported where a method needs it: the caller of a Keras job imports this module without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from .slices import Holding, host_key

if TYPE_CHECKING:
    from ..step.loop_state import LoopState
    from .uploader import StateUploader


class StateLayout:
    """What a worker holds and how it moves: one per worker, attached to its adapter at the
    loop's start (:meth:`attach`). The class attributes alone answer the driver and the uploader."""

    #: The layout's name in the run's identity (driver/identity.py): "replicated" or "sharded".
    name: ClassVar[str]
    #: Whether any single member holds the whole state: a halt may ask one member for it, and a
    #: preemption aborts the generation and asks; otherwise the members stop together.
    whole_on_each_member: ClassVar[bool]
    #: Whether every member takes part in an upload (it gathers the state): then all must decide
    #: alike when one is due (state/uploader.py, ``agreed``).
    uploads_together: ClassVar[bool]

    adapter: Any  # the worker's framework adapter (frameworks/base.py)
    loop_state: LoopState  # the loop's state: it travels with the optimizer's

    def attach(self, adapter: Any, loop_state: LoopState) -> None:
        """At the loop's start: the adapter whose state this layout moves, and the loop's state."""
        self.adapter, self.loop_state = adapter, loop_state

    def load(self, state: dict[str, Any], unit: int) -> None:
        """The whole state of ``unit`` from the driver (a resumed run, or no holder of the state
        left): every member loads it."""
        optimizer = self.loop_state.unpack(state["optimizer"])
        # "base": its frozen parameters that hold the job's values.
        self.adapter.load_sent_state(state["model"], optimizer, base=state.get("base", ()))

    def enter(self, collective: Any, source: int, resume: int, held: int) -> None:
        """Entering a generation resumed at unit ``resume``: the members that lack its state take
        it. ``source``: the rank that hands it on (-1: none, every member holds it); ``held``: the
        unit whose state this member holds (-1: none). Raises ``StateLost`` where no member
        holds a part of it (state/slices.py)."""
        raise NotImplementedError

    def join_state(self) -> dict[str, Any]:
        """What a join hands over: what a step can change (the live tensors: the broadcast copies
        them), without the frozen parameters every worker has from the job."""
        model, optimizer, omitted = self.adapter.state_to_send()
        return {"model": model, "optimizer": self.loop_state.pack(optimizer), "omitted": omitted}

    def upload_rank(self, rank: int) -> int:
        """The rank whose part this member plays in uploads (state/uploader.py, ``kind_due``)."""
        raise NotImplementedError

    def takes_part_in_uploads(self, rank: int) -> bool:
        """Whether the member of rank ``rank`` calls :meth:`upload` when one is due."""
        return self.upload_rank(rank) == 0

    def upload(self, kind: str, unit: int, collective: Any, uploads: StateUploader) -> None:
        """The ``kind`` ("checkpoint" or "snapshot") of the state before ``unit`` to the driver."""
        model, optimizer, omitted = self.adapter.state_to_send()
        uploads.upload(kind, unit, collective.generation, model, self.loop_state.pack(optimizer), omitted)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this worker holds (``WorkerContext.optimizer_state_bytes``)."""
        import torch

        _, optimizer, _ = self.adapter.state_to_send()
        tensors = [v for v in _leaves(optimizer) if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def finish(self, collective: Any) -> None:
        """At the schedule's end, before the user's ``on_train_end``: the user's objects hold the
        whole state."""

    def _pull(self, collective: Any, source: int) -> None:
        """The members other than ``source`` take its :meth:`join_state`."""
        from .transfer import broadcast_state  # torch: see the module's docstring

        mine = self.join_state() if collective.rank == source else None
        state = broadcast_state(collective, mine, source)
        if collective.rank != source:
            optimizer = self.loop_state.unpack(state["optimizer"])
            self.adapter.load_sent_state(state["model"], optimizer, omitted=state.get("omitted", ()))


class Replicated(StateLayout):
    """Every member holds the whole state; rank 0 uploads it alone."""

    name = "replicated"
    whole_on_each_member = True
    uploads_together = False

    def enter(self, collective: Any, source: int, resume: int, held: int) -> None:
        if source >= 0:  # the members that lack the agreed state take it from the one that holds it
            self._pull(collective, source)

    def upload_rank(self, rank: int) -> int:
        return rank  # rank 0 uploads; the others have nothing to do


class ShardedOptimizerState(StateLayout):
    """Each member holds its slices of the optimizer state (``train(shard_optimizer_state=True)``):
    they are divided anew at each generation, gathered by every member for an upload, and into
    the user's optimizer at the end."""

    name = "sharded"
    whole_on_each_member = False
    uploads_together = True

    #: The adapter's sharded optimizer (frameworks/torch/sharded.py); None once gathered at the end.
    optimizer: Any = None

    def attach(self, adapter: Any, loop_state: LoopState) -> None:
        super().attach(adapter, loop_state)
        # From here the adapter updates only this member's slices, which this object holds.
        self.optimizer = adapter.shard_optimizer_state()

    def load(self, state: dict[str, Any], unit: int) -> None:
        super().load(state, unit)
        self.optimizer.adopt_whole(unit)  # the whole state, held whole until divided on entering

    def enter(self, collective: Any, source: int, resume: int, held: int) -> None:
        """The members first say what they hold. A member one step behind the agreed unit (it gave
        up a step's allreduce its peers finished) holds nothing of that unit: no member keeps a
        step's gradients past its update, and its slices come from their other holders. The
        source hands on the rest of the state (buffers, the loop's state, the optimizer's
        hyperparameters) as without sharding, and the members divide the slices of this
        generation among them, each taking what it lacks from a holder; where no member holds a
        stretch (an owner and its buddy were lost together, or one of them fell a step behind),
        :class:`~fabric_model.state.slices.StateLost`."""
        import torch

        sharded = self.optimizer
        mine = Holding(held, sharded.position, sharded.world, sharded.whole, host_key())
        table = torch.zeros(collective.world_size, len(mine.row()), dtype=torch.int64, device=collective.device)
        collective.wait(collective.all_gather_start(table, torch.tensor(mine.row(), device=collective.device)))
        holdings = [Holding.of_row(row) for row in table.cpu().tolist()]
        if source >= 0:
            self._pull(collective, source)
        sharded.redivide(collective, holdings, resume)

    def join_state(self) -> dict[str, Any]:
        """As replicated, without the parameters whose slices the members hold: they travel by slices."""
        state = super().join_state()
        sliced = self.adapter.sharded_names()
        state["model"] = {k: v for k, v in state["model"].items() if k not in sliced}
        return state

    def upload_rank(self, rank: int) -> int:
        return 0  # every member gathers: all decide as rank 0 does (state/uploader.py, ``agreed``)

    def upload(self, kind: str, unit: int, collective: Any, uploads: StateUploader) -> None:
        """Every member hands its slices to the gather (each calls this); rank 0 sends the whole."""
        model, _, omitted = self.adapter.state_to_send()
        optimizer = self.adapter.gathered_optimizer_state(collective)
        if collective.rank != 0:
            uploads.mark(kind, unit)  # the next snapshot counts from here on every member alike
            return
        uploads.upload(kind, unit, collective.generation, model, self.loop_state.pack(optimizer), omitted)

    def state_bytes(self) -> int:
        """Its slices' and its buddy copy's; after the end's gather, the whole state's."""
        if self.optimizer is None:
            return super().state_bytes()
        return int(self.optimizer.state_bytes())

    def finish(self, collective: Any) -> None:
        """Every member's slices into the user's optimizer, as after an unsharded run."""
        self.adapter.gather_final(collective)
        self.optimizer = None


def layout_named(name: Any) -> type[StateLayout]:
    """The layout a run's identity names (driver/identity.py); replicated for an identity without one."""
    return ShardedOptimizerState if name == ShardedOptimizerState.name else Replicated


def layout_for(config: Any) -> StateLayout:
    """The layout of a run with ``config`` (a TrainConfig, or what has its
    ``shard_optimizer_state``): the one place that reads the flag."""
    return ShardedOptimizerState() if config.shard_optimizer_state else Replicated()


def _leaves(tree: Any) -> Iterator[Any]:
    """The values of a nest of dicts, lists and tuples."""
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _leaves(value)
    else:
        yield tree
