"""The driver: a thin event loop that routes control-plane messages to membership, progress
and checkpoint bookkeeping, and executes the commands membership returns.

It computes no gradients. One thread owns all of its state: the control server's reader
threads only put ``(worker_id, message)`` on a queue, and this loop handles them one at a
time, then ``tick``s (process deaths, heartbeats, replacements, deadlines). See
docs/architecture.md, "Processes" and "Elasticity".

``run()`` is ``start()``, ``iterate()`` until there is a ``final`` state, then ``finish()``. A
test drives those, or ``listen()`` and then ``handle()`` and ``tick()``, over fakes that the
constructor's factories make (docs/architecture.md, "Testing seams"). Taking back the workers of
a vanished driver is ``reattach.py``'s; ending training before its end (replicas diverged, a
preemption signal, ``stop_training()``) is ``ending.py``'s.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import rebuild_exception
from ..launchers.base import Launcher
from ..launchers.local import LocalLauncher
from ..profiling.received import ProfileInbox
from ..run import metrics_log
from ..run.background import BackgroundFailures
from ..run.hooks import Hooks
from ..run.metrics_log import MetricsLog
from ..run.rundir import RunDirectory
from ..run.startup import StartUp
from ..setup.config import TrainConfig
from ..state.best import BestCheckpoints, epoch_logs
from ..state.checkpoint import CheckpointInfo
from ..state.durable import DurableSnapshot
from ..state.frozen import FrozenBase
from ..state.layouts import layout_for
from ..state.writer import CheckpointBook
from ..step.plan import Plan, Schedule
from ..transport import protocol as p
from ..transport.control import ControlServer
from ..transport.network import DEFAULT_BIND_ADDRESS, advertised_address
from ..transport.store.server import StoreService
from .book import StateBook
from .commands import AbortGeneration, Command, Formed, Kill, Limits, RollBack, Send, Settle, Start
from .ending import Ending, FinalState
from .heap import long_lived_frozen
from .ledger import Progress
from .membership import Membership
from .preemption import Preempted, SignalWatch
from .reattach import Reattach, where
from .replicas import ReplicaChecks, ReplicaDivergenceError

log = logging.getLogger(__name__)

#: Most messages handled before the periodic checks run again.
MAX_DRAIN = 10_000
#: Periodic checks (exited processes, heartbeats, deadlines) run at most this often (seconds):
#: after every message they cost the driver ~50 us a step, on the cores the workers share.
TICK_INTERVAL = 0.02
#: Messages that can complete a generation change: the checks run at once after them, since the
#: survivors wait for it (waiting for the next tick cost up to the 0.2 s receive timeout).
MEMBERSHIP_MESSAGES = (p.LeftGeneration, p.Ready, p.WorkerFailed, p.ConnectionLost)
#: How long an ended process's connection may stay open (a child holding the socket, a host
#: gone without a FIN) before the exit is acted on without reading what it sent last (seconds).
EXIT_DRAIN = 1.0
#: Makes the launcher of a job from the control plane's address and the job's secret.
LauncherFactory = Callable[[tuple[str, int], bytes], Launcher]
#: Makes the control server from the job's secret and the port to bind (0: any free one).
ServerFactory = Callable[[bytes, int], ControlServer]
#: Makes the rendezvous store that the control server serves.
StoreFactory = Callable[[], StoreService]


@dataclasses.dataclass(frozen=True)
class DriverSetup:
    """Everything ``train()`` decided that the driver needs.

    Attributes:
        payload: the cloudpickled :class:`~fabric_model.setup.job.Job`.
        config, plan: the run's configuration and plan.
        has_test: whether there is a test dataset (validation slots do work).
        stat_names: "loss" and the metrics, in the order of the step's stat sums.
        devices: one per local slot; ``len(devices)`` is the most workers at once.
        threads: intra-op threads per CPU worker.
        framework: the framework's name, recorded in checkpoints.
        keep_checkpoints: how many of the newest checkpoints to keep.
        resume: the checkpoint a resumed run continues from.
        bind_address: where the control plane and the store listen (checked by
            :func:`fabric_model.transport.network.resolve_bind_address`).
        max_workers: the most workers at once, hand-started ones included (engines_number);
            None: one per local slot.
        keep_best: which older checkpoints to keep by a monitored metric (a ``BestCheckpoints`` in ``user_callback``).
        data: what ``run.json`` records of sharded data (streams/datasets.CallerData.record), or None.
        threads_fixed: every worker takes ``threads``, hand-started ones too (``deterministic=True``).
        ray_actor: what each worker's Ray actor asks for ("1 CPU"); empty where workers are local processes.
        frozen: the job's frozen parameters, which uploads leave out and the driver fills in.
        startup: the start-up's phases so far (``train()``'s); the driver marks the rest and writes them.
        rejoin: the address and secret in the ``join.json`` of a driver of this run that vanished:
            its workers may wait there to be taken back (docs/elasticity.md, "A lost driver").
        identity: what identifies the job (driver/identity.py), which the workers keep.
    """

    payload: bytes
    config: TrainConfig
    plan: Plan
    has_test: bool
    stat_names: list[str]
    devices: list[str | None]
    threads: int
    framework: str
    keep_checkpoints: int
    resume: CheckpointInfo | None = None
    bind_address: str = DEFAULT_BIND_ADDRESS
    max_workers: int | None = None
    keep_best: BestCheckpoints | None = None
    data: dict[str, Any] | None = None
    threads_fixed: bool = False
    ray_actor: str = ""
    frozen: FrozenBase = dataclasses.field(default_factory=lambda: FrozenBase({}, []))
    startup: StartUp = dataclasses.field(default_factory=StartUp)
    rejoin: tuple[tuple[str, int], bytes] | None = None
    identity: dict[str, str] = dataclasses.field(default_factory=dict)


class Driver:
    """Runs one training job and returns the final state.

    Args:
        setup: what ``train()`` decided.
        run_dir: the run directory (a :class:`~fabric_model.run.rundir.RunDirectory`).
        hooks: the driver's hooks (the user's logger, or the progress display).
        launcher_factory: where worker processes run; local processes by default.
        server_factory: the control server; by default one at ``setup.bind_address`` that
            serves the store and takes its worker ids from membership.
        store_factory: the rendezvous store; a :class:`StoreService` by default.
        watch: catches the preemption signals from ``start()`` to ``finish()``; by default one
            of the job's settings. A test sets on it what a caught signal sets, then ``preempt()``.
        stop_request: set from any thread when the caller wants training to end now
            (``FabricModel.stop_training()``); :meth:`iterate` acts on it once (:meth:`stop_on_request`).
    """

    def __init__(
        self,
        setup: DriverSetup,
        run_dir: RunDirectory,
        hooks: Hooks,
        launcher_factory: LauncherFactory | None = None,
        *,
        server_factory: ServerFactory | None = None,
        store_factory: StoreFactory | None = None,
        watch: SignalWatch | None = None,
        stop_request: threading.Event | None = None,
    ) -> None:
        self.setup, self.run_dir, self.hooks = setup, run_dir, hooks
        config, timeouts = setup.config, setup.config.timeouts
        self.schedule = Schedule(setup.plan, config.epochs, config.validation_freq, setup.has_test)
        history, epoch_so_far = None, []
        if setup.resume is not None:  # the earlier attempts' record, before appending to it
            history = MetricsLog.replay(run_dir.metrics, self.schedule, setup.resume.unit)
            epoch_so_far = metrics_log.epoch_so_far(run_dir.metrics, self.schedule, setup.resume.unit)
        self.metrics = MetricsLog(run_dir.metrics, append=setup.resume is not None or setup.rejoin is not None)
        self.progress = Progress(setup.plan, self.schedule, setup.stat_names, self.metrics, hooks)
        self.failures = BackgroundFailures(run_dir)  # a writer thread's failure: one warning line, and run.json
        self.checkpoints = CheckpointBook(
            run_dir.checkpoints,
            setup.framework,
            setup.keep_checkpoints,
            self.schedule.units_per_epoch,
            self.metrics,
            wrap_stream=hooks.wrap_checkpoint_stream,  # the driver writes the files (testing seam)
            best=setup.keep_best,
            epoch_logs=lambda e: epoch_logs(self.progress.train_history, self.progress.test_history, e),
            on_written=self._checkpoint_written,
            failures=self.failures,
        )
        # Checkpoints and snapshots that rank 0 uploads (docs/architecture.md, "Elasticity").
        # The newest committed snapshot on disk too: a whole-job loss costs at most the snapshot interval.
        self.durable = DurableSnapshot(run_dir.checkpoints, self.failures)
        self.states = StateBook(self.checkpoints, self.progress.committed, setup.frozen, self.durable)
        limits = Limits(
            max_workers=max(len(setup.devices), setup.max_workers or 0),
            total_units=self.schedule.total_units,
            heartbeat=timeouts.heartbeat,
            recovery=timeouts.recovery,
            start=timeouts.start,
            replace_workers=timeouts.replace_workers,
            local_slots=len(setup.devices),
        )
        self.membership = Membership(limits, self.states, self._log_tails, self.progress.committed)
        # Replica checks (docs/architecture.md, "Replica checks"): once they differ, training halts.
        self.replicas = ReplicaChecks(lambda generation, unit: f"{self._position(unit)} (generation {generation})")
        # Rank 0's profile, with train(profile=...) (docs/training.md, "Profiling").
        self.profiles = ProfileInbox(run_dir.profile, _shown_path(run_dir.profile))
        if setup.resume is not None and history is not None:
            self.progress.start_at(setup.resume.unit, *history)
            self.progress.resume_epoch(epoch_so_far)  # resumed inside an epoch: its average so far
        self._launcher_factory = launcher_factory or self._local_launcher
        self._server_factory = server_factory or self._control_server
        self._store_factory = store_factory or StoreService
        preemption = config.preemption
        self._watch = watch or SignalWatch(preemption.signals, preemption.grace)
        self._stop_request = stop_request or threading.Event()
        self._first_iteration = self.progress.iteration  # (a resumed run's history starts later)
        self._hosts: dict[int, str] = {}  # worker id -> where it runs (its Hello, or the launcher's word)
        self.reattach = Reattach(
            setup=setup,
            metrics=run_dir.metrics,
            schedule=self.schedule,
            membership=self.membership,
            progress=self.progress,
            states=self.states,
            hosts=self._hosts,
            make_server=self._server_factory,
            moved_on=self._moved_on,
            position=lambda unit: self._position(unit, screen=True),
        )
        # Ending before the end: replicas diverged, preempted, stop_training() (driver/ending.py).
        self.ending = Ending(
            setup=setup,
            whole_on_each_member=layout_for(config).whole_on_each_member,  # the state layout's: state/layouts.py
            schedule=self.schedule,
            membership=self.membership,
            progress=self.progress,
            states=self.states,
            checkpoints=self.checkpoints,
            watch=self._watch,
            send=lambda worker_id, message: self._server.send(worker_id, message),
            execute=self._execute,
            ended=lambda worker_id, now: worker_id in self._launcher.exited() and self._drained(worker_id, now),
            moved_on=self._moved_on,
            position=self._position,
            clock=lambda: time.monotonic(),  # read when called: a test replaces the module's time
        )
        self._rejoining = False  # listening where a vanished driver's workers wait (listen())
        self._final: FinalState | None = None
        self._closed = False  # the run's ending is done (_close)
        self._ticked = 0.0  # when tick() last ran
        self._exits: dict[int, float] = {}  # ended processes whose last messages are awaited: since when
        self._handlers: dict[type, Callable[[int, Any], None]] = {
            p.Hello: self._on_hello,
            p.Ready: self._on_ready,
            p.Entered: self._on_entered,
            p.Heartbeat: lambda w, m: None,
            p.StepDone: self._on_step,
            p.Fingerprint: self._on_fingerprint,
            p.EvalDone: lambda w, m: self.progress.eval_done(m, len(self.membership.members)),
            p.StateChunk: self._on_state_chunk,
            p.ProfilePart: self.profiles.part,
            p.LeftGeneration: self._on_left,
            p.Finished: self._on_finished,
            p.FinalState: self._on_final,
            p.WorkerFailed: self._on_failed,
            p.ConnectionLost: self._on_connection_lost,
        }

    @property
    def train_history(self) -> list[dict[str, float]]:
        return self.progress.train_history

    @property
    def test_history(self) -> list[dict[str, float]]:
        return self.progress.test_history

    @property
    def replica_digests(self) -> dict[int, str]:
        return self.progress.replica_digests

    @property
    def final(self) -> FinalState | None:
        """The state the run ends with, once it has one (the loop ends); None before."""
        return self._final

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> FinalState:
        """Run the job to its end: :meth:`start`, :meth:`iterate` until there is a :attr:`final`
        state, :meth:`finish`; returns the final state."""
        with long_lived_frozen():  # what exists now outlives the run: no full GC pass reads it (heap.py)
            self.start()
            with self._ending_on_failure():  # a Ctrl-C between two turns of the loop too
                while self._final is None:
                    self.iterate()
            return self.finish()

    def start(self) -> None:
        """Everything before the event loop: :meth:`listen`, the preemption signals caught, the
        workers of a vanished driver taken back or the first workers started. A failure once
        listening ends the run (as :meth:`finish` does after one) and is raised."""
        self.listen()
        with self._ending_on_failure():
            self._watch.__enter__()  # the preemption signals are caught from here (docs/architecture.md, "Preemption")
            self._begin()

    def listen(self) -> None:
        """The control plane up: the store, the control server (where a vanished driver's workers
        wait, when they may), the launcher, and ``join.json`` for workers started by hand."""
        # One chosen address for everything that listens (docs/architecture.md, "Processes"):
        # the rendezvous store is served on the control plane's port; workers are told a
        # routable address when the bind address is a wildcard.
        self._store = self._store_factory()
        rejoin = self.setup.rejoin if self.setup.config.timeouts.driver_wait > 0 else None
        self._server, self._rejoining = self.reattach.listen(rejoin)
        self.membership.heard = self._server.heard  # heartbeats end at the server (transport/control.py)
        secret = self._server.secret
        address = (advertised_address(self.setup.bind_address), self._server.address[1])
        self._launcher = self._launcher_factory(address, secret)
        self.run_dir.write_join_info(address, secret)

    def _begin(self) -> None:
        """The workers of a vanished driver taken back (or, for a changed job, their state), else
        the first generation asked for."""
        held = self.reattach.take_back() if self._rejoining else {}
        self.checkpoints.prepare(self.setup.resume, self.progress.iteration, record=not held)
        self.durable.remove()  # an earlier run's, or one older than the state resumed from
        handed: p.FinalState | None = None
        if held and (changed := self.reattach.changed_parts(held)):  # they must not go on with the old code
            handed = self.reattach.replace_changed(held, changed)
            held = {}
            if handed is None and self.setup.resume is not None:  # a resume from disk after all
                self.checkpoints.say_resumed(self.setup.resume, self.progress.iteration)
        self.setup.startup.mark("run directory and driver")
        if held:  # the loggers hear of training before the steps recorded from what the workers kept
            self.hooks.on_train_begin()
            self._execute(self.reattach.rejoined(held))
            return
        if handed is not None:  # the new job's workers load the state the old ones handed over
            self.reattach.adopt(handed)
        self._execute(self.membership.start(time.monotonic()))
        self.hooks.on_train_begin()

    def iterate(self) -> None:
        """One turn of the event loop: the messages that arrived handled, then the periodic checks;
        a preemption signal caught is acted on. A failure ends the run and is raised."""
        with self._ending_on_failure():
            self._next_event()
            if self._watch.signal_name is not None and not self.ending.halted:
                self.preempt()
            elif self._stop_request.is_set() and self._stop_acts():
                self.stop_on_request()

    def finish(self) -> FinalState:
        """Everything after the loop: a preempted run's state written (``Preempted`` raised), else
        the last checkpoint written, the replicas checked and the workers stopped; whatever
        happens, the run is then closed. Returns the final state."""
        stop = self.setup.config.timeouts.stop
        try:
            assert self._final is not None, "finish() once the run has its final state"
            if self.ending.preempted:
                stop = max(0.5, min(stop, self._watch.deadline - time.monotonic()))  # what the grace leaves
                self.ending.save_preempted(self._final)  # raises Preempted
            self._end_training()
        except BaseException as exc:
            self._tell_hand_started(exc)
            raise
        finally:
            self._close(stop)
        assert self._final is not None
        return self._final

    def _end_training(self) -> None:
        """Training ended with a final state: the last checkpoint on disk, the replicas checked,
        every worker told to stop."""
        config = self.setup.config
        timeouts = config.timeouts
        self.checkpoints.close(timeouts.stop)  # the last checkpoint is on disk when train() returns
        assert self._final is not None
        final = self._final
        if final.divergence is None:
            final = self._final = self._check_finished_replicas(final)
        steps = self.progress.iteration  # from the run's start (a resumed run's history starts later)
        if self.ending.requested:
            log.info("training stopped by stop_training() after step %d", steps)
            self.hooks.note(f"training stopped by stop_training() after step {steps}")
        elif final.divergence is None and steps < config.epochs * self.schedule.plan.steps_per_epoch:
            # every replica skipped to the end alike
            epochs = steps // self.schedule.plan.steps_per_epoch
            log.info("training stopped by a callback after epoch %d", epochs)
            self.hooks.note(f"training stopped by a callback after epoch {epochs}")
        for worker_id in self.membership.alive():
            self._server.send(worker_id, p.Stop())
        self._launcher.wait_all(timeouts.stop)
        if final.divergence is None:  # else train() hands the state back, then raises
            self.durable.close(timeouts.stop)
            self.durable.remove()  # finished: the checkpoints and the model hold the result
            self.hooks.on_train_end()

    @contextlib.contextmanager
    def _ending_on_failure(self) -> Iterator[None]:
        """A failure ends the run as one in :meth:`finish` does (workers started by hand told,
        everything closed), once, then is raised."""
        try:
            yield
        except BaseException as exc:
            if not self._closed:
                self._tell_hand_started(exc)
                self._close(self.setup.config.timeouts.stop)
            raise

    def _close(self, stop: float) -> None:
        """However the run ended: the last writes waited for (``stop`` seconds each), every worker
        stopped, the listener and the log closed, ``join.json`` removed, the signals given back."""
        if self._closed:
            return
        self._closed = True
        self.checkpoints.close(stop)  # a failed job's last write may serve its resume
        self.durable.close(stop)
        self.failures.record()
        self._launcher.stop_all(stop)
        self._server.close()
        self.metrics.close()
        self.run_dir.remove_join_info()
        self._watch.__exit__()  # a signal caught but not acted on (training had ended) is raised again

    def _control_server(self, secret: bytes, port: int) -> ControlServer:
        """The control server at the bind address, serving the store; membership allocates its ids."""
        return ControlServer(
            secret, host=self.setup.bind_address, port=port, allocate_id=self.membership.allocate_id, store=self._store
        )

    def _checkpoint_written(self, unit: int, epoch: int, name: str) -> None:
        """The checkpoint of ``unit`` is on disk: the display and the loggers hear of it
        (``on_checkpoint(epoch, name)`` for one at an epoch's end only, ``on_step_checkpoint``
        for every one, with the steps done before it), and the members that may keep a copy of it
        (rank 0 when it uploaded) drop that copy (state/uploader.py)."""
        if self.checkpoints.at_epoch_end(unit):
            self.hooks.on_checkpoint(epoch, name)
        self.hooks.on_step_checkpoint(self.schedule.steps_before(unit), name)
        if unit in self.checkpoints.by_unit:  # (not pruned at once: a newer one was written first)
            self._server.send_all(self.membership.alive(), p.Written(unit))

    def _tell_hand_started(self, exc: BaseException) -> None:
        """Workers started by hand learn how the job ended, rather than find the connection
        closed (exit 3, "lost the connection"): a Slurm allocation's tasks end with code 0."""
        how = "preempted" if isinstance(exc, Preempted) else "failed"
        if isinstance(exc, KeyboardInterrupt):
            how = "interrupted"
        for worker_id in self.membership.alive():
            # Workers taken back from a vanished driver are not this driver's processes to kill either.
            if self.membership.workers[worker_id].slot is None or worker_id in self.reattach.taken_back:
                self._server.send(worker_id, p.Stop(ended=how))

    def _local_launcher(self, address: tuple[str, int], secret: bytes) -> Launcher:
        return LocalLauncher(address, secret, self.run_dir.worker_log, self.setup.threads)

    def _next_event(self) -> None:
        """Handle every message that has arrived, then tick. Draining first matters: after the
        loop was held up (a slow launcher call), silence is judged only once every heartbeat
        that came meanwhile has been read."""
        urgent = False
        try:
            worker_id, message = self._server.events.get(timeout=0.2)
        except queue.Empty:
            pass
        else:
            self.handle(worker_id, message)
            urgent = isinstance(message, MEMBERSHIP_MESSAGES)
            for _ in range(MAX_DRAIN):
                if self._final is not None:
                    break  # the run is over: what follows is the workers' goodbye
                try:
                    worker_id, message = self._server.events.get_nowait()
                except queue.Empty:
                    break
                self.handle(worker_id, message)
                urgent = urgent or isinstance(message, MEMBERSHIP_MESSAGES)
        now = time.monotonic()
        if now - self._ticked >= TICK_INTERVAL:
            self._ticked = now
            self.tick()
        elif urgent:  # a change may be complete: checked now, but not every worker's silence again
            self.tick(heartbeats=False)

    def handle(self, worker_id: int, message: Any) -> None:
        """Route one message from ``worker_id``."""
        alive = self.membership.seen(worker_id, time.monotonic())
        # A leaving rank 0's upload (docs/architecture.md, "Preemption") counts while halted too.
        if self.ending.halted and not isinstance(message, (p.StepDone, p.EvalDone, p.StateChunk)):
            self._ended_with(self.ending.handle(worker_id, message))  # only the state asked for matters
            return
        # A gone worker's error still counts: its exit may have been noticed before its report.
        if alive or isinstance(message, (p.WorkerFailed, p.ConnectionLost)):
            self._handlers[type(message)](worker_id, message)

    def tick(self, heartbeats: bool = True) -> None:
        """Periodic checks: ended processes, then membership's own (heartbeats, deadlines...);
        ``heartbeats`` False leaves out the check of every worker's silence (membership.tick)."""
        now = time.monotonic()
        self.failures.record()  # on this thread: run.json's other writers run here
        if self.ending.halted:
            if self._final is None:  # the grace spent, or the member asked overdue or ended
                self._ended_with(self.ending.tick(now))
            self.checkpoints.poll()
            return
        self.membership.placement(self._launcher.pending(), now)
        for worker_id, code in self._launcher.exited().items():
            if self._drained(worker_id, now):
                self._execute(self.membership.process_exited(worker_id, code, now))
        self._execute(self.membership.tick(now, heartbeats))
        self.checkpoints.poll()

    def _drained(self, worker_id: int, now: float) -> bool:
        """Whether an ended process's exit can be acted on: everything it sent has been handled.

        What a worker sent just before it died still counts (its committed steps, a checkpoint's
        last chunk): acting on the exit first would drop them and roll back further than the
        steps that completed (docs/architecture.md, "Elasticity"). Its connection's end, queued
        after them, acts on the exit instead (:meth:`_on_connection_lost`)."""
        state = self._server.connection(worker_id)
        if state == "none":
            return True  # never connected: nothing to read
        if state == "ended":
            return False  # its ConnectionLost is queued behind its last messages
        since = self._exits.setdefault(worker_id, now)
        return now - since >= EXIT_DRAIN

    # -- handlers ---------------------------------------------------------------------------
    def _on_ready(self, worker_id: int, message: p.Ready) -> None:
        if not self.setup.startup.marked("worker set-up"):
            self.setup.startup.mark("worker set-up")
            self.setup.startup.worker("worker set-up", dict(message.phases))
        self._execute(self.membership.ready(worker_id, message.attempt, time.monotonic()))

    def _on_entered(self, worker_id: int, message: p.Entered) -> None:
        startup = self.setup.startup
        if startup.marked("waiting for the first generation") and not startup.marked("entering it"):
            startup.mark("entering it")
            startup.worker("entering it", dict(message.phases))

    def _on_hello(self, worker_id: int, message: p.Hello) -> None:
        if message.held is not None:  # a worker of the vanished driver, after the driver went on
            self._execute(self.reattach.late_back(worker_id, message.held))
            return
        self.setup.startup.mark("process start")
        self._hosts[worker_id] = self._launcher.host(worker_id) or where(self._server.peer(worker_id), message.host)
        slot = self.membership.slot_of(worker_id)
        device = self.setup.devices[slot] if slot is not None else None
        setup = self.setup
        spec = p.JobSpec(
            setup.payload, setup.config, setup.plan, device, setup.threads, setup.threads_fixed, setup.identity
        )
        self._server.send(worker_id, spec)

    def _on_step(self, worker_id: int, message: p.StepDone) -> None:
        if message.generation != self.membership.generation:
            return  # older generations' reports were settled when they ended
        if self.progress.step_done(message) is not None:
            self._moved_on()

    def _on_left(self, worker_id: int, message: p.LeftGeneration) -> None:
        if message.last is not None and message.last.generation == self.membership.generation:
            self.progress.copy(message.last)  # its copy of its last step's report: rank 0 may not have sent it
        self._execute(self.membership.left(worker_id, message, time.monotonic()))

    def _on_state_chunk(self, worker_id: int, message: p.StateChunk) -> None:
        # Fenced: only rank 0 of the current generation may upload (driver/book.py).
        self.states.chunk(worker_id, message, self.membership.generation, self.membership.members)

    def _on_finished(self, worker_id: int, message: p.Finished) -> None:
        self.membership.finished(worker_id, message.next_unit, message.saved)
        self.progress.finished(worker_id, message)

    def _on_final(self, worker_id: int, message: p.FinalState) -> None:
        model_state = self.setup.frozen.complete(message.model_state, message.omitted)  # the job's frozen part
        self._final = FinalState(model_state, message.optimizer_state, worker_id, message.unit)

    # -- replica checks (docs/architecture.md, "Replica checks") ---------------------------
    def _on_fingerprint(self, worker_id: int, message: p.Fingerprint) -> None:
        if message.generation != self.membership.generation:
            return  # a generation already left: its members were re-formed
        divergence = self.replicas.add(worker_id, message)
        if divergence is not None:
            self._ended_with(self.ending.diverged(divergence))

    # -- ending before the end: driver/ending.py ----------------------------------------------
    def stop_on_request(self) -> None:
        """Act on ``stop_request`` (:meth:`iterate` does, once): training stops as a halt does and
        the run ends normally (:meth:`Ending.stop_on_request <fabric_model.driver.ending.Ending.stop_on_request>`)."""
        self._ended_with(self.ending.stop_on_request())

    def preempt(self) -> None:
        """Act on the preemption signal the watch caught (:meth:`iterate` does, once): training stops
        as a halt does (:meth:`Ending.preempt <fabric_model.driver.ending.Ending.preempt>`)."""
        self._ended_with(self.ending.preempt())

    def _stop_acts(self) -> bool:
        """Whether a requested stop is acted on now: once, while training, and once a step was
        committed since this driver started (a worker still entering its first generation has no
        state to hand back: the request waits for the members to be training)."""
        return not self.ending.halted and self._final is None and self.progress.iteration > self._first_iteration

    def _ended_with(self, final: FinalState | None) -> None:
        """The ending's final state, once it has one, is the run's."""
        if final is not None:
            self._final = final

    def _check_finished_replicas(self, final: FinalState) -> FinalState:
        """Invariant 4 at the end: replicas that differ hand back the state asked for (rank 0's)."""
        try:
            self.progress.check_replicas(final.worker)
        except ReplicaDivergenceError as exc:
            log.error("%s", exc)
            divergence = exc.divergence
            if divergence is None:  # pragma: no cover - the ledger always says what differs
                raise
            return dataclasses.replace(final, divergence=divergence, source=f"worker {final.worker}'s final state")
        return final

    def _position(self, unit: int, screen: bool = False) -> str:
        """Where ``unit`` is, for a person: the last unit done below it; ``screen``: counted as the
        screen counts, epochs and steps from 1 (else as the records count, from 0)."""
        if unit <= 0:
            return "at the start"
        if unit >= self.schedule.total_units:
            return "at the end"
        epoch, step = self.schedule.locate(unit - 1)
        if screen:
            done = f"step {step + 1}/{self.setup.plan.steps_per_epoch}" if step is not None else "its validation"
            return f"at epoch {epoch + 1}, {done}"
        return f"after epoch {epoch}, step {step}" if step is not None else f"after epoch {epoch}'s validation"

    def _on_failed(self, worker_id: int, message: p.WorkerFailed) -> None:
        exc = rebuild_exception(message.exception, message.traceback, f"worker {worker_id}")
        if message.collective:  # not the user's code: a lost peer, a timeout, Ctrl-C
            self._lose(worker_id, f"error: {str(exc)[:200]}")
            return
        lines = message.traceback.strip().splitlines()
        signature = lines[-1] if lines else repr(exc)
        self._execute(self.membership.user_error(worker_id, exc, signature, time.monotonic(), message.unit))

    def _on_connection_lost(self, worker_id: int, message: p.ConnectionLost) -> None:
        self._exits.pop(worker_id, None)
        code = self._launcher.exited().get(worker_id)
        if code is not None:  # the process's exit says more than its connection's end
            self._execute(self.membership.process_exited(worker_id, code, time.monotonic()))
        else:
            self._lose(worker_id, f"connection lost ({message.reason})")

    def _lose(self, worker_id: int, reason: str) -> None:
        self._execute(self.membership.lost(worker_id, reason, time.monotonic()))

    # -- commands ---------------------------------------------------------------------------
    def _execute(self, commands: list[Command]) -> None:
        for command in commands:
            if isinstance(command, Send):
                self._server.send(command.worker_id, command.message)
            elif isinstance(command, AbortGeneration):
                self._store.abort(command.generation)  # ranks still forming its group fail now
                self._server.send_all(command.members, p.Abort(command.generation))
            elif isinstance(command, Kill):
                self._server.fence(command.worker_id, command.reason)  # a worker we cannot kill learns why
                self._launcher.kill(command.worker_id)
            elif isinstance(command, Start):
                self._launcher.start(command.worker_id, self.setup.devices[command.slot])
            elif isinstance(command, Settle):  # commits steps below resume_unit only (see RollBack)
                if self.progress.settle(command.resume_unit, command.upto_generation) is not None:
                    self._moved_on()
            elif isinstance(command, RollBack):  # no holder was left: redo the steps from command.unit
                self.progress.roll_back(command.unit)
                self.states.rolled_back(command.unit)
            elif isinstance(command, Formed):  # before the members are told: the store must admit them
                self._store.admit(command.generation, command.members)
                self._record_generation(command)
                self.setup.startup.mark("waiting for the first generation")

    def _moved_on(self) -> None:
        """The one commit path: the ledger committed steps (its ``CommittedUnit``, shared with
        membership and the state book, moved); they act on it."""
        if not self.setup.startup.recorded:  # the first commit ends start-up (run/startup.py)
            self.setup.startup.mark("first step")
            self.setup.startup.record(self.run_dir.run_json)
        unit = self.progress.committed_unit
        self.membership.committed(unit)  # resets the backoff of slots that train steadily
        self.states.committed(unit)  # drops held states no longer needed

    def _record_generation(self, formed: Formed) -> None:
        # Hosts by address, so workers on hosts of one name (containers, namespaces) are told apart.
        hosts = [self._hosts.get(w, "?") for w in formed.members]
        self.metrics.generation(
            generation=formed.generation,
            members=list(formed.members),
            reason=formed.reason,
            resume_unit=formed.resume_unit,
            source_rank=formed.source_rank,
            checkpoint=formed.checkpoint,
            restored=formed.restored,
            rolled_back_from=formed.rolled_back_from,
            hosts=hosts,
        )
        record = {"generation": formed.generation, "members": list(formed.members), "reason": formed.reason}
        if formed.subjects and len(set(self._hosts.values())) > 1:  # a run on several hosts: the screen says which
            record["hosts"] = {w: self._hosts.get(w, "?") for w in formed.subjects}
        self.hooks.on_generation({**record, "resume_unit": formed.resume_unit, "iteration": self.progress.iteration})
        log.log(
            logging.INFO if formed.reason == "start" else logging.WARNING,
            "generation %d: %d worker(s) %s on %s, resuming at unit %d (%s)",
            formed.generation,
            len(formed.members),
            list(formed.members),
            ", ".join(f"{h} ({n})" for h, n in collections.Counter(hosts).items()),
            formed.resume_unit,
            formed.reason,
        )

    def _log_tails(self, worker_ids: list[int]) -> str:
        return "\n".join(f"--- worker {w} ---\n{self._launcher.log_tail(w)}" for w in worker_ids)


def _shown_path(path: Any) -> str:
    """``path`` as the screen names it (relative to the working directory where it lies inside)."""
    from .display import _shown

    return str(_shown(path))
