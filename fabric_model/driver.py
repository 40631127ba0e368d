"""The driver: owns the plan, membership, progress, metrics and the final result (DESIGN §2).

It computes no gradients. It is one loop over control-plane events (``_handle``), so a test
can feed it events without processes.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import secrets
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from . import control
from .callbacks import EpochAverage, MetricsLog, call_hook, stat_means
from .config import TrainConfig, get_timeout
from .control import ControlServer
from .errors import JobError, WorkerError, rebuild_exception
from .launcher import LocalLauncher
from .plan import Plan

log = logging.getLogger(__name__)


@dataclasses.dataclass
class FinalState:
    model_state: dict[str, Any]
    optimizer_state: dict[str, Any]


class ReplicaDivergenceError(AssertionError):
    """Replicas ended with different weights (a framework bug, or non-determinism in user code)."""


class ExactlyOnceError(AssertionError):
    """A committed step's micro-batches were not computed exactly once (a framework bug)."""


@dataclasses.dataclass
class _StepReports:
    ranks: set[int] = dataclasses.field(default_factory=set)
    micro_batches: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    stats: Optional[list[float]] = None


class Driver:
    """Runs one training job on local workers and returns the final model and optimizer state."""

    def __init__(
        self,
        payload: bytes,
        config: TrainConfig,
        plan: Plan,
        stat_names: list[str],
        run_dir: Path,
        devices: list[Optional[str]],
        threads: int,
        logger: Any,
    ) -> None:
        self.payload, self.config, self.plan = payload, config, plan
        self.stat_names = stat_names
        self.run_dir = run_dir
        self.devices = devices
        self.threads = threads
        self.logger = logger
        self.generation = 0
        self.members: list[int] = list(range(len(devices)))
        self.iteration = 0
        self._steps: dict[tuple[int, int], _StepReports] = {}
        self._done: set[int] = set()
        self._hello: set[int] = set()
        self._final: Optional[FinalState] = None
        self.replica_digests: dict[int, str] = {}
        self._average = EpochAverage(stat_names)
        self.train_history: list[dict[str, float]] = []
        self.test_history: list[dict[str, float]] = []
        self._metrics = MetricsLog(run_dir / "logs" / "metrics.jsonl")

    # -- the run --------------------------------------------------------------------------
    def run(self) -> FinalState:
        secret = secrets.token_bytes(32)
        server = ControlServer(secret)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=self.config.collective_timeout_s))
        self._store_address = ("127.0.0.1", store.port)
        self._server = server
        launcher = LocalLauncher(server.address, secret, self.run_dir / "logs", self.threads)
        self._launcher = launcher
        try:
            for worker_id, device in enumerate(self.devices):
                launcher.start(worker_id, device)
            call_hook(self.logger, "on_train_begin")
            self._loop(get_timeout("EDT_START_TIME_OUT").total_seconds())
            self._check_replicas()
            launcher.wait_all(get_timeout("EDT_STOP_TIME_OUT").total_seconds())
            call_hook(self.logger, "on_train_end")
        finally:
            launcher.stop_all(get_timeout("EDT_STOP_TIME_OUT").total_seconds())
            server.close()
            self._metrics.close()
            del store
        if self._final is None:
            raise JobError("training ended without a final model from rank 0")
        return self._final

    def _loop(self, start_timeout: float) -> None:
        started = time.monotonic()
        while len(self._done) < len(self.members):
            try:
                worker_id, kind, payload = self._server.events.get(timeout=0.5)
            except queue.Empty:
                self._check_processes()
                if len(self._hello) < len(self.members) and time.monotonic() - started > start_timeout:
                    missing = sorted(set(self.members) - self._hello)
                    raise JobError(
                        f"worker(s) {missing} did not register within {start_timeout:.0f} s "
                        f"(EDT_START_TIME_OUT). Their logs:\n" + self._logs(missing)
                    )
                continue
            self._handle(worker_id, kind, payload)

    def _check_replicas(self) -> None:
        """Invariant 4: every replica ends with the same weights and optimizer state."""
        self._metrics.write({"type": "end", "time": time.time(), "iteration": self.iteration,
                             "replica_digests": {str(k): v for k, v in sorted(self.replica_digests.items())}})
        if len(set(self.replica_digests.values())) > 1:
            raise ReplicaDivergenceError(f"replicas ended with different states: {self.replica_digests}")

    def _check_processes(self) -> None:
        for worker_id, code in self._launcher.exited().items():
            if worker_id not in self._done:
                # Give its last messages (an ERROR with a traceback) a moment to arrive first.
                self._drain(timeout=1.0)
                if worker_id in self._done:
                    continue
                raise WorkerError(
                    f"worker {worker_id} exited with code {code} before training finished. Its log "
                    f"({self._launcher.log_path(worker_id)}):\n{self._launcher.log_tail(worker_id)}"
                )

    def _drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                event = self._server.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            self._handle(*event)

    def _logs(self, worker_ids: list[int]) -> str:
        return "\n".join(f"--- worker {w} ---\n{self._launcher.log_tail(w)}" for w in worker_ids)

    # -- events ---------------------------------------------------------------------------
    def _handle(self, worker_id: int, kind: str, payload: dict[str, Any]) -> None:
        if kind == control.HELLO:
            self._on_hello(worker_id)
        elif kind == control.STEP:
            self._on_step(payload)
        elif kind == control.EVAL:
            self._on_eval(payload)
        elif kind == control.FINAL:
            self._final = FinalState(payload["model_state"], payload["optimizer_state"])
        elif kind == control.DONE:
            self._done.add(worker_id)
            self.replica_digests[worker_id] = payload["digest"]
        elif kind == control.ERROR:
            raise rebuild_exception(payload.get("exception"), payload.get("traceback", ""), f"worker {worker_id}")
        elif kind == control.LOST and worker_id not in self._done:
            self._check_processes()
            self._drain(timeout=2.0)
            if worker_id not in self._done:
                raise WorkerError(
                    f"lost the connection to worker {worker_id} ({payload.get('reason')}). Its log:\n"
                    + self._launcher.log_tail(worker_id)
                )

    def _on_hello(self, worker_id: int) -> None:
        self._hello.add(worker_id)
        self._server.send(worker_id, control.JOB, {
            "payload": self.payload, "config": self.config, "plan": self.plan,
            "device": self.devices[worker_id], "threads": self.threads,
        })
        if self._hello >= set(self.members):
            for rank, member in enumerate(self.members):
                self._server.send(member, control.GENERATION, {
                    "generation": self.generation, "rank": rank, "world_size": len(self.members),
                    "store": self._store_address,
                })

    def _on_step(self, payload: dict[str, Any]) -> None:
        key = (payload["epoch"], payload["step"])
        reports = self._steps.setdefault(key, _StepReports())
        reports.ranks.add(payload["rank"])
        reports.micro_batches[payload["rank"]] = payload["micro_batches"]
        if "stats" in payload:
            reports.stats = payload["stats"]
        if len(reports.ranks) == len(self.members) and reports.stats is not None:
            del self._steps[key]
            self._commit(key[0], key[1], reports)

    def _commit(self, epoch: int, step: int, reports: _StepReports) -> None:
        expected = self.plan.num_micro_batches(epoch, step)
        computed = sorted(j for mbs in reports.micro_batches.values() for j in mbs)
        if computed != list(range(expected)):
            raise ExactlyOnceError(f"step {step} of epoch {epoch}: micro-batches {computed}, expected 0..{expected - 1}")
        assert reports.stats is not None
        self.iteration += 1
        averages = self._average.add(epoch, reports.stats)
        if step == self.plan.steps_per_epoch - 1:
            self.train_history.append({"epoch": epoch, **averages})
        self._metrics.write({
            "type": "train", "time": time.time(), "epoch": epoch, "step": step, "iteration": self.iteration,
            "generation": self.generation, "workers": len(self.members),
            "metrics": stat_means(self.stat_names, reports.stats), "epoch_metrics": averages,
            "micro_batches": {str(r): m for r, m in sorted(reports.micro_batches.items())},
        })
        call_hook(self.logger, "log_train_metrics", averages, self.iteration, epoch, len(self.members))

    def _on_eval(self, payload: dict[str, Any]) -> None:
        metrics = stat_means(self.stat_names, payload["stats"])
        epoch = payload["epoch"]
        # Validation follows the epoch's last step, whose commit may not be recorded yet.
        iteration = (epoch + 1) * self.plan.steps_per_epoch
        self.test_history.append({"epoch": epoch, **metrics})
        self._metrics.write({"type": "test", "time": time.time(), "epoch": epoch,
                             "iteration": iteration, "workers": len(self.members), "metrics": metrics})
        call_hook(self.logger, "log_test_metrics", metrics, iteration, epoch)
