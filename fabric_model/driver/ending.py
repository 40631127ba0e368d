"""The driver's side of ending training before its end with a state for the user: replicas
diverged (docs/architecture.md, "Replica checks"), the driver was told to go ("Preemption"), or
the caller asked (``FabricModel.stop_training()``: docs/training.md, "Stopping from the caller").

Training halts (driver/halt.py says who is asked): the generation is aborted and the members
are asked for their state, rank 0 first, or, with a sharded optimizer state, told to stop
together. While halted, :class:`Ending` alone reads the members' messages and the deadlines,
until there is a state to end with: the one a member sent, else the newest saved one the driver
holds (a member's state below the committed unit only when nothing holds more). A preempted
run's state is then written as a checkpoint and ``Preempted`` raised.

Each entry point returns the run's final state (:class:`FinalState`) once it has one (None
until then); the driver keeps it, as it keeps the one a finished run's rank 0 sends.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..state.checkpoint import decode_state, encode_state, state_record
from ..state.writer import CheckpointBook
from ..step.plan import Schedule
from ..transport import protocol as p
from .book import StateBook
from .commands import AbortGeneration, Command, RestorePoint
from .halt import Halt
from .ledger import Progress
from .membership import Membership, WorkerState
from .preemption import Preempted, SignalWatch
from .replicas import Divergence, ReplicaDivergenceError

if TYPE_CHECKING:
    from .driver import DriverSetup

#: The driver's logger: these are the driver's lines (driver.log names each line's logger).
log = logging.getLogger("fabric_model.driver.driver")


@dataclasses.dataclass
class FinalState:
    """The trained model and optimizer state, as one replica sent them (or, when replicas
    diverged and none could, the newest state the driver held).

    Attributes:
        worker, unit: who sent it (-1: a saved state), with every unit below ``unit`` done.
        divergence: set when replicas diverged: the state is handed back, then the error raised.
        source: for a person, whose state this is ("worker 0's final state").
    """

    model_state: dict[str, Any]
    optimizer_state: dict[str, Any]
    worker: int = -1
    unit: int = -1
    divergence: Divergence | None = None
    source: str = ""


class Ending:
    """Ends training before its end: a halt started, its members asked, the state it ends with.

    Args:
        setup: what ``train()`` decided.
        whole_on_each_member: whether any one member holds the whole state (the state layout's).
        schedule, membership, progress, states, checkpoints: the driver's.
        watch: the driver's preemption signals (:class:`~fabric_model.driver.preemption.SignalWatch`).
        send: sends a member a message; False when it could not (the driver's control server).
        execute: executes membership's commands (the driver's).
        ended: whether a worker's process ended and all it sent was read, at a time.
        moved_on: the driver's commit path, once the steps below a state handed back are committed.
        position: where a unit is, for a person; True: as the screen counts.
        clock: the driver's ``time.monotonic`` (a test's clock).
    """

    def __init__(
        self,
        *,
        setup: DriverSetup,
        whole_on_each_member: bool,
        schedule: Schedule,
        membership: Membership,
        progress: Progress,
        states: StateBook,
        checkpoints: CheckpointBook,
        watch: SignalWatch,
        send: Callable[[int, Any], bool],
        execute: Callable[[list[Command]], None],
        ended: Callable[[int, float], bool],
        moved_on: Callable[[], None],
        position: Callable[[int, bool], str],
        clock: Callable[[], float],
    ) -> None:
        self.setup, self._whole = setup, whole_on_each_member
        self.schedule, self.membership, self.progress = schedule, membership, progress
        self.states, self.checkpoints, self.watch = states, checkpoints, watch
        self._send, self._execute, self._ended = send, execute, ended
        self._moved_on, self._position, self._clock = moved_on, position, clock
        self.halt: Halt | None = None
        self._held: RestorePoint | None = None  # the saved state a preempted run writes, when no member sent one
        # A member's state below the committed unit (see ``_behind_committed``): used only when
        # no member or saved state holds more.
        self._behind: FinalState | None = None
        self._asked: set[int] = set()  # members asked so far: a late answer still counts

    @property
    def halted(self) -> bool:
        """Training halted: membership no longer acts; only the state asked for matters."""
        return self.halt is not None

    @property
    def preempted(self) -> bool:
        """Halted for a preemption signal."""
        return self.halt is not None and bool(self.halt.preempted)

    @property
    def requested(self) -> bool:
        """Halted because the caller asked (``stop_training()``)."""
        return self.halt is not None and self.halt.requested

    def _members(self) -> list[int]:
        return [m for m in self.membership.members if self.membership.state(m) is not WorkerState.GONE]

    # -- replica checks (docs/architecture.md, "Replica checks") ---------------------------
    def diverged(self, divergence: Divergence) -> FinalState | None:
        """Stop training: abort the generation, then ask rank 0 for its state (then rank 1...)."""
        members = self._members()
        log.error(
            "replicas diverged %s: %s; training stops, asking rank 0 (worker %d) for its state",
            divergence.where,
            divergence.describe(),
            members[0],
        )
        self.halt = Halt(divergence, members, self.setup.config.timeouts.recovery)
        self._execute([AbortGeneration(self.membership.generation, tuple(members))])
        return self._ask_for_state()

    def _ask_for_state(self) -> FinalState | None:
        halt = self.halt
        assert halt is not None
        if not self._whole and halt.asked < 0:
            # No member holds the whole optimizer state (docs/elasticity.md, "Sharded optimizer
            # state"): the newest whole state saved, never a member's slices as if they were all.
            log.warning("sharded optimizer state: the newest saved is kept")
            halt.candidates.clear()
        while (worker := halt.next(self._clock())) is not None:
            if self.membership.state(worker) is not WorkerState.GONE and self._send(worker, p.SendFinalState()):
                self._asked.add(worker)
                return None
        return self._without_member()

    def _without_member(self) -> FinalState:
        """No member (left) to ask: the newest saved state, or a member's below the committed unit
        when it holds more (``_behind_committed``)."""
        halt = self.halt
        assert halt is not None
        limit = self.progress.committed_unit if halt.divergence is not None else self.schedule.total_units
        restore = self.states.restore_point(limit)
        behind = self._behind
        if behind is not None and (restore is None or restore.unit < behind.unit):
            return self._roll_back_to(behind)
        if halt.divergence is not None:
            return self._saved_state(halt.divergence, restore)
        return self._requested_state(restore) if halt.requested else self._held_state(restore)

    def handle(self, worker_id: int, message: Any) -> FinalState | None:
        """A message from ``worker_id`` while halted: only the state asked for matters (and who
        stops together)."""
        halt = self.halt
        assert halt is not None
        if isinstance(message, p.LeftGeneration) and message.last is not None:
            self.progress.copy(message.last)  # a step rank 0 did not report, when it was lost
        if worker_id in halt.stopping:
            if isinstance(message, p.LeftGeneration) and message.leaving:
                halt.stopping.discard(worker_id)  # rank 0's upload came before its LeftGeneration
            elif isinstance(message, (p.LeftGeneration, p.WorkerFailed, p.ConnectionLost)):
                log.warning("worker %d did not stop with the others; keeping the newest state held", worker_id)
                halt.stopping.clear()
            if not halt.stopping:
                return self._without_member()
            return None
        if isinstance(message, p.FinalState) and worker_id in self._asked:
            final = self._final_state(worker_id, message)
            if message.unit < self.progress.committed_unit:
                return self._behind_committed(worker_id, final)
            # Its steps below ``unit`` completed in an allreduce: the state handed back holds them.
            if self.progress.settle(message.unit, self.membership.generation) is not None:
                self._moved_on()
            return final  # the member asked, or one asked before whose answer came late
        if worker_id != halt.asked:
            return None
        if isinstance(message, (p.WorkerFailed, p.ConnectionLost)) or (
            isinstance(message, p.LeftGeneration) and message.leaving
        ):
            return self._ask_next(worker_id)
        return None

    def tick(self, now: float) -> FinalState | None:
        """The deadlines while halted and no state is had yet: past a preemption's grace, the
        newest state held; the member asked overdue or ended, the next asked."""
        halt, watch = self.halt, self.watch
        assert halt is not None
        if halt.preempted and now > watch.deadline - watch.reserve:
            log.warning("no member sent its state within the grace; keeping the newest state held")
            return self._without_member()
        if halt.overdue(now) or self._asked_has_ended(now):
            return self._ask_next(halt.asked)
        return None

    def _asked_has_ended(self, now: float) -> bool:
        """The member asked for its state has ended and all it sent was read: a leaving rank 0's
        snapshot, sent just before it exits, is the newest state (docs/architecture.md, "Preemption")."""
        assert self.halt is not None
        return self._ended(self.halt.asked, now)

    def _final_state(self, worker_id: int, message: p.FinalState) -> FinalState:
        halt = self.halt
        assert halt is not None
        rank = "rank 0, " if halt.divergence is not None and halt.divergence.reference == worker_id else ""
        how = "stopped by stop_training()" if halt.requested else "stopped"
        source = f"training {how}; worker {worker_id}'s state ({rank}{self._position(message.unit, False)})"
        model_state = self.setup.frozen.complete(message.model_state, message.omitted)  # the job's frozen part
        return FinalState(model_state, message.optimizer_state, worker_id, message.unit, halt.divergence, source)

    def _behind_committed(self, worker_id: int, final: FinalState) -> FinalState | None:
        """A member's state below the committed unit: the abort came while its step's allreduce
        had completed on rank 0 (which reported the step) and not yet on this member, which undid
        it. Ending with it would drop a committed step, so the next member is asked, and once none
        is left the newest saved state counts (a leaving rank 0's snapshot holds the step); this
        one only if nothing holds more (docs/architecture.md, "Preemption")."""
        assert self.halt is not None
        log.info(
            "worker %d's state is at %s, below the last committed step; looking for a newer one",
            worker_id,
            self._position(final.unit, False),
        )
        if self._behind is None or final.unit > self._behind.unit:
            self._behind = final
        if worker_id != self.halt.asked:
            return None  # a late answer: the member asked now may still send more
        return self._ask_for_state()

    def _roll_back_to(self, final: FinalState) -> FinalState:
        """No member and no saved state holds the committed steps: the newest state a member sent
        is the result, and the steps past it are un-committed (a resume redoes them; in the
        metrics log the later record of a step wins)."""
        log.warning(
            "no member or saved state holds the last committed step: ending with %s; the steps from %s on "
            "are redone on resume",
            final.source,
            self._position(final.unit, False),
        )
        self._behind = None
        self.progress.roll_back(final.unit)
        return final

    def _ask_next(self, worker_id: int) -> FinalState | None:
        """The member asked sent no state (it ended, or took too long): ask the next. Expected when
        preempted (a member told to go too may have left), so said in driver.log only then."""
        assert self.halt is not None
        if self.halt.preempted:
            log.info("worker %d sent no state (it may have left on a notice of its own); asking the next", worker_id)
        else:
            log.warning("worker %d sent no state; asking the next member", worker_id)
        return self._ask_for_state()

    def _saved_state(self, divergence: Divergence, restore: RestorePoint | None) -> FinalState:
        """No member sent its state: the newest checkpoint or snapshot the driver holds (``restore``)."""
        if restore is None:
            raise ReplicaDivergenceError(
                f"replicas diverged {divergence.where}: {divergence.describe()}. No member sent its state and the "
                "driver holds no checkpoint or snapshot: no model was written",
                divergence,
            )
        state = decode_state(restore.data, self.setup.plan, restore.name)
        source = (
            f"training stopped; no member sent its state, so the {restore.name} ({self._position(restore.unit, False)})"
        )
        return FinalState(state["model"], state["optimizer"], -1, restore.unit, divergence, source)

    # -- the caller's stop (docs/training.md, "Stopping from the caller") ---------------------
    def stop_on_request(self) -> FinalState | None:
        """Stop training as a halt does, and end the run normally with the state after the last
        step every member completed: the step in flight is abandoned (exactly-once holds for the
        steps kept), rank 0 asked for its state (then rank 1...). A sharded optimizer state: the
        members stop together after one step, rank 0 uploading the state gathered from their slices."""
        members = self._members()
        log.info("stop_training(): stopping training at the last step every member completed")
        patience = self.setup.config.timeouts.recovery
        if not self._whole and members and self.membership.generation >= 0:
            self.halt = Halt(None, [], patience, requested=True, stopping=set(members))
            for worker_id in members:
                self._send(worker_id, p.StopTogether("stop_training()"))
            return None
        self.halt = Halt(None, members, patience, requested=True)
        if members and self.membership.generation >= 0:
            self._execute([AbortGeneration(self.membership.generation, tuple(members))])
        return self._ask_for_state()

    def _requested_state(self, restore: RestorePoint | None) -> FinalState:
        """No member sent its state after ``stop_training()``: the newest checkpoint or snapshot
        held (every member lost at once, or a sharded state's members that did not stop together)."""
        if restore is None:
            raise RuntimeError(
                "training was stopped by stop_training(), but no member sent its state and the driver holds no "
                "checkpoint or snapshot: no model was written (driver.log says what became of the workers)"
            )
        state = decode_state(restore.data, self.setup.plan, restore.name)
        log.info("stop_training(): no member sent its state; the %s is the result", restore.name)
        return FinalState(state["model"], state["optimizer"], -1, restore.unit, source=f"the {restore.name}")

    # -- preemption (docs/architecture.md, "Preemption") -------------------------------------
    def preempt(self) -> FinalState | None:
        """Stop training as a halt does for the preemption signal the watch caught, asking the
        members for their state with what the grace leaves (a third of it each, the rest for
        writing and stopping)."""
        watch = self.watch
        assert watch.signal_name is not None, "no preemption signal was caught"
        members = self._members()
        log.info(
            "%s: stopping training and saving the newest state (FABRIC_MODEL_PREEMPT_GRACE %.0f s)",
            watch.signal_name,
            watch.grace,
        )
        watch.acted = True
        patience = max(0.5, (watch.deadline - watch.reserve - self._clock()) / 3)
        if not self._whole and members and self.membership.generation >= 0:
            # No member holds the whole optimizer state: they stop together, and rank 0 uploads
            # the state gathered from all their slices (driver/halt.py). Not in time: the newest held.
            self.halt = Halt(None, [], patience, preempted=watch.signal_name, stopping=set(members))
            for worker_id in members:
                self._send(worker_id, p.StopTogether(str(watch.signal_name)))
            return None
        self.halt = Halt(None, members, patience, preempted=watch.signal_name)
        if members and self.membership.generation >= 0:
            self._execute([AbortGeneration(self.membership.generation, tuple(members))])
        return self._ask_for_state()

    def _held_state(self, restore: RestorePoint | None) -> FinalState:
        """No member sent its state in time: the newest checkpoint or snapshot the driver holds
        (:meth:`save_preempted` writes a snapshot), else unit 0, the initial weights. The newest at
        any unit: rank 0 uploads a state after reporting its steps, and the last of them counts
        only at the next report (driver/ledger.py), so a state one step past the committed unit is
        the furthest any member held, its steps all done."""
        self._held = restore
        log.info("the newest state held: %s", restore.name if restore is not None else "none (the initial weights)")
        if restore is None:
            return FinalState({}, {}, -1, 0, source="the initial weights")
        return FinalState({}, {}, -1, restore.unit, source=f"the {restore.name}")

    def save_preempted(self, final: FinalState | None) -> None:
        """Write the state a member sent (or the snapshot held) as a checkpoint, then raise
        :class:`~fabric_model.driver.preemption.Preempted`; the driver's ``finish`` then stops the workers."""
        watch = self.watch
        assert final is not None and watch.signal_name is not None
        unit, generation = final.unit, self.membership.generation
        # The steps below ``unit`` completed in an allreduce: commit those still waiting (driver/ledger.py).
        if self.progress.settle(unit, generation) is not None:
            self._moved_on()
        if final.worker >= 0:
            record = state_record(
                self.schedule,
                unit,
                self.setup.framework,
                self.setup.config.batch_size,
                final.model_state,
                final.optimizer_state,
            )
            self.checkpoints.store(final.worker, generation, unit, encode_state(record))
        elif self._held is not None and self._held.kind == "snapshot":  # a checkpoint is on disk already
            self.checkpoints.store(-1, generation, unit, self._held.data)
        self.checkpoints.close(max(0.5, watch.deadline - self._clock()))
        written = self.checkpoints.newest_on_disk(unit)
        path = written[1] if written is not None and written[0] == unit else None
        seconds = self._clock() - watch.received
        saved = f"{path.name} ({path.stat().st_size} bytes)" if path is not None else "nothing (no step was done)"
        log.info("%s: saved %s in %.2f s", watch.signal_name, saved, seconds)
        raise Preempted(watch.signal_name, path, unit, self._position(unit, True), seconds)
