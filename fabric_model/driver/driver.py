"""The driver: a thin event loop that routes control-plane messages to membership, progress
and checkpoint bookkeeping, and executes the commands membership returns.

It computes no gradients. One thread owns all of its state: the control server's reader
threads only put ``(worker_id, message)`` on a queue, and this loop handles them one at a
time, then ``tick``s (process deaths, heartbeats, replacements, deadlines). See
docs/architecture.md, "Processes" and "Elasticity".
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import secrets
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .. import protocol as p
from ..checkpoint import CheckpointInfo
from ..config import TrainConfig
from ..control import ControlServer
from ..errors import rebuild_exception
from ..launchers.base import Launcher
from ..launchers.local import LocalLauncher
from ..metrics_log import MetricsLog
from ..plan import Plan, Schedule
from .checkpoints import CheckpointBook
from .commands import Command, Formed, Kill, Limits, Send, Settle, Start
from .membership import Membership
from .progress import Progress

log = logging.getLogger(__name__)

#: Makes the launcher of a job from the control plane's address and the job's secret.
LauncherFactory = Callable[[tuple[str, int], bytes], Launcher]


@dataclasses.dataclass(frozen=True)
class DriverSetup:
    """Everything ``train()`` decided that the driver needs.

    Attributes:
        payload: the cloudpickled :class:`~fabric_model.job.Job`.
        config, plan: the run's configuration and plan.
        has_test: whether there is a test dataset (validation slots do work).
        stat_names: "loss" and the metrics, in the order of the step's stat sums.
        devices: one per local slot; ``len(devices)`` is the most workers at once.
        threads: intra-op threads per CPU worker.
        framework: the framework's name, recorded in checkpoints.
        keep_checkpoints: how many of the newest checkpoints to keep.
        resume: the checkpoint a resumed run continues from.
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


@dataclasses.dataclass
class FinalState:
    """The trained model and optimizer state, as one finished replica sent them."""

    model_state: dict[str, Any]
    optimizer_state: dict[str, Any]


class Driver:
    """Runs one training job and returns the final state.

    Args:
        setup: what ``train()`` decided.
        run_dir: the run directory (a :class:`~fabric_model.rundir.RunDirectory`).
        hooks: the driver's hooks (the user's logger, or the progress display).
        launcher_factory: where worker processes run; local processes by default.
        host: the address the control plane and the store listen on (a Ray job: the node's IP).
    """

    def __init__(
        self,
        setup: DriverSetup,
        run_dir: Any,
        hooks: Any,
        launcher_factory: LauncherFactory | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.setup, self.run_dir, self.hooks = setup, run_dir, hooks
        config, timeouts = setup.config, setup.config.timeouts
        self.schedule = Schedule(setup.plan, config.epochs, config.validation_freq, setup.has_test)
        history = None
        if setup.resume is not None:  # the earlier attempts' record, before appending to it
            history = MetricsLog.replay(run_dir.metrics, self.schedule, setup.resume.unit)
        self.metrics = MetricsLog(run_dir.metrics, append=setup.resume is not None)
        self.progress = Progress(setup.plan, self.schedule, setup.stat_names, self.metrics, hooks)
        self.checkpoints = CheckpointBook(run_dir.checkpoints, setup.framework, setup.keep_checkpoints, self.metrics)
        limits = Limits(
            max_workers=len(setup.devices),
            total_units=self.schedule.total_units,
            heartbeat=timeouts.heartbeat,
            recovery=timeouts.recovery,
            start=timeouts.start,
            replace_workers=timeouts.replace_workers,
        )
        self.membership = Membership(limits, self.checkpoints, self._log_tails)
        if setup.resume is not None and history is not None:
            self.progress.start_at(setup.resume.unit, *history)
            self.membership.committed(setup.resume.unit)
        self._launcher_factory = launcher_factory or self._local_launcher
        self._host = host
        self._hosts: dict[int, str] = {}  # worker id -> where it runs (its Hello, or the launcher's word)
        self._final: FinalState | None = None
        self._handlers: dict[type, Callable[[int, Any], None]] = {
            p.Hello: self._on_hello,
            p.Ready: lambda w, m: self._execute(self.membership.ready(w, m.attempt, time.monotonic())),
            p.Heartbeat: lambda w, m: None,
            p.StepDone: self._on_step,
            p.EvalDone: lambda w, m: self.progress.eval_done(m, len(self.membership.members)),
            p.CheckpointWritten: self.checkpoints.written,
            p.LeftGeneration: lambda w, m: self._execute(self.membership.left(w, m, time.monotonic())),
            p.Finished: self._on_finished,
            p.FinalState: self._on_final,
            p.WorkerFailed: self._on_failed,
            p.ConnectionLost: lambda w, m: self._lose(w, f"connection lost ({m.reason})"),
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

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> FinalState:
        import torch.distributed as dist  # here: `import fabric_model` stays light

        secret = secrets.token_bytes(32)
        self._server = ControlServer(secret, host=self._host, allocate_id=self.membership.allocate_id)
        timeouts = self.setup.config.timeouts
        store = dist.TCPStore(
            self._host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeouts.collective)
        )
        self._store_address = (self._host, store.port)
        self._launcher = self._launcher_factory(self._server.address, secret)
        self.run_dir.write_join_info(self._server.address, secret)
        try:
            self.checkpoints.prepare(self.setup.resume, self.progress.iteration)
            self._execute(self.membership.start(time.monotonic()))
            self.hooks.on_train_begin()
            while self._final is None:
                self._next_event()
            self.progress.check_replicas()
            for worker_id in self.membership.alive():
                self._server.send(worker_id, p.Stop())
            self._launcher.wait_all(timeouts.stop)
            self.hooks.on_train_end()
        finally:
            self._launcher.stop_all(timeouts.stop)
            self._server.close()
            self.metrics.close()
            self.run_dir.remove_join_info()
            del store
        assert self._final is not None
        return self._final

    def _local_launcher(self, address: tuple[str, int], secret: bytes) -> Launcher:
        return LocalLauncher(address, secret, self.run_dir.worker_log, self.setup.threads)

    def _next_event(self) -> None:
        try:
            worker_id, message = self._server.events.get(timeout=0.2)
        except queue.Empty:
            pass
        else:
            self.handle(worker_id, message)
        self.tick()

    def handle(self, worker_id: int, message: Any) -> None:
        """Route one message from ``worker_id``."""
        alive = self.membership.seen(worker_id, time.monotonic())
        # A gone worker's error still counts: its exit may have been noticed before its report.
        if alive or isinstance(message, (p.WorkerFailed, p.ConnectionLost)):
            self._handlers[type(message)](worker_id, message)

    def tick(self) -> None:
        """Periodic checks: ended processes, then membership's own (heartbeats, deadlines...)."""
        now = time.monotonic()
        self.membership.placement(self._launcher.pending(), now)
        for worker_id, code in self._launcher.exited().items():
            self._execute(self.membership.process_exited(worker_id, code, now))
        self._execute(self.membership.tick(now))

    # -- handlers ---------------------------------------------------------------------------
    def _on_hello(self, worker_id: int, message: p.Hello) -> None:
        self._hosts[worker_id] = self._launcher.host(worker_id) or message.host
        slot = self.membership.slot_of(worker_id)
        device = self.setup.devices[slot] if slot is not None else None
        setup = self.setup
        spec = p.JobSpec(setup.payload, setup.config, setup.plan, self._store_address, device, setup.threads)
        self._server.send(worker_id, spec)

    def _on_step(self, worker_id: int, message: p.StepDone) -> None:
        if message.generation != self.membership.generation:
            return  # older generations' reports were settled when they ended
        self.membership.step_reported(worker_id)
        unit = self.progress.step_done(message)
        if unit is not None:
            self.membership.committed(unit)

    def _on_finished(self, worker_id: int, message: p.Finished) -> None:
        self.membership.finished(worker_id, message.next_unit)
        self.progress.finished(worker_id, message)

    def _on_final(self, worker_id: int, message: p.FinalState) -> None:
        self._final = FinalState(message.model_state, message.optimizer_state)

    def _on_failed(self, worker_id: int, message: p.WorkerFailed) -> None:
        exc = rebuild_exception(message.exception, message.traceback, f"worker {worker_id}")
        if message.collective:  # not the user's code: a lost peer, a timeout, Ctrl-C
            self._lose(worker_id, f"error: {str(exc)[:200]}")
            return
        lines = message.traceback.strip().splitlines()
        signature = lines[-1] if lines else repr(exc)
        self._execute(self.membership.user_error(worker_id, exc, signature, time.monotonic()))

    def _lose(self, worker_id: int, reason: str) -> None:
        self._execute(self.membership.lost(worker_id, reason, time.monotonic()))

    # -- commands ---------------------------------------------------------------------------
    def _execute(self, commands: list[Command]) -> None:
        for command in commands:
            if isinstance(command, Send):
                self._server.send(command.worker_id, command.message)
            elif isinstance(command, Kill):
                self._launcher.kill(command.worker_id)
            elif isinstance(command, Start):
                self._launcher.start(command.worker_id, self.setup.devices[command.slot])
            elif isinstance(command, Settle):
                unit = self.progress.settle(command.resume_unit, command.upto_generation)
                if unit is not None:
                    self.membership.committed(unit)
            elif isinstance(command, Formed):
                self._record_generation(command)

    def _record_generation(self, formed: Formed) -> None:
        hosts = [self._hosts.get(w, "?") for w in formed.members]
        self.metrics.generation(
            generation=formed.generation,
            members=list(formed.members),
            reason=formed.reason,
            resume_unit=formed.resume_unit,
            source_rank=formed.source_rank,
            checkpoint=formed.checkpoint,
            hosts=hosts,
        )
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
