"""A restarted driver takes back the workers that its vanished predecessor left waiting
(docs/architecture.md, "A lost driver"); the workers' half is ``worker/reattach.py``.

It listens where the vanished driver listened, with its secret, and collects each waiting
worker's ``Hello`` of what it holds for up to ``REJOIN_WINDOW``. The same job goes on from the
vanished driver's last committed step: the steps whose reports it never handled are recorded
from what the workers kept, and membership forms the next generation from them. A changed job
does not go on with the old code: the worker holding the furthest state hands it over, every
worker taken back exits, and this driver's own workers start from that state. A worker that
comes back after the driver went on joins as a newcomer, or is sent away.
"""

from __future__ import annotations

import logging
import queue
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..run import metrics_log
from ..run.metrics_log import MetricsLog
from ..state.checkpoint import state_record
from ..state.layouts import layout_named
from ..step.plan import Schedule
from ..transport import protocol as p
from ..transport.control import ControlServer
from .book import StateBook
from .commands import Command
from .identity import LAYOUT, PLAN, differences
from .ledger import Progress
from .membership import Membership, WorkerState

if TYPE_CHECKING:
    from .driver import DriverSetup

#: The driver's logger: these are the driver's lines (driver.log names each line's logger).
log = logging.getLogger("fabric_model.driver.driver")

#: Seconds a restarted driver waits for the workers of its vanished predecessor before it goes
#: on without those that did not come (they retry every 0.1 s: worker/reattach.py).
REJOIN_WINDOW = 5.0
#: What a worker of a vanished driver is told when the restarted driver's job differs from its own.
CHANGED = "replaced: the job changed since its driver vanished"


def where(address: str | None, hostname: str) -> str:
    """How generation lines name a worker's host: the address its connection came from, or its
    own hostname when it connected over loopback (a worker on the driver's host)."""
    if address is None or address.startswith("127.") or address == "::1":
        return hostname
    return address


class Reattach:
    """The driver's side of taking back the workers of this run's vanished driver.

    Args:
        setup: what ``train()`` decided.
        metrics: the run's ``metrics.jsonl``, where the vanished driver recorded its steps.
        schedule, membership, progress, states: the driver's.
        hosts: the driver's worker id -> where it runs, filled in for the workers taken back.
        make_server: makes the control server from the job's secret and a port (0: any).
        moved_on: the driver's commit path, once the steps below a handed-over state are committed.
        position: where a unit is, for the screen.
    """

    def __init__(
        self,
        *,
        setup: DriverSetup,
        metrics: Path,
        schedule: Schedule,
        membership: Membership,
        progress: Progress,
        states: StateBook,
        hosts: dict[int, str],
        make_server: Callable[[bytes, int], ControlServer],
        moved_on: Callable[[], None],
        position: Callable[[int], str],
    ) -> None:
        self.setup, self.metrics, self.schedule = setup, metrics, schedule
        self.membership, self.progress, self.states = membership, progress, states
        self._hosts, self._make_server = hosts, make_server
        self._moved_on, self._position = moved_on, position
        self._server: ControlServer | None = None
        #: Workers of a vanished driver of this run: not this driver's processes (it cannot kill them).
        self.taken_back: set[int] = set()

    @property
    def server(self) -> ControlServer:
        assert self._server is not None, "listen() first"
        return self._server

    def listen(self, rejoin: tuple[tuple[str, int], bytes] | None) -> tuple[ControlServer, bool]:
        """The control server, and whether the vanished driver's workers may come back to it:
        where that driver listened, with its secret, when ``rejoin`` says where (a port taken
        means new workers), else anywhere afresh."""
        if rejoin is not None:
            (_, port), secret = rejoin
            try:
                self._server = self._make_server(secret, port)
                return self._server, True
            except OSError as exc:
                log.warning(
                    "cannot listen on port %d, where the workers of this run's vanished driver would wait (%s): "
                    "starting new workers",
                    port,
                    exc,
                )
        self._server = self._make_server(secrets.token_bytes(32), 0)
        return self._server, False

    def take_back(self) -> dict[int, p.Hello]:
        """Workers of this run's vanished driver that waited for it, each with what it holds: they
        reach this driver within a second of its listening (they try every 0.1 s); the wait ends
        when every member of the run's last generation came, or after ``REJOIN_WINDOW`` seconds.
        What else arrived meanwhile is handled afterwards, in order."""
        _, expected = metrics_log.last_commit(self.metrics, self.schedule)
        came: dict[int, p.Hello] = {}

        def take(worker_id: int, message: Any) -> bool:
            if isinstance(message, p.Hello) and message.held is not None:
                came[worker_id] = message
            elif isinstance(message, p.ConnectionLost) and worker_id in came:
                del came[worker_id]
            else:
                return False
            return True

        self._read(REJOIN_WINDOW, lambda: bool(expected) and set(expected) <= set(came), take)
        return came

    def rejoined(self, came: dict[int, p.Hello]) -> list[Command]:
        """Go on with the workers taken back (docs/elasticity.md, "A lost driver"): from the
        vanished driver's last committed step, recording the steps whose reports it never
        handled from what the workers kept, in a generation above theirs."""
        unit = self._record_kept_reports(came)
        slots = self._slots(came)
        log.warning("took back %d worker(s) that waited for the vanished driver", len(came))
        log.info(
            "taken back: %s; the vanished driver's last committed step was unit %d",
            ", ".join(f"worker {w} (pid {h.pid}, unit {h.held.next_unit})" for w, h in sorted(came.items()) if h.held),
            unit - 1,
        )
        now = time.monotonic()
        commands = self.membership.rejoined({w: h.held for w, h in came.items() if h.held}, slots, now)
        taken = {s for s in slots.values() if s is not None}
        return commands + self.membership.start(now, taken)

    def _slots(self, came: dict[int, p.Hello]) -> dict[int, int | None]:
        """Each worker taken back, noted (its host, whether it finished), with the local slot of
        its device when it was launched (None: started by hand, or its device is not ours)."""
        slots: dict[int, int | None] = {}
        devices = self.setup.devices
        free = list(range(len(devices)))
        for worker_id, hello in sorted(came.items()):
            held = hello.held
            assert held is not None
            self._hosts[worker_id] = where(self.server.peer(worker_id), hello.host)
            if held.finished is not None:
                self.progress.finished(worker_id, held.finished)
            slot = next((s for s in free if devices[s] == held.device), None) if held.launched else None
            if slot is not None:
                free.remove(slot)
            slots[worker_id] = slot
            self.taken_back.add(worker_id)
        return slots

    def _record_kept_reports(self, came: dict[int, p.Hello]) -> int:
        """Go on from the vanished driver's last committed step, recording the steps whose reports
        it never handled from what the workers that came back kept; returns that step's unit."""
        path, schedule = self.metrics, self.schedule
        unit, _ = metrics_log.last_commit(path, schedule)
        unit = max(unit, self.setup.resume.unit if self.setup.resume is not None else 0)
        self.progress.restart_at(
            unit, MetricsLog.replay(path, schedule, unit), metrics_log.epoch_so_far(path, schedule, unit)
        )
        reports = sorted(
            (r for h in came.values() if h.held for r in h.held.reports if schedule.unit(r.epoch, r.step) >= unit),
            key=lambda r: (schedule.unit(r.epoch, r.step), r.rank),
        )
        for report in reports:
            self.progress.step_done(report)
        return unit

    # -- a changed job (docs/elasticity.md, "A lost driver": "A changed script") --------------
    def changed_parts(self, came: dict[int, p.Hello]) -> list[str]:
        """The parts of the job (driver/identity.py) in which what the workers that came back run
        differs from what this driver's command built; empty: the same job."""
        ours = self.setup.identity
        parts = {part for h in came.values() if h.held is not None for part in differences(ours, h.held.identity)}
        return [part for part in ours if part in parts]  # in the identity's order, for the console

    def replace_changed(self, came: dict[int, p.Hello], changed: list[str]) -> p.FinalState | None:
        """The workers that came back run another job than this command's: one holding the
        furthest state hands it over (the job's own state layout permitting), then every one of
        them exits; this driver's own workers go on from that state (:meth:`adopt`), or, when
        none could be handed over, from the newest state on disk, as after a resume."""
        held = {w: h.held for w, h in came.items() if h.held is not None}
        why = self._cannot_hand_over(held, changed)
        handed = self._hand_over(held) if not why else None
        if handed is not None:  # the steps the vanished driver did not record, from what the workers kept
            self._record_kept_reports(came)
        elif not why:
            why = "none handed its state over in time"
        self._stop_taken_back(held)
        self._say_replaced(", ".join(changed), len(came), handed, why)
        return handed

    @staticmethod
    def _cannot_hand_over(held: dict[int, p.Held], changed: list[str]) -> str:
        """Why no worker that came back can hand its state to the new job; empty: one can."""
        if any(h.finished is not None for h in held.values()):
            return "they had finished the schedule"
        if any(not layout_named(h.identity.get(LAYOUT)).whole_on_each_member for h in held.values()):
            return "their optimizer state is sharded, so no one of them holds it whole"
        if PLAN in changed:
            return "the plan changed, so their units are not this run's"
        return ""

    def _say_replaced(self, what: str, count: int, handed: p.FinalState | None, why: str) -> None:
        if handed is not None:
            log.warning(
                "the job changed since its driver vanished (%s): the %d worker(s) that waited handed over their "
                "state %s and exited; new workers run the new job from there, no step redone",
                what,
                count,
                self._position(handed.unit),
            )
            return
        source = self.setup.resume.path.name if self.setup.resume is not None else "the start"
        log.warning(
            "the job changed since its driver vanished (%s): the %d worker(s) that waited exited (%s); new "
            "workers run the new job from %s",
            what,
            count,
            why,
            source,
        )

    def _hand_over(self, held: dict[int, p.Held]) -> p.FinalState | None:
        """Ask the worker that holds the furthest unit for its state (it answers as to a halt:
        worker/main.py) and wait for it, bounded; what else arrives meanwhile is handled later.

        The checkpoint the vanished driver never wrote is sent again first, by the rank 0 that
        uploaded and kept it. That worker need not hold the furthest unit (a peer can be a step
        ahead, having applied a step whose abort reached rank 0 first), so it is asked as well."""
        holder = max(held, key=lambda w: (held[w].next_unit, -w))
        keeper = max(held, key=lambda w: (held[w].unconfirmed, w == holder))
        asked = {holder} | ({keeper} if held[keeper].unconfirmed > held[holder].unconfirmed else set())
        asked = {w for w in asked if self.server.send(w, p.SendFinalState(unconfirmed=True))}
        if holder not in asked:
            return None
        handed: p.FinalState | None = None
        answered: set[int] = set()  # each asked worker's last message came: its state, or its end

        def take(worker_id: int, message: Any) -> bool:
            nonlocal handed
            if worker_id not in asked:
                return False
            if isinstance(message, p.FinalState):
                handed = message if worker_id == holder else handed
                answered.add(worker_id)
            elif isinstance(message, p.StateChunk):  # a checkpoint never written
                self.states.chunk(worker_id, message, message.generation, [worker_id])
            elif isinstance(message, (p.ConnectionLost, p.WorkerFailed)):
                answered.add(worker_id)
            else:
                return False
            return True

        self._read(self.setup.config.timeouts.recovery, lambda: answered >= asked, take)
        return handed

    def _stop_taken_back(self, held: dict[int, p.Held]) -> None:
        """Tell the workers that came back to exit, and wait (bounded) until they did: on a GPU their
        memory must be free before this driver's workers start. Their ids are not reused."""
        worker_ids = sorted(held)
        for worker_id in worker_ids:
            # One started by hand runs its command line anew, joining as a new worker: its user
            # started it for this job's host, and would otherwise have to again.
            self.server.send(worker_id, p.Stop(ended=CHANGED, rejoin=not held[worker_id].launched))
        self.membership.given_up(worker_ids, time.monotonic())
        waiting = set(worker_ids)

        def take(worker_id: int, message: Any) -> bool:
            if isinstance(message, p.ConnectionLost):
                waiting.discard(worker_id)
                return True
            return worker_id in held  # what else they sent no longer matters

        self._read(self.setup.config.timeouts.stop, lambda: not waiting, take)

    def adopt(self, handed: p.FinalState) -> None:
        """The state a worker of the old job handed over, at its unit: the steps below it are
        committed (recorded from what the workers kept), and the first generation loads it."""
        unit = handed.unit
        self.progress.settle(unit, 1 << 62)  # the kept reports of the steps below it: they completed
        # Its state holds every unit below: those with no report (a validation slot) count as done too.
        self.progress.committed.advance(unit)
        self._moved_on()
        setup = self.setup
        model_state = setup.frozen.complete(handed.model_state, handed.omitted)
        record = state_record(
            self.schedule, unit, setup.framework, setup.config.batch_size, model_state, handed.optimizer_state
        )
        self.states.adopt(unit, record)

    def late_back(self, worker_id: int, held: p.Held) -> list[Command]:
        """A worker of this run's vanished driver that came after the driver went on: it joins as
        a newcomer does, taking the state from a member, when its own generations are behind the
        next one's; else it is sent away (it exits). Returns what membership asks for it."""
        if differences(self.setup.identity, held.identity):  # it must not train the old code
            log.warning("worker %d of the vanished driver came back late, running a changed job: it exits", worker_id)
            self.server.send(worker_id, p.Stop(ended=CHANGED, rejoin=not held.launched))
            self.membership.given_up([worker_id], time.monotonic())
        elif held.finished is None and held.generation < self.membership.generation:
            log.warning("worker %d of the vanished driver came back late: it joins", worker_id)
            self.taken_back.add(worker_id)
            return self.membership.ready(worker_id, 1, time.monotonic())
        else:
            self.server.fence(worker_id, "came back after the restarted driver went on without it")
            self.membership.workers[worker_id].state = WorkerState.GONE
        return []

    def _read(self, seconds: float, done: Callable[[], bool], take: Callable[[int, Any], bool]) -> None:
        """Read the control server's events for up to ``seconds``, until ``done()``: ``take``
        handles each and says whether it was its own; the others are put back afterwards, in
        order, for the event loop."""
        deadline = time.monotonic() + seconds
        later: list[tuple[int, Any]] = []
        while time.monotonic() < deadline and not done():
            try:
                worker_id, message = self.server.events.get(timeout=0.05)
            except queue.Empty:
                continue
            if not take(worker_id, message):
                later.append((worker_id, message))
        for event in later:
            self.server.events.put(event)
