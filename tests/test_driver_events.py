"""The driver's event loop (``driver/driver.py``) in-process: ``Driver.handle`` and ``Driver.tick``
with autospec fakes of the control server, the rendezvous store and the launcher (made by the
driver's factories, set up by ``Driver.listen``), and a clock.

What a user relies on (docs/architecture.md, "Elasticity"): workers' messages reach membership
and the ledger (a generation forms when every worker is ready, the store admitting its members
before they are told; step reports commit); and what a worker sent just before it died still
counts: its exit is acted on only once its connection's end was read, queued behind its last
messages, or ``EXIT_DRAIN`` after the exit when the connection stays open.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from fabric_model.driver import driver as driver_module
from fabric_model.driver.driver import EXIT_DRAIN, Driver, DriverSetup
from fabric_model.driver.membership import WorkerState
from fabric_model.driver.preemption import SignalWatch
from fabric_model.errors import encode_exception
from fabric_model.launchers.base import Launcher
from fabric_model.run.hooks import Hooks
from fabric_model.run.metrics_log import read_records
from fabric_model.run.rundir import RunDirectory
from fabric_model.setup.config import EngineSizing, SnapshotCadence, Timeouts, TrainConfig
from fabric_model.state import wire
from fabric_model.state.checkpoint import state_record
from fabric_model.step.plan import Plan
from fabric_model.transport import protocol as p
from fabric_model.transport.control import ControlServer
from fabric_model.transport.store.server import StoreService

PLAN = Plan(num_samples=32, items_per_micro_batch=4, micro_batches=2, seed=0)  # 4 steps of 2 micro-batches an epoch
HEARTBEAT = 30.0


class Clock:
    """The driver's ``time``: it reads ``time.monotonic()`` only."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class Recorder:
    """A driver logger: the generations formed and the steps committed."""

    def __init__(self) -> None:
        self.generations: list[dict[str, Any]] = []
        self.steps: list[int] = []

    def on_generation(self, record: dict[str, Any]) -> None:
        self.generations.append(record)

    def record_step(self, metrics: dict[str, float], iteration: int, epoch: int, workers: int) -> None:
        self.steps.append(iteration)


class Harness:
    """A driver of two local workers (ids 0 and 1) over fakes, its clock, its logger and its
    preemption watch (a test sets on it what a caught signal sets)."""

    def __init__(self, directory: Path, clock: Clock) -> None:
        self.clock = clock
        timeouts = Timeouts(
            start=60,
            collective=60,
            stop=5,
            heartbeat=HEARTBEAT,
            pull=60,
            recovery=60,
            pull_failed_limit=3,
            replace_workers=True,
        )
        config = TrainConfig(
            epochs=2,
            batch_size=PLAN.items_per_micro_batch,
            sizing=EngineSizing(PLAN.micro_batches, 2, PLAN.global_batch),
            num_dataloader_threads=None,
            validation_freq=1,
            checkpoint_freq=0,
            timeouts=timeouts,
            snapshots=SnapshotCadence(),
            backend="gloo",
        )
        setup = DriverSetup(
            payload=b"the job",
            config=config,
            plan=PLAN,
            has_test=True,
            stat_names=["loss"],
            devices=[None, None],
            threads=1,
            framework="torch",
            keep_checkpoints=3,
        )
        self.run_dir = RunDirectory(directory / "run").create()
        self.server = mock.create_autospec(ControlServer, instance=True)
        self.server.events = queue.Queue()
        self.server.send.return_value = True
        self.server.connection.return_value = "open"
        self.server.peer.return_value = "127.0.0.1"  # local workers: named by their hostname
        self.server.heard = {}
        self.server.secret, self.server.address = b"the secret", ("127.0.0.1", 7000)
        self.store = mock.create_autospec(StoreService, instance=True)
        self.launcher = mock.create_autospec(Launcher, instance=True)
        self.launcher.exited.return_value = {}
        self.launcher.pending.return_value = frozenset()
        self.launcher.host.return_value = None
        self.launcher.log_tail.return_value = ""
        self.recorder = Recorder()
        self.watch = SignalWatch(("SIGTERM",), 20.0)
        self.driver = Driver(
            setup,
            self.run_dir,
            Hooks([self.recorder]),
            launcher_factory=lambda address, secret: self.launcher,
            server_factory=lambda secret, port: self.server,
            store_factory=lambda: self.store,
            watch=self.watch,
        )
        self.driver.listen()  # the fakes, as the driver's start() takes them; no worker is started

    def start(self) -> None:
        """The launcher started workers 0 and 1; both connect and set up; generation 0 forms."""
        self.driver.membership.start(self.clock.now)
        for worker in (0, 1):
            self.driver.handle(worker, p.Hello(worker, 100 + worker, "here"))
        for worker in (0, 1):
            self.driver.handle(worker, p.Ready())

    def report(self, worker: int, step: int, generation: int = 0, world: int = 2, epoch: int = 0) -> p.StepDone:
        """Worker ``worker``'s copy of a step's report (its rank: its place in generation 0)."""
        rank = 0 if world == 1 else worker
        mbs = tuple(range(rank, PLAN.micro_batches, world))
        return p.StepDone(generation, epoch, step, rank, world, mbs, (0.5 * 8, 8.0), PLAN.micro_batches)

    def step(self, worker: int, step: int, generation: int = 0, world: int = 2, epoch: int = 0) -> None:
        """Worker ``worker`` sends its report of a step (rank 0 does, for its generation)."""
        self.driver.handle(worker, self.report(worker, step, generation, world, epoch))

    def sent(self, kind: type) -> list[tuple[int, Any]]:
        """Every ``kind`` message sent, to one worker or to many at once, as (worker, message)."""
        one = [(c.args[0], c.args[1]) for c in self.server.send.call_args_list]
        many = [(w, c.args[1]) for c in self.server.send_all.call_args_list for w in c.args[0]]
        return [(w, m) for w, m in one + many if isinstance(m, kind)]

    def acted_on_the_exit_of(self, worker: int) -> bool:
        """Worker ``worker`` was removed: fenced, killed, and its generation's collectives aborted."""
        removed = self.driver.membership.state(worker) is WorkerState.GONE
        killed = mock.call(worker) in self.launcher.kill.call_args_list
        fenced = any(c.args[0] == worker for c in self.server.fence.call_args_list)
        told = any(w != worker and m == p.Abort(0) for w, m in self.sent(p.Abort))
        aborted = told and mock.call(0) in self.store.abort.call_args_list
        assert removed == killed == fenced == aborted, (removed, killed, fenced, aborted)
        return removed


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(driver_module, "time", clock)
    return clock


@pytest.fixture
def harness(tmp_path: Path, clock: Clock) -> Iterator[Harness]:
    harness = Harness(tmp_path, clock)
    yield harness
    harness.driver.metrics.close()


def test_each_worker_gets_the_job_and_the_generation_forms_once_all_are_ready(harness: Harness):
    order = mock.Mock()
    order.attach_mock(harness.store.admit, "admit")
    order.attach_mock(harness.server.send, "send")
    harness.start()

    specs = harness.sent(p.JobSpec)
    assert [w for w, _ in specs] == [0, 1]
    assert all((s.payload, s.plan, s.device, s.threads) == (b"the job", PLAN, None, 1) for _, s in specs)
    entered = harness.sent(p.EnterGeneration)
    assert [(w, e.generation, e.rank, e.world_size, e.resume_unit) for w, e in entered] == [
        (0, 0, 0, 2, 0),
        (1, 0, 1, 2, 0),
    ]
    # The store admits the members before they are told to form the group (else they are refused).
    names = [c[0] for c in order.mock_calls if c[0] == "admit" or isinstance(c.args[1], p.EnterGeneration)]
    assert names == ["admit", "send", "send"]
    harness.store.admit.assert_called_once_with(0, (0, 1))
    assert [(g["generation"], g["members"], g["reason"]) for g in harness.recorder.generations] == [
        (0, [0, 1], "start")
    ]
    (record,) = [r for r in read_records(harness.run_dir.metrics) if r["type"] == "generation"]
    assert (record["members"], record["resume_unit"]) == ([0, 1], 0)


def test_generation_records_name_a_remote_worker_s_host_by_its_address(harness: Harness):
    """Hosts of one name (containers, network namespaces) are told apart by the address a worker's
    connection came from; a worker on the driver's host (loopback) keeps its hostname."""
    harness.server.peer.side_effect = lambda worker: {0: "127.0.0.1", 1: "10.0.0.7"}[worker]
    harness.start()
    (record,) = [r for r in read_records(harness.run_dir.metrics) if r["type"] == "generation"]
    assert record["hosts"] == ["here", "10.0.0.7"]


def test_step_reports_commit_through_the_ledger_and_membership_sees_it(harness: Harness):
    harness.start()
    assert harness.driver.progress.committed_unit == 0 and harness.recorder.steps == []
    harness.step(0, 0)  # rank 0's report counts the step for its generation
    assert harness.driver.progress.committed_unit == harness.driver.membership.committed_unit == 1
    assert harness.recorder.steps == [1]
    harness.step(0, 1, generation=7)  # not the current generation's: settled when its generation ended
    assert harness.driver.progress.committed_unit == 1 and harness.recorder.steps == [1]
    harness.driver.handle(1, p.EvalDone(0, (2.0, 4.0)))
    assert harness.driver.test_history == []  # held: epoch 0's last step is not committed yet
    for step in (1, 2, 3):
        harness.step(0, step)
    assert harness.recorder.steps == [1, 2, 3, 4]
    assert harness.driver.test_history == [{"epoch": 0, "loss": 0.5}]


def test_an_exit_waits_for_the_last_messages_of_an_open_connection_up_to_the_drain_bound(harness: Harness):
    """Worker 0's process ended; its connection is still being read: its last step report arrives
    and counts, and the exit is acted on EXIT_DRAIN after it was seen, not before."""
    harness.start()
    harness.launcher.exited.return_value = {0: -9}
    harness.driver.tick()
    assert not harness.acted_on_the_exit_of(0)
    harness.step(0, 0)  # sent just before it died
    assert harness.driver.progress.committed_unit == 1
    harness.clock.now += EXIT_DRAIN * 0.9
    harness.driver.tick()
    assert not harness.acted_on_the_exit_of(0)
    harness.clock.now += EXIT_DRAIN * 0.2
    harness.driver.tick()
    assert harness.acted_on_the_exit_of(0)
    (fence,) = harness.server.fence.call_args_list
    assert "process exited with code -9" in fence.args[1]


def test_an_exit_whose_connection_ended_is_acted_on_when_its_end_is_read(harness: Harness):
    """The connection's end is queued behind everything the worker sent: the exit waits for it,
    however long, and is then acted on at once, with the process's exit code."""
    harness.start()
    harness.launcher.exited.return_value = {0: -9}
    harness.server.connection.side_effect = lambda worker: "ended" if worker == 0 else "open"
    harness.driver.tick()
    harness.clock.now += 10 * EXIT_DRAIN
    harness.driver.tick()
    assert not harness.acted_on_the_exit_of(0)
    harness.step(0, 0)
    harness.driver.handle(0, p.ConnectionLost("EOFError()"))
    assert harness.driver.progress.committed_unit == 1
    assert harness.acted_on_the_exit_of(0)
    assert "process exited with code -9" in harness.server.fence.call_args.args[1]


def test_an_exit_before_connecting_is_acted_on_at_once(harness: Harness):
    harness.start()
    harness.launcher.exited.return_value = {1: 1}
    harness.server.connection.side_effect = lambda worker: "none" if worker == 1 else "open"
    harness.driver.tick()
    assert harness.acted_on_the_exit_of(1)


def test_after_a_loss_the_survivor_s_position_forms_the_next_generation_and_the_slot_is_refilled(harness: Harness):
    harness.start()
    harness.driver.handle(1, p.WorkerFailed("Traceback ...\nRuntimeError: gloo", None, collective=True))
    assert harness.acted_on_the_exit_of(1)
    harness.step(1, 1)  # a removed worker is not heard any more: neither its late report
    harness.driver.handle(1, p.Ready())  # nor, were it a zombie back from a partition, its wish to rejoin
    # Rank 0 got past step 0, whose report it had not sent: its copy counts the step, below where it got.
    left = p.LeftGeneration(0, 1, failed=True, reason="peer lost", last=harness.report(0, 0))
    harness.driver.handle(0, left)
    assert harness.driver.progress.committed_unit == 0
    harness.driver.tick()
    assert harness.driver.progress.committed_unit == 1

    harness.launcher.start.assert_called_once_with(2, None)  # a first crash is replaced at once, as worker 2
    harness.store.admit.assert_called_with(1, (0,))  # worker 0 alone; worker 2 will join when ready
    entered = [(w, e.generation, e.rank, e.world_size, e.resume_unit) for w, e in harness.sent(p.EnterGeneration)]
    assert entered[-1] == (0, 1, 0, 1, 1)  # alone, resuming where it got
    harness.step(0, 1, generation=1, world=1)
    assert harness.driver.progress.committed_unit == 2


def test_the_same_user_error_on_every_worker_fails_the_job_with_the_users_exception(harness: Harness):
    harness.start()
    error = ValueError("bad sample 7")
    failed = p.WorkerFailed("Traceback ...\nValueError: bad sample 7", encode_exception(error), collective=False)
    harness.driver.handle(0, failed)
    assert harness.acted_on_the_exit_of(0)
    with pytest.raises(ValueError, match="bad sample 7"):
        harness.driver.handle(1, failed)


def test_a_halt_gives_up_on_the_asked_worker_s_exit_only_once_all_it_sent_was_read(harness: Harness):
    """Preempted, the driver asks rank 0 for its state. Rank 0, leaving on a notice of its own,
    uploads the snapshot of the unit it leaves at and exits: its process may end before the
    snapshot is read. The exit alone does not make the driver ask the next member, or keep an
    older state: only its connection's end, read behind the snapshot, or EXIT_DRAIN does."""
    harness.start()
    harness.step(0, 0)
    harness.watch.signal_name, harness.watch.received = "SIGTERM", harness.clock.now  # as a caught signal
    harness.driver.preempt()
    asked = lambda: [w for w, _ in harness.sent(p.SendFinalState)]  # noqa: E731
    assert asked() == [0]
    harness.launcher.exited.return_value = {0: 0}
    harness.driver.tick()
    assert asked() == [0] and harness.driver.final is None  # what it sent may still be queued
    harness.clock.now += EXIT_DRAIN * 1.1
    harness.driver.tick()
    assert asked() == [0, 1]  # nothing came within the bound: the next member is asked


def _preempted_with_step_1_committed(harness: Harness) -> None:
    """Rank 0 reported steps 0 and 1 (the committed unit is 2), then the driver was told to go
    and asked rank 0 for its state."""
    harness.start()
    harness.step(0, 0)
    harness.step(0, 1)
    assert harness.driver.progress.committed_unit == 2
    harness.watch.signal_name, harness.watch.received = "SIGTERM", harness.clock.now  # as a caught signal
    harness.driver.preempt()


def _leaves_with_a_snapshot(harness: Harness, worker: int, unit: int) -> None:
    """``worker``, rank 0 of generation 0, leaving on a notice of its own: its snapshot of
    ``unit``, its LeftGeneration, and its connection's end, in that order."""
    model = {"w": torch.full((3,), float(unit))}
    record = state_record(harness.driver.schedule, unit, "torch", PLAN.items_per_micro_batch, model, {"state": {}})
    harness.driver.handle(worker, p.StateChunk(0, unit, "snapshot", 0, wire.encode(record), last=True))
    harness.driver.handle(worker, p.LeftGeneration(0, unit, False, "leaves (SIGTERM)", True))
    harness.driver.handle(worker, p.ConnectionLost("ended"))


def _answers_behind(harness: Harness, worker: int, unit: int) -> None:
    harness.driver.handle(worker, p.FinalState({"w": torch.zeros(3)}, {"state": {}}, unit))


def test_a_member_s_state_behind_the_committed_step_gives_way_to_the_snapshot_that_holds_it(harness: Harness):
    """An abort can end a step's allreduce on rank 1 after it completed on rank 0, which reported
    the step: rank 1 undoes it. Every process told to go, rank 0 leaves with its snapshot of the
    committed unit, and rank 1, asked next, answers one step behind. The state kept is the
    snapshot: a preempted run's checkpoint holds every step committed (CI once wrote rank 1's)."""
    _preempted_with_step_1_committed(harness)
    _leaves_with_a_snapshot(harness, 0, 2)
    assert [w for w, _ in harness.sent(p.SendFinalState)] == [0, 1]
    _answers_behind(harness, 1, 1)
    final = harness.driver.final
    assert final is not None and final.unit == 2 and final.worker == -1, final
    assert harness.driver.progress.committed_unit == 2


def test_a_member_s_state_behind_the_committed_step_is_the_result_only_when_nothing_holds_more(harness: Harness):
    """The same, but rank 0 died without a snapshot: rank 1's state, one step behind, is the
    newest there is. It is the result, and the step past it is un-committed (redone on resume)."""
    _preempted_with_step_1_committed(harness)
    harness.driver.handle(0, p.ConnectionLost("ended"))
    assert [w for w, _ in harness.sent(p.SendFinalState)] == [0, 1]
    _answers_behind(harness, 1, 1)
    final = harness.driver.final
    assert final is not None and final.unit == 1 and final.worker == 1, final
    assert harness.driver.progress.committed_unit == 1
