"""Membership: which workers form the current generation, as a pure state machine.

Events come in as method calls (a worker registered, became ready, reported how far it got,
was lost, failed in user code; time passed); commands come out as a list (send a message,
kill or start a worker process, settle the step reports of an ended generation, record a
formed generation). Nothing here touches a socket, a process or the clock: the event loop in
:mod:`fabric_model.driver.driver` executes the commands, and tests drive the machine
in-process (``tests/test_membership.py``). See docs/architecture.md, "Elasticity".

A generation ends when a member is lost (its peers' collective fails; a silent worker is
killed first) or when a ready worker waits to join (the members are asked to vote, and all
stop after the same step). Each member then reports how far it got (``next_unit``); the
next generation resumes at the furthest, taking the state from a member that holds it. When
no member does, it rolls back to the newest saved state (checkpoint or snapshot) at or below
the committed unit, or to unit 0, and redoes the steps from there.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import math
import threading
from collections.abc import Callable, Collection, Mapping

from ..errors import JobError
from ..transport import protocol as p
from .change import JOINS, Change
from .commands import (
    AbortGeneration,
    Checkpoints,
    Command,
    Formed,
    Kill,
    Limits,
    RestorePoint,
    RollBack,
    Send,
    Settle,
    Start,
)
from .ledger import CommittedUnit
from .roster import Indexed, Roster

log = logging.getLogger(__name__)

#: Same user error at the same unit this many times: the job fails with it (no crash loop).
USER_ERROR_LIMIT = 3
#: Before the first generation, this many process deaths per slot with no worker ever ready
#: fail the job (a broken environment: the worker cannot even start), with the last one's output.
START_CRASH_LIMIT = 3
#: Committed steps after which a worker counts as training steadily: its slot's backoff resets.
STEADY_STEPS = 20


class WorkerState(enum.Enum):
    """Where a worker is in its life: STARTING -> READY -> MEMBER -> DONE, or GONE from any."""

    STARTING = "starting"  # started or connected, setting up
    READY = "ready"  # set up, waiting to enter a generation
    MEMBER = "member"  # in the current generation
    DONE = "done"  # finished the schedule as a member
    GONE = "gone"  # lost, refused or stopped; its messages are ignored


@dataclasses.dataclass
class WorkerRecord(Indexed):
    """What membership knows of one worker (its ``state`` indexed by the :class:`Roster`)."""

    slot: int | None  # local device slot, None for a worker started by hand
    last_seen: float
    state: WorkerState = WorkerState.STARTING
    steps: int = 0  # steps committed in the generations it was a member of, before the current one
    attempt: int = 1  # its latest Ready's attempt number
    done_unit: int = -1  # next_unit when it finished
    placed: float | None = None  # when its process got a place to run; None while pending


class Membership:
    """The membership state machine of one job. Every public method is an event and returns
    the commands it causes; an unrecoverable state raises (``JobError`` or the user's error)."""

    def __init__(
        self,
        limits: Limits,
        checkpoints: Checkpoints,
        log_tail: Callable[[list[int]], str],
        committed: CommittedUnit | None = None,
    ) -> None:
        self.limits, self.checkpoints, self._log_tail = limits, checkpoints, log_tail
        self.workers: Roster = Roster()  # worker id -> WorkerRecord
        self.generation = -1
        self._members: list[int] = []
        self._member_set: frozenset[int] = frozenset()  # the same, for O(1) "is it a member?"
        self._committed = committed or CommittedUnit()  # the driver's ledger's, shared
        self.finishing = False
        self.final_from = -1
        # Whether a finished member ran the save branch due at the end (or none was due); if not,
        # the member asked for the final state runs it first (docs/architecture.md, "User errors").
        self._end_saved = False
        self._change: Change | None = None
        self._started = 0.0
        self._finish_started = 0.0
        self._aborted_generation = -1
        self._user_errors: collections.Counter[tuple[str, int]] = collections.Counter()
        self._last_user_error: BaseException | None = None
        self._slot_failures: collections.Counter[int] = collections.Counter()
        self._start_crashes = 0  # processes that died before being ready, before the first generation
        self._replacements: list[tuple[float, int]] = []  # (when, slot)
        self._next_id = limits.max_workers
        self._generation_steps = 0  # steps committed in the current generation
        self._silence_checked = 0.0  # when tick() last read every worker's heartbeat
        # worker id -> when the control server last heard from it (time.monotonic()); heartbeats
        # stop there (transport/control.py), so silence is judged from this and ``last_seen``.
        self.heard: Mapping[int, float] = {}
        self._id_lock = threading.Lock()  # the control server's reader threads assign ids too

    # -- queries ----------------------------------------------------------------------------
    @property
    def members(self) -> list[int]:
        """The current generation's members, by rank (a copy must be made to change it: assign)."""
        return self._members

    @members.setter
    def members(self, members: list[int]) -> None:
        self._members, self._member_set = list(members), frozenset(members)

    def is_member(self, worker_id: int) -> bool:
        return worker_id in self._member_set

    def state(self, worker_id: int) -> WorkerState:
        return self.workers[worker_id].state

    def alive(self) -> list[int]:
        return self._in(WorkerState.STARTING, WorkerState.READY, WorkerState.MEMBER, WorkerState.DONE)

    def _placed_starting(self) -> bool:
        """Whether a starting worker has a place to run (a pending one holds nothing back)."""
        return any(self.workers[w].placed is not None for w in self.workers.iter_in(WorkerState.STARTING))

    def allocate_id(self) -> int:
        """A fresh worker id (thread-safe: hand-started workers get theirs on connecting)."""
        with self._id_lock:
            self._next_id += 1
            return self._next_id - 1

    def _first_placed(self) -> float:
        """When the longest-starting worker that has a place to run got it."""
        return min(t for w in self.workers.iter_in(WorkerState.STARTING) if (t := self.workers[w].placed) is not None)

    def _in(self, *states: WorkerState) -> list[int]:
        return self.workers.in_states(*states)

    # -- events -----------------------------------------------------------------------------
    def start(self, now: float, taken: Collection[int] = ()) -> list[Command]:
        """The job starts: one worker per local slot (but the ``taken`` ones, whose workers came back
        to a restarted driver: :meth:`rejoined`)."""
        self._started = now
        slots = self.limits.max_workers if self.limits.local_slots is None else self.limits.local_slots
        free = [slot for slot in range(slots) if slot not in taken]
        commands: list[Command] = []
        for slot in free:
            worker_id = slot if slot not in self.workers else self.allocate_id()
            self.workers[worker_id] = WorkerRecord(slot=slot, last_seen=now, placed=now)
            commands.append(Start(slot, worker_id))
        return commands

    def rejoined(self, held: dict[int, p.Held], slots: dict[int, int | None], now: float) -> list[Command]:
        """A restarted driver took back the workers that waited for it (docs/elasticity.md, "A lost
        driver"): ``held``, what each holds, and ``slots``, the local slot each launched one takes.
        They form the next generation above every one they were in, resuming at the furthest unit
        any holds, from a holder, as after any generation change; or, when they had finished
        the schedule, the final state is asked for."""
        self._started = now
        for worker_id in held:
            record = self.workers[worker_id] = WorkerRecord(slot=slots.get(worker_id), last_seen=now, placed=now)
            record.state = WorkerState.MEMBER
        with self._id_lock:
            self._next_id = max(self._next_id, max(held) + 1)
        self.generation = max(h.generation for h in held.values())
        self.members = sorted(held)
        reports = {w: h.next_unit for w, h in held.items()}
        total = self.limits.total_units
        if max(reports.values()) >= total:  # they finished: the final state is all that is left
            self.members = [w for w in self.members if reports[w] >= total]
            for worker_id in self.members:
                self.workers[worker_id].state, self.workers[worker_id].done_unit = WorkerState.DONE, reports[worker_id]
            finished = [held[w].finished for w in self.members]
            self._end_saved = any(f is None or f.saved for f in finished)  # None: unknown, taken as done
            self.finishing, self._finish_started = True, now
            return [Settle(total, self.generation), *self._request_final()]
        change = Change("the driver restarted", now)
        return self._form_generation(change, reports)

    def given_up(self, worker_ids: Collection[int], now: float) -> None:
        """Workers of a vanished driver that this one sent away (they ran a changed job): gone,
        whatever they send later, and their ids are not given to new workers."""
        for worker_id in worker_ids:
            record = self.workers.get(worker_id)
            if record is None:
                record = self.workers[worker_id] = WorkerRecord(slot=None, last_seen=now, placed=now)
            record.state = WorkerState.GONE
        with self._id_lock:
            self._next_id = max(self._next_id, max(worker_ids, default=-1) + 1)

    def seen(self, worker_id: int, now: float) -> bool:
        """Any message from ``worker_id`` arrived; False when it is gone (ignore the message).
        A worker started by hand is first known here."""
        record = self.workers.get(worker_id)
        if record is None:
            record = self.workers[worker_id] = WorkerRecord(slot=None, last_seen=now, placed=now)
        record.last_seen = now
        return record.state is not WorkerState.GONE

    def slot_of(self, worker_id: int) -> int | None:
        return self.workers[worker_id].slot

    def ready(self, worker_id: int, attempt: int, now: float) -> list[Command]:
        """The worker is set up and asks to enter a generation."""
        record = self.workers[worker_id]
        record.attempt = attempt
        commands: list[Command] = []
        if record.state is WorkerState.MEMBER and self.is_member(worker_id):
            # Its pull failed: the members may be blocked waiting for it in this generation.
            self._cause(worker_id, f"failed to enter generation {self.generation}", now)
            commands += self._abort_members()
        taken = self.workers.count(WorkerState.MEMBER, WorkerState.READY, WorkerState.DONE)
        taken -= record.state in (WorkerState.MEMBER, WorkerState.READY, WorkerState.DONE)
        if taken >= self.limits.max_workers or self.finishing:
            why = "the job is finishing" if self.finishing else f"all {self.limits.max_workers} slots are taken"
            reason = f"join refused: {why} (engines_number={self.limits.max_workers})"
            log.info("worker %d %s", worker_id, reason)
            record.state = WorkerState.GONE
            return [*commands, Send(worker_id, p.Stop(reason))]
        record.state = WorkerState.READY
        if self.generation < 0:
            if not self._placed_starting():
                commands += self._form_generation(None)
        elif self._change is None:
            self._cause(worker_id, JOINS, now)
            commands += [Send(m, p.JoinPending(self.generation + 1)) for m in self.members]
        else:  # a change under way takes it in, if there is room: its reason names it then
            self._cause(worker_id, JOINS, now)
        return commands

    def placement(self, pending: frozenset[int] | set[int], now: float) -> None:
        """The launcher's starting workers that have no place to run yet (a cluster without
        room): they are no failure, count against no start bound and hold back no generation;
        one that gets a place starts its start bound then."""
        for worker_id in self._in(WorkerState.STARTING):
            record = self.workers[worker_id]
            if worker_id in pending:
                record.placed = None
            elif record.placed is None:
                record.placed = now

    @property
    def committed_unit(self) -> int:
        """Every unit below this is committed."""
        return self._committed.unit

    def committed(self, unit: int) -> None:
        """Progress committed every unit below ``unit``: training moved on."""
        self._committed.advance(unit)
        self._last_user_error = None  # an earlier error is not this run's cause any more
        self._generation_steps += 1
        if self._generation_steps > STEADY_STEPS:
            return  # every member's slot was reset by now: O(1) a step from here
        for member in self.members:
            record = self.workers[member]
            if record.slot is not None and record.steps + self._generation_steps >= STEADY_STEPS:
                self._slot_failures[record.slot] = 0  # a slot that trains steadily starts its backoff afresh

    def left(self, worker_id: int, message: p.LeftGeneration, now: float) -> list[Command]:
        """A member left its generation (a voted switch, or a failed collective)."""
        if message.leaving:
            return self._leaves(worker_id, message, now)
        if message.generation != self.generation or not self.is_member(worker_id):
            return []
        commands: list[Command] = []
        reason = message.reason or ("failed" if message.failed else "switch")
        self._begin_change(f"worker {worker_id}: {reason}", now)
        if message.failed:
            commands += self._abort_members()  # peers may be blocked in a collective this worker left
        if message.next_unit >= 0:
            assert self._change is not None
            self._change.reports[worker_id] = message.next_unit
        return commands

    def _leaves(self, worker_id: int, message: p.LeftGeneration, now: float) -> list[Command]:
        """A member told to leave (a preemption signal) left after the step its generation voted
        to end at, and exits by itself: it is gone, with no abort and nothing to kill; the others
        report as after any voted switch. Its slot is asked for again as a lost worker's is, with
        the slot's backoff (docs/architecture.md, "Preemption")."""
        record = self.workers[worker_id]
        if record.state is WorkerState.GONE:
            return []
        record.state = WorkerState.GONE
        log.warning("worker %d %s at unit %d", worker_id, message.reason, message.next_unit)
        if record.slot is not None and self.limits.replace_workers and not self.finishing:
            self._replacements.append((now + self._backoff(record.slot, True, crashed=False), record.slot))
        if message.generation == self.generation and self.is_member(worker_id) and not self.finishing:
            self._cause(worker_id, message.reason, now)
        return []

    def finished(self, worker_id: int, next_unit: int, saved: bool = True) -> None:
        """The worker ran the schedule to its end; ``saved``: the save branch due at the end ran
        in it, or none was due."""
        self._end_saved = self._end_saved or saved
        record = self.workers[worker_id]
        record.state, record.done_unit = WorkerState.DONE, next_unit
        if self._change is not None:
            self._change.reports[worker_id] = next_unit

    def user_error(
        self, worker_id: int, exc: BaseException, signature: str, now: float, unit: int = -1
    ) -> list[Command]:
        """The worker raised ``exc`` in user code (``signature``: its traceback's last line).

        It is the user's, and raised, when every member of the generation (up to
        ``USER_ERROR_LIMIT`` of them) raised it at the same ``unit`` (a deterministic bug, say in
        ``forward``: the job fails at once, with no generation change or rollback), when it came
        ``USER_ERROR_LIMIT`` times at the same unit, or after the
        last step (the worker was at ``unit`` past it, every step is committed, or a peer finished the
        schedule). Otherwise the worker is lost, as a one-off (a flaky read on one host). A worker
        failing while setting up has no unit; then the same error on every slot is the user's."""
        member = self.is_member(worker_id) and self.workers[worker_id].state is WorkerState.MEMBER
        last = self.limits.total_units - 1  # the final validation slot: every step is behind it
        past_steps = unit >= last or self.committed_unit >= last
        if past_steps or (member and any(self.workers[m].state is WorkerState.DONE for m in self.members)):
            # The error came after the last step (an end-of-run callback, say an export in
            # on_epoch_end(save_model=True), which one worker runs):
            # going on without the worker would hide it.
            raise exc
        # The worker's own position: the committed unit can lag it (a peer's report still on its
        # way), and members failing at the same step must count as the same error: every member
        # of a generation of up to USER_ERROR_LIMIT failing alike raises it at once, no line of ours.
        at = (unit if unit >= 0 else self.committed_unit) if member else -1
        key = (signature, at)
        self._user_errors[key] += 1
        self._last_user_error = exc
        peers = len(self.members) if member else self.limits.max_workers
        if self._user_errors[key] >= min(USER_ERROR_LIMIT, peers):
            raise exc
        return self.lost(worker_id, f"error: {str(exc)[:200]}", now, crashed=False)

    def process_exited(self, worker_id: int, code: int, now: float) -> list[Command]:
        """A local worker process ended (a clean exit at the end is no loss)."""
        if self.workers[worker_id].state is WorkerState.GONE or (code == 0 and self.finishing):
            return []
        return self.lost(worker_id, f"process exited with code {code}", now)

    def lost(self, worker_id: int, reason: str, now: float, crashed: bool = True) -> list[Command]:
        """The worker is gone: its process died, its link closed, it froze, or (not ``crashed``) it failed."""
        record = self.workers[worker_id]
        if record.state is WorkerState.GONE:
            return []
        was_member = record.state in (WorkerState.MEMBER, WorkerState.DONE) and self.is_member(worker_id)
        if crashed and self.generation < 0 and record.state is WorkerState.STARTING:
            self._start_crashes += 1
            if self._start_crashes >= START_CRASH_LIMIT * self.limits.max_workers and not self._in(WorkerState.READY):
                raise JobError(
                    f"every worker process died before it was ready ({self._start_crashes} starts; the last: "
                    f"{reason}). The last one's output:\n" + self._log_tail([worker_id])
                )
        record.state = WorkerState.GONE
        if was_member:  # the display's line for the generation change says it on screen
            log.warning("worker %d lost: %s", worker_id, reason)
        else:  # no generation changes for it (a replacement that died starting): said on screen as is
            log.warning("worker %d left before joining: %s", worker_id, reason)
        commands: list[Command] = [Kill(worker_id, f"removed from the job: {reason}")]
        if self.finishing and worker_id == self.final_from:
            commands += self._request_final()
        if record.slot is not None and self.limits.replace_workers and not self.finishing:
            delay = self._backoff(record.slot, record.placed is not None, crashed)
            self._replacements.append((now + delay, record.slot))
        if was_member and not self.finishing:
            self._cause(worker_id, f"lost: {reason}", now)
            commands += self._abort_members()
        return commands

    def tick(self, now: float, heartbeats: bool = True) -> list[Command]:
        """Time passed: silent workers, due replacements, a change to complete, the end, deadlines.
        ``heartbeats`` False skips the silence check, the one part that reads every worker (the
        driver runs it periodically, and the rest after each message that can complete a change)."""
        commands: list[Command] = []
        # Every worker's silence (and start bound), read at most ten times in a heartbeat bound and
        # once a second: with thousands of workers, reading them all at every tick costs a core.
        read_all = heartbeats and now - self._silence_checked >= min(1.0, self.limits.heartbeat / 10)
        if read_all:
            self._silence_checked = now
            for worker_id in self._in(WorkerState.READY, WorkerState.MEMBER, WorkerState.DONE):
                silent = now - max(self.workers[worker_id].last_seen, self.heard.get(worker_id, -math.inf))
                if silent > self.limits.heartbeat:
                    commands += self.lost(worker_id, f"no heartbeat for {silent:.1f} s (EDT_HEARTBEAT_TIME_OUT)", now)
        commands += self._start_replacements(now)
        if self._change is not None:
            commands += self._try_complete_change(now)
        members_done = self.members and all(self.workers[m].state is WorkerState.DONE for m in self.members)
        if not self.finishing and self.generation >= 0 and members_done:
            self.finishing, self._finish_started = True, now
            commands += [Settle(self.limits.total_units, self.generation), *self._request_final()]
        if self.finishing and now - self._finish_started > self.limits.recovery:
            raise JobError(f"no final state from worker {self.final_from} within {self.limits.recovery:.0f} s")
        if self.generation < 0:
            placed = self._placed_starting()
            ready = self.workers.count(WorkerState.READY)
            if ready and not placed:
                commands += self._form_generation(None)  # the others failed or wait for room: go without them
            elif placed and read_all and now - self._first_placed() > self.limits.start:
                commands += self._start_deadline()
            elif not placed and not ready and now - self._started > self.limits.start:
                self._started = now  # say it once per start bound: nothing failed, the cluster is full
                if self.limits.local_slots == 0:  # FABRIC_MODEL_LOCAL_WORKERS=0
                    log.warning("no worker has joined yet: waiting for workers started by hand (join.json)")
                else:
                    log.warning("no worker has a place to run yet: waiting for the cluster to make room")
        return commands

    # -- internals --------------------------------------------------------------------------
    def _backoff(self, slot: int, placed: bool, crashed: bool) -> float:
        """1 s doubling to 30 s with the slot's failures, but a first crash is replaced at once (a
        warm fork takes milliseconds; a user's error waits); a request never placed is no failure."""
        self._slot_failures[slot] += placed
        failures = self._slot_failures[slot]
        return 0.0 if placed and crashed and failures == 1 else min(30.0, 2.0 ** (max(1, failures) - 1))

    def _start_replacements(self, now: float) -> list[Command]:
        commands: list[Command] = []
        for when, slot in list(self._replacements):
            if now >= when and len(self.alive()) < self.limits.max_workers and not self.finishing:
                self._replacements.remove((when, slot))
                worker_id = self.allocate_id()
                self.workers[worker_id] = WorkerRecord(slot=slot, last_seen=now, placed=now)
                commands.append(Start(slot, worker_id))
        return commands

    def _start_deadline(self) -> list[Command]:
        """The start bound passed: go with the ready workers, or fail naming the missing ones."""
        if not self._in(WorkerState.READY):
            missing = [w for w in self._in(WorkerState.STARTING) if self.workers[w].placed is not None]
            raise JobError(
                f"no worker became ready within {self.limits.start:.0f} s (EDT_START_TIME_OUT). "
                f"Their logs:\n" + self._log_tail(missing)
            )
        return self._form_generation(None)

    def _begin_change(self, reason: str, now: float) -> None:
        if self._change is None:
            log.info("generation %d ending: %s", self.generation, reason)
            self._change = Change(reason, now, waiting=collections.deque(self.members))

    def _cause(self, worker_id: int, what: str, now: float) -> None:
        """Worker ``worker_id`` joined, left or was lost: the change's reason names it (a peer's
        report, "worker 0: allreduce failed", may have begun the change before)."""
        self._begin_change(f"worker {worker_id} {what}", now)
        assert self._change is not None
        self._change.cause(worker_id, what)

    def _abort_members(self) -> list[Command]:
        """Tell the members to give up this generation's collectives (once per generation)."""
        if self._aborted_generation == self.generation:
            return []
        self._aborted_generation = self.generation
        members = tuple(m for m in self._in(WorkerState.MEMBER) if self.is_member(m))
        return [AbortGeneration(self.generation, members)]

    def _try_complete_change(self, now: float) -> list[Command]:
        change = self._change
        assert change is not None
        # Members still heartbeating are busy (a long step, a validation); they report at their
        # next micro-batch or collective. Silent ones are removed by the heartbeat check. Each
        # member leaves the front of ``waiting`` once, when it reported or is no longer a member
        # (neither comes undone), so a change's checks cost O(members) in all, not per message.
        waiting = change.waiting
        while waiting and (self.workers[waiting[0]].state is not WorkerState.MEMBER or waiting[0] in change.reports):
            waiting.popleft()
        if waiting:
            return []
        reports = {w: u for w, u in change.reports.items() if self.workers[w].state is not WorkerState.GONE}
        reports.update({w: self.workers[w].done_unit for w in self.members if self.state(w) is WorkerState.DONE})
        total = self.limits.total_units
        finished = any(
            self.workers[w].done_unit >= total for w in self.members if self.state(w) is not WorkerState.GONE
        )
        # Members at the end that have not finished failed in the end's own collectives (a sharded
        # state's gather of every slice): they form a generation at the end and do it again.
        if finished:  # some finished: the others are not needed
            self.members = [w for w in self.members if self.workers[w].done_unit >= total]
            self._change = None
            self.finishing, self._finish_started = True, now
            return [Settle(total, self.generation), *self._request_final()]
        if not reports:
            return self._without_holders(change, now)
        return self._form_generation(change, reports)

    def _without_holders(self, change: Change, now: float) -> list[Command]:
        """No member holds the state: go on with whoever becomes ready, from the newest saved
        state at or below the committed unit (``_form_generation``), else from unit 0."""
        if not self._in(WorkerState.READY):
            waited = now - change.started
            if (not self._replacements and not self._in(WorkerState.STARTING)) or waited > self.limits.recovery:
                hint = "; resume from the newest checkpoint with train(..., resume=True)"
                raise self._last_user_error or JobError(
                    f"no worker left and none became ready in {waited:.0f} s ({change.reason(())})"
                    + (hint if self.checkpoints.has_any() else "")
                )
            return []  # wait for a replacement (started or due) to become ready
        return self._form_generation(change, {})

    def _form_generation(self, change: Change | None, reports: dict[int, int] | None = None) -> list[Command]:
        """The next generation, after ``change`` (None: the first)."""
        reports = reports or {}
        survivors = [m for m in self.members if m in reports]
        room = self.limits.max_workers - len(survivors)
        kept = set(survivors)
        newcomers = [w for w in self._in(WorkerState.READY) if w not in kept][: max(0, room)]
        resume = max(reports.values()) if reports else self.committed_unit
        holders = [m for m in survivors if reports[m] == resume]
        members = survivors + newcomers
        needs_state = bool(survivors) and (bool(newcomers) or len(holders) < len(survivors))
        source = members.index(holders[0]) if needs_state else -1
        restore: RestorePoint | None = None
        rolled_back_from: int | None = None
        if not survivors and (resume > 0 or change is not None):
            restore, rolled_back_from = self._restore_point(resume, newest=change is not None)
            if rolled_back_from is not None:
                resume = restore.unit if restore is not None else 0
            elif restore is not None and restore.unit > resume:
                resume = restore.unit  # its steps not yet counted are, by the Settle below
        elif survivors and resume < self.committed_unit:
            # A step rank 0 reported was lost with every member that finished it (its allreduce
            # failed on the survivors, who undid it): it is redone, as after any rollback.
            log.warning(
                "the members left hold unit %d, below the committed unit %d: redoing the steps from there",
                resume,
                self.committed_unit,
            )
            rolled_back_from = self.committed_unit
        if rolled_back_from is not None:
            self._committed.roll_back(resume)
        commands: list[Command] = [Settle(resume, self.generation)]
        if rolled_back_from is not None:
            commands.append(RollBack(resume))
        settings = self.checkpoints.settings(restore.name if restore is not None else None)
        data = restore.data if restore is not None else None
        for worker_id in self.members:  # the ended generation's steps count for its members
            self.workers[worker_id].steps += self._generation_steps
        self.generation += 1
        self.members, self._change, self._generation_steps = members, None, 0
        taken = set(members)
        reason, subjects = (change.reason(taken), change.subjects(taken)) if change else ("start", ())
        checkpoint = restore.name if restore is not None and restore.kind == "checkpoint" else None
        kind = restore.kind if restore is not None else None
        # Formed before the Sends: the driver's store admits the members before they are told.
        commands.append(
            Formed(
                self.generation, tuple(members), reason, resume, source, checkpoint, kind, rolled_back_from, subjects
            )
        )
        for rank, worker_id in enumerate(members):
            record = self.workers[worker_id]
            record.state = WorkerState.MEMBER
            message = p.EnterGeneration(
                self.generation, rank, len(members), resume, source, settings, record.attempt, data
            )
            commands.append(Send(worker_id, message))
        return commands

    def _restore_point(self, resume: int, newest: bool = False) -> tuple[RestorePoint | None, int | None]:
        """Nobody holds the state of ``resume`` (a resumed run, or every holder lost): every
        member loads the newest saved state at or below it, or keeps the job's initial weights
        (unit 0, which every worker has). Returns it, and ``resume`` when that means rolling back.
        ``newest``: every member was lost, so the newest state saved is the furthest any holds,
        even past the committed unit (rank 0 uploads a state after reporting the steps in it, and
        its last step waits for the next report: driver/ledger.py). See docs/architecture.md,
        "Elasticity", "No holder left"."""
        restore = self.checkpoints.restore_point(self.limits.total_units if newest else resume)
        unit = restore.unit if restore is not None else 0
        if unit >= resume:
            return restore, None
        log.warning("no worker holds the state of unit %d: rolling back to unit %d and redoing the steps", resume, unit)
        return restore, resume

    def _request_final(self) -> list[Command]:
        """Ask one finished, live member for the final state."""
        total = self.limits.total_units
        finished = [
            w for w in self.members if self.workers[w].done_unit >= total and self.state(w) is not WorkerState.GONE
        ]
        if not finished:
            raise JobError("training ended, but every finished replica was lost before sending the final state")
        self.final_from = finished[0]
        return [Send(finished[0], p.SendFinalState(save_branch=not self._end_saved))]
