"""The driver: owns the plan, membership, progress, metrics and the final result (DESIGN §2, §4).

It computes no gradients. It is one loop over control-plane events (``handle``) and a
periodic ``tick`` (process deaths, heartbeats, replacements, deadlines).

Membership: the workers of a *generation* train together. A generation ends when a member
is lost (its peers' collective fails; a silent worker is killed first) or when a ready
worker waits to join (members are asked to vote, and all stop after the same step). Each
member then reports how far it got (``next_unit``); the next generation resumes at the
furthest, taking the state from a member that holds it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import queue
import secrets
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .. import checkpoint, control
from ..callbacks import EpochAverage, MetricsLog, call_hook, stat_means
from ..config import TrainConfig, get_timeout
from ..control import ControlServer
from ..errors import JobError, rebuild_exception
from ..launchers.local import LocalLauncher
from ..plan import Plan, Schedule, assigned_micro_batches

log = logging.getLogger(__name__)

#: Same user error at the same unit this many times: the job fails with it (no crash loop).
USER_ERROR_LIMIT = 3


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
    world_size: int
    micro_batches: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    stats: list[float] | None = None


@dataclasses.dataclass
class _Worker:
    slot: int | None  # local device slot, None for a worker started by hand
    last_seen: float
    state: str = "starting"  # starting -> ready -> member -> done | gone
    joined_steps: int = 0  # steps committed while a member
    attempt: int = 1  # its latest READY's attempt number


@dataclasses.dataclass
class _Change:
    reason: str
    started: float
    reports: dict[int, int] = dataclasses.field(default_factory=dict)  # worker id -> next_unit


class Driver:
    """Runs one training job on local workers and returns the final model and optimizer state."""

    def __init__(
        self,
        payload: bytes,
        config: TrainConfig,
        plan: Plan,
        has_test: bool,
        stat_names: list[str],
        run_dir: Path,
        devices: list[str | None],
        threads: int,
        logger: Any,
        *,
        framework: str = "torch",
        keep_checkpoints: int = checkpoint.DEFAULT_KEEP,
        resume: checkpoint.CheckpointInfo | None = None,
    ) -> None:
        self.payload, self.config, self.plan = payload, config, plan
        self.schedule = Schedule(plan, config.epochs, config.validation_freq, has_test)
        self.stat_names = stat_names
        self.run_dir = run_dir
        self.devices = devices  # one per local slot; len(devices) is the most workers at once
        self.threads = threads
        self.logger = logger
        self.replace = os.environ.get("EDT_REPLACE_WORKERS", "1") != "0"
        self.generation = -1
        self.members: list[int] = []
        self.workers: dict[int, _Worker] = {}
        self.change: _Change | None = None
        self.iteration = 0
        self.committed_unit = 0  # every unit below this is committed
        self.replica_digests: dict[int, str] = {}
        self.train_history: list[dict[str, float]] = []
        self.test_history: list[dict[str, float]] = []
        self._done: dict[int, int] = {}  # worker id -> next_unit when it finished
        self._steps: dict[tuple[int, int, int], _StepReports] = {}
        self._final: FinalState | None = None
        self._finishing = False
        self._user_errors: collections.Counter[tuple[str, int]] = collections.Counter()
        self._last_user_error: BaseException | None = None
        self._slot_failures: collections.Counter[int] = collections.Counter()
        self._replacements: list[tuple[float, int]] = []  # (when, slot)
        self._next_id = len(devices)
        self._aborted_generation = -1
        self._final_from = -1
        self._finish_started = 0.0
        self._average = EpochAverage(stat_names)
        self.framework, self.keep_checkpoints, self.resumed_from = framework, keep_checkpoints, resume
        self.checkpoint_dir = run_dir / "checkpoints"
        self.checkpoints: dict[int, Path] = {}  # unit -> a complete checkpoint of this run
        metrics = run_dir / "logs" / "metrics.jsonl"
        if resume is not None:
            self._replay(metrics, resume.unit)
        self._metrics = _AppendingLog(metrics) if resume is not None else MetricsLog(metrics)
        self._heartbeat_timeout = get_timeout("EDT_HEARTBEAT_TIME_OUT").total_seconds()
        self._recovery_timeout = get_timeout("EDT_RECOVERY_TIME_OUT").total_seconds()

    # -- the run --------------------------------------------------------------------------
    def run(self) -> FinalState:
        secret = secrets.token_bytes(32)
        self._server = ControlServer(secret, allocate_id=self._allocate_id)
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.config.collective_timeout_s),
        )
        self._store_address = ("127.0.0.1", store.port)
        self._launcher = LocalLauncher(self._server.address, secret, self.run_dir / "logs", self.threads)
        _write_join_info(self.run_dir, self._server.address, secret)
        stop_timeout = get_timeout("EDT_STOP_TIME_OUT").total_seconds()
        try:
            self._prepare_checkpoints()
            for slot in range(len(self.devices)):
                self._start(slot, worker_id=slot)
            call_hook(self.logger, "on_train_begin")
            self._loop(get_timeout("EDT_START_TIME_OUT").total_seconds())
            self._check_replicas()
            for worker_id in self._alive():
                self._server.send(worker_id, control.STOP)
            self._launcher.wait_all(stop_timeout)
            call_hook(self.logger, "on_train_end")
        finally:
            self._launcher.stop_all(stop_timeout)
            self._server.close()
            self._metrics.close()
            (self.run_dir / "join.json").unlink(missing_ok=True)
            del store
        assert self._final is not None
        return self._final

    def _allocate_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _start(self, slot: int, worker_id: int | None = None) -> None:
        worker_id = self._allocate_id() if worker_id is None else worker_id
        self.workers[worker_id] = _Worker(slot=slot, last_seen=time.monotonic())
        self._launcher.start(worker_id, self.devices[slot])

    def _alive(self) -> list[int]:
        return [w for w, info in self.workers.items() if info.state != "gone"]

    def _loop(self, start_timeout: float) -> None:
        started = time.monotonic()
        while self._final is None:
            try:
                worker_id, kind, payload = self._server.events.get(timeout=0.2)
            except queue.Empty:
                pass
            else:
                self.handle(worker_id, kind, payload)
            self.tick()
            if self._finishing and time.monotonic() - self._finish_started > self._recovery_timeout:
                raise JobError(f"no final state from worker {self._final_from} within {self._recovery_timeout:.0f} s")
            if self.generation < 0 and time.monotonic() - started > start_timeout:
                ready = [w for w, i in self.workers.items() if i.state == "ready"]
                if not ready:
                    missing = [w for w, i in self.workers.items() if i.state == "starting"]
                    raise JobError(
                        f"no worker became ready within {start_timeout:.0f} s (EDT_START_TIME_OUT). "
                        f"Their logs:\n" + self._logs(missing)
                    )
                self._form_generation("start")

    def _logs(self, worker_ids: list[int]) -> str:
        return "\n".join(f"--- worker {w} ---\n{self._launcher.log_tail(w)}" for w in worker_ids)

    # -- events ---------------------------------------------------------------------------
    def handle(self, worker_id: int, kind: str, payload: dict[str, Any]) -> None:
        info = self.workers.get(worker_id)
        if info is None:  # a worker started by hand
            info = self.workers[worker_id] = _Worker(slot=None, last_seen=time.monotonic())
        info.last_seen = time.monotonic()
        if info.state == "gone" and kind not in (control.ERROR, control.LOST):
            return
        if kind == control.HELLO:
            self._server.send(
                worker_id,
                control.JOB,
                {
                    "payload": self.payload,
                    "config": self.config,
                    "plan": self.plan,
                    "store": self._store_address,
                    "device": self.devices[info.slot] if info.slot is not None else None,
                    "threads": self.threads,
                },
            )
        elif kind == control.READY:
            self._on_ready(worker_id, int(payload.get("attempt", 1)))
        elif kind == control.STEP:
            if payload["generation"] == self.generation:  # older ones were settled when it ended
                self._on_step(worker_id, payload)
        elif kind == control.EVAL:
            self._on_eval(payload)
        elif kind == control.CHECKPOINT:
            self._on_checkpoint(worker_id, payload)
        elif kind in (control.BOUNDARY, control.FAILED):
            if payload.get("generation") == self.generation and worker_id in self.members:
                self._report(worker_id, int(payload["next_unit"]), payload.get("reason") or kind)
        elif kind == control.DONE:
            info.state = "done"
            self._done[worker_id] = int(payload["next_unit"])
            self.replica_digests[worker_id] = payload["digest"]
            if self.change is not None:
                self.change.reports[worker_id] = int(payload["next_unit"])
        elif kind == control.FINAL:
            self._final = FinalState(payload["model_state"], payload["optimizer_state"])
        elif kind == control.ERROR:
            self._on_error(worker_id, payload)
        elif kind == control.LOST:
            self._lose(worker_id, f"connection lost ({payload.get('reason')})")

    def tick(self) -> None:
        """Periodic checks: dead or silent workers, due replacements, a change to complete."""
        now = time.monotonic()
        for worker_id, code in self._launcher.exited().items():
            if self.workers[worker_id].state not in ("gone",) and not (code == 0 and self._finishing):
                self._lose(worker_id, f"process exited with code {code}")
        for worker_id, info in list(self.workers.items()):
            if info.state in ("ready", "member", "done") and now - info.last_seen > self._heartbeat_timeout:
                self._lose(worker_id, f"no heartbeat for {now - info.last_seen:.1f} s (EDT_HEARTBEAT_TIME_OUT)")
        for when, slot in list(self._replacements):
            if now >= when and len(self._alive()) < len(self.devices) and not self._finishing:
                self._replacements.remove((when, slot))
                self._start(slot)
        if self.change is not None:
            self._try_complete_change(now)
        if (
            not self._finishing
            and self.generation >= 0
            and self.members
            and all(self.workers[m].state == "done" for m in self.members)
        ):
            self._finish()

    def _on_ready(self, worker_id: int, attempt: int) -> None:
        info = self.workers[worker_id]
        info.attempt = attempt
        if info.state == "member" and worker_id in self.members:
            # Its pull failed: the members may be blocked waiting for it in this generation.
            if self.change is None:
                self._begin_change(f"worker {worker_id} failed to enter generation {self.generation}")
            self._abort_members()
        taken = sum(1 for w, i in self.workers.items() if i.state in ("member", "ready", "done") and w != worker_id)
        if taken >= len(self.devices) or self._finishing:
            log.info("worker %d refused: already %d workers (engines_number)", worker_id, taken)
            self._server.send(worker_id, control.STOP)
            info.state = "gone"
            return
        info.state = "ready"
        if self.generation < 0:
            if all(i.state != "starting" for i in self.workers.values()):
                self._form_generation("start")
        elif self.change is None:
            self._begin_change(f"worker {worker_id} joins")
            for member in self.members:
                self._server.send(member, control.PENDING, {"generation": self.generation + 1})

    def _on_error(self, worker_id: int, payload: dict[str, Any]) -> None:
        exc = rebuild_exception(payload.get("exception"), payload.get("traceback", ""), f"worker {worker_id}")
        member = worker_id in self.members and self.workers[worker_id].state == "member"
        if not payload.get("collective"):
            lines = (payload.get("traceback") or "").strip().splitlines()
            # A worker that fails while setting up (get_datasets, rebuilding the model) has no
            # unit; the same error from every slot, or USER_ERROR_LIMIT times, is the user's.
            signature = (lines[-1] if lines else repr(exc), self.committed_unit if member else -1)
            self._user_errors[signature] += 1
            self._last_user_error = exc
            peers = len(self.members) if member else len(self.devices)
            if self._user_errors[signature] >= USER_ERROR_LIMIT or self._user_errors[signature] >= peers:
                raise exc
        self._lose(worker_id, f"error: {str(exc)[:200]}")

    def _lose(self, worker_id: int, reason: str) -> None:
        info = self.workers[worker_id]
        if info.state == "gone":
            return
        if self._finishing and self._final is None and worker_id == self._final_from:
            info.state = "gone"
            self._request_final(exclude=worker_id)
        was_member = info.state in ("member", "done") and worker_id in self.members
        info.state = "gone"
        if worker_id in self._launcher.processes and self._launcher.processes[worker_id].poll() is None:
            self._launcher.kill(worker_id)  # silent or erroring: make sure it cannot come back half-alive
        log.warning("worker %d lost: %s", worker_id, reason)
        if info.slot is not None and self.replace and not self._finishing:
            self._slot_failures[info.slot] += 1
            delay = min(30.0, 2.0 ** (self._slot_failures[info.slot] - 1))
            self._replacements.append((time.monotonic() + delay, info.slot))
        if was_member and not self._finishing:
            if self.change is None:
                self._begin_change(f"worker {worker_id} lost: {reason}")
            self._abort_members()

    def _report(self, worker_id: int, next_unit: int, reason: str) -> None:
        if self.change is None:
            self._begin_change(f"worker {worker_id}: {reason}")
        assert self.change is not None
        if reason != "switch":
            self._abort_members()  # peers may be blocked in a collective this worker left
        if next_unit >= 0:
            self.change.reports[worker_id] = next_unit

    # -- generations ----------------------------------------------------------------------
    def _abort_members(self) -> None:
        """Tell the members to give up this generation's collectives (once per generation)."""
        if self._aborted_generation == self.generation:
            return
        self._aborted_generation = self.generation
        for member in self.members:
            if self.workers[member].state == "member":
                self._server.send(member, control.ABORT, {"generation": self.generation})

    def _begin_change(self, reason: str) -> None:
        log.info("generation %d ending: %s", self.generation, reason)
        self.change = _Change(reason, time.monotonic())

    def _try_complete_change(self, now: float) -> None:
        assert self.change is not None
        # Members still heartbeating are busy (a long step, a validation); they report at their
        # next micro-batch or collective. Silent ones are removed by the heartbeat check.
        waiting = [m for m in self.members if self.workers[m].state in ("member",) and m not in self.change.reports]
        if waiting:
            return
        reports = {w: u for w, u in self.change.reports.items() if self.workers[w].state != "gone"}
        reports.update({w: self._done[w] for w in self.members if w in self._done and self.workers[w].state == "done"})
        if reports and max(reports.values()) >= self.schedule.total_units:
            self._commit_pending(self.schedule.total_units, upto_generation=self.generation)
            self.members = [w for w in self.members if self._done.get(w, -1) >= self.schedule.total_units]
            self.change = None
            self._finish()
            return
        ready = [w for w, i in self.workers.items() if i.state == "ready"]
        if not reports and self.committed_unit > 0 and self._checkpoint_at(self.committed_unit) is None:
            # With a checkpoint of the committed position, fresh workers start from it instead.
            hint = "resume from the newest checkpoint with train(..., resume=True)" if self.checkpoints else ""
            raise self._last_user_error or JobError(
                f"every worker holding the training state was lost ({self.change.reason}) and no checkpoint "
                f"holds the last committed step; {hint or 'the run has no checkpoint to go on from'}"
            )
        if not reports and not ready:
            starting = [w for w, i in self.workers.items() if i.state == "starting"]
            waited = now - self.change.started
            if (not self._replacements and not starting) or waited > self._recovery_timeout:
                raise self._last_user_error or JobError(
                    f"no worker left and none became ready in {waited:.0f} s ({self.change.reason})"
                )
            return  # wait for a replacement (started or due) to become ready
        self._form_generation(self.change.reason, reports)

    def _form_generation(self, reason: str, reports: dict[int, int] | None = None) -> None:
        reports = reports or {}
        survivors = [m for m in self.members if m in reports]
        room = len(self.devices) - len(survivors)
        newcomers = [w for w, i in self.workers.items() if i.state == "ready" and w not in survivors][: max(0, room)]
        resume = max(reports.values()) if reports else self.committed_unit
        holders = [m for m in survivors if reports[m] == resume]
        members = survivors + newcomers
        needs_state = bool(survivors) and (bool(newcomers) or len(holders) < len(survivors))
        source = members.index(holders[0]) if needs_state else -1
        # Nobody holds the state past the start: every member loads the checkpoint of `resume`.
        restore = self._checkpoint_at(resume) if not survivors and resume > 0 else None
        if not survivors and resume > 0 and restore is None:
            raise JobError(f"no worker holds the state of unit {resume} and no checkpoint does")
        settings = {
            "dir": str(self.checkpoint_dir),
            "framework": self.framework,
            "written": max(self.checkpoints, default=-1),
            "restore": str(restore) if restore is not None else None,
        }
        self.generation += 1
        self.members = members
        self.change = None
        self._commit_pending(resume, upto_generation=self.generation - 1)
        for rank, worker_id in enumerate(members):
            self.workers[worker_id].state = "member"
            self._server.send(
                worker_id,
                control.GENERATION,
                {
                    "attempt": self.workers[worker_id].attempt,
                    "generation": self.generation,
                    "rank": rank,
                    "world_size": len(members),
                    "resume_unit": resume,
                    "source_rank": source,
                    "checkpoint": settings,
                },
            )
        record = {
            "type": "generation",
            "time": time.time(),
            "generation": self.generation,
            "workers": len(members),
            "members": members,
            "reason": reason,
            "resume_unit": resume,
            "source_rank": source,
        }
        if restore is not None:
            record["checkpoint"] = restore.name
        self._metrics.write(record)
        log.log(
            logging.INFO if reason == "start" else logging.WARNING,
            "generation %d: %d worker(s) %s, resuming at unit %d (%s)",
            self.generation,
            len(members),
            members,
            resume,
            reason,
        )

    def _finish(self) -> None:
        """Training is over: ask one finished replica for the final state."""
        self._finishing = True
        self._finish_started = time.monotonic()
        self._request_final()

    def _request_final(self, exclude: int = -1) -> None:
        finished = [
            w
            for w in self.members
            if self._done.get(w, -1) >= self.schedule.total_units and w != exclude and self.workers[w].state != "gone"
        ]
        if not finished:
            raise JobError("training ended, but every finished replica was lost before sending the final state")
        self._final_from = finished[0]
        self._server.send(finished[0], control.FINAL_REQUEST)

    # -- checkpoints ----------------------------------------------------------------------
    def _prepare_checkpoints(self) -> None:
        """A fresh run starts with no checkpoint; a resumed one keeps those up to its own."""
        directory, resumed = self.checkpoint_dir, self.resumed_from
        checkpoint.remove_temp_files(directory)  # no writer of this run has started yet
        if resumed is None:
            old = checkpoint.list_checkpoints(directory)
            if old:  # else a later resume=True could pick another run's checkpoint
                log.warning("removing %d checkpoint(s) of an earlier run in %s", len(old), directory)
            for _, path in old:
                path.unlink(missing_ok=True)
            return
        checkpoint.set_aside_after(directory, resumed.unit)
        self.checkpoints = dict(checkpoint.list_checkpoints(directory))
        self.checkpoints[resumed.unit] = resumed.path
        self._metrics.write(
            {
                "type": "resume",
                "time": time.time(),
                "checkpoint": resumed.path.name,
                "resume_unit": resumed.unit,
                "epoch": resumed.epoch,
                "iteration": self.iteration,
            }
        )
        log.info("resuming from %s at unit %d (epoch %d done)", resumed.path.name, resumed.unit, resumed.epoch + 1)

    def _checkpoint_at(self, unit: int) -> Path | None:
        """This run's complete checkpoint of ``unit``; one on disk whose report has not arrived
        (its writer died right after the rename) counts too: complete files only get that name."""
        path = self.checkpoints.get(unit, self.checkpoint_dir / checkpoint.checkpoint_name(unit))
        if not path.exists():
            return None
        self.checkpoints[unit] = path
        return path

    def _on_checkpoint(self, worker_id: int, payload: dict[str, Any]) -> None:
        unit, epoch = int(payload["unit"]), int(payload["epoch"])
        record: dict[str, Any] = {"type": "checkpoint", "time": time.time(), "unit": unit, "epoch": epoch}
        record.update(worker=worker_id, generation=payload.get("generation"))
        if payload.get("error"):
            record["error"] = payload["error"]
            log.warning(
                "checkpoint after epoch %d failed on worker %d: %s; the previous one stays the newest and "
                "training goes on",
                epoch + 1,
                worker_id,
                payload["error"],
            )
        else:
            path = Path(payload["path"])
            self.checkpoints[unit] = path
            # Only now that the new one is durable may the oldest go.
            removed = checkpoint.prune(self.checkpoint_dir, self.keep_checkpoints)
            self.checkpoints = {u: p for u, p in self.checkpoints.items() if p not in removed}
            record.update(path=f"checkpoints/{path.name}", seconds=payload.get("seconds"))
            record["removed"] = [p.name for p in removed]
            log.info("checkpoint %s after epoch %d", path.name, epoch + 1)
        self._metrics.write(record)

    def _replay(self, metrics: Path, unit: int) -> None:
        """Take the position and history below ``unit`` (where a resumed run goes on) from the
        metrics log of the earlier attempts; later records there are redone and superseded."""
        steps = self.plan.steps_per_epoch
        epoch, k = divmod(unit, self.schedule.units_per_epoch)
        self.committed_unit, self.iteration = unit, epoch * steps + min(k, steps)
        try:
            data = metrics.read_bytes()
        except FileNotFoundError:
            return
        keep = data.rfind(b"\n") + 1
        if keep < len(data):  # a driver killed mid-line: cut the partial record before appending
            with open(metrics, "r+b") as f:
                f.truncate(keep)
        train: dict[tuple[int, int], dict[str, Any]] = {}
        test: dict[int, dict[str, Any]] = {}
        for line in data[:keep].splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            # A later attempt's record of the same step or validation wins.
            if r.get("type") == "train" and self.schedule.unit(r["epoch"], r["step"]) < unit:
                train[(r["epoch"], r["step"])] = r
            elif r.get("type") == "test" and self.schedule.unit(r["epoch"], steps) < unit:
                test[r["epoch"]] = r
        self.train_history = [
            {"epoch": e, **r["epoch_metrics"]} for (e, s), r in sorted(train.items()) if s == steps - 1
        ]
        self.test_history = [{"epoch": e, **r["metrics"]} for e, r in sorted(test.items())]

    # -- progress -------------------------------------------------------------------------
    def _on_step(self, worker_id: int, payload: dict[str, Any]) -> None:
        key = (payload["generation"], payload["epoch"], payload["step"])
        reports = self._steps.setdefault(key, _StepReports(payload["world_size"]))
        reports.micro_batches[payload["rank"]] = payload["micro_batches"]
        reports.stats = payload["stats"]
        self.workers[worker_id].joined_steps += 1
        if len(reports.micro_batches) == reports.world_size:
            del self._steps[key]
            self._commit(key[1], key[2], key[0], reports, inferred=False)

    def _commit_pending(self, resume_unit: int, upto_generation: int) -> None:
        """Settle the step reports of an ended generation.

        A step below ``resume_unit`` was completed by an allreduce that some member saw
        succeed, so every member of that generation contributed its share: record it with
        the shares that the plan assigned to the members that did not report. Steps at or
        past ``resume_unit`` will be redone, so their partial reports are dropped.
        """
        for key in sorted(self._steps):
            generation, epoch, step = key
            if generation > upto_generation:
                continue
            reports = self._steps.pop(key)
            if self.schedule.unit(epoch, step) < resume_unit and reports.stats is not None:
                n = self.plan.num_micro_batches(epoch, step)
                for rank in range(reports.world_size):
                    reports.micro_batches.setdefault(rank, list(assigned_micro_batches(n, rank, reports.world_size)))
                self._commit(epoch, step, generation, reports, inferred=True)

    def _commit(self, epoch: int, step: int, generation: int, reports: _StepReports, inferred: bool) -> None:
        expected = self.plan.num_micro_batches(epoch, step)
        computed = sorted(j for mbs in reports.micro_batches.values() for j in mbs)
        if computed != list(range(expected)):
            raise ExactlyOnceError(
                f"step {step} of epoch {epoch}: micro-batches {computed}, expected 0..{expected - 1}"
            )
        assert reports.stats is not None
        self.iteration += 1
        self.committed_unit = max(self.committed_unit, self.schedule.unit(epoch, step) + 1)
        self._last_user_error = None  # training moved on: an earlier error is not this run's cause
        averages = self._average.add(epoch, reports.stats)
        if step == self.plan.steps_per_epoch - 1:
            self.train_history.append({"epoch": epoch, **averages})
        for member in self.members:
            info = self.workers[member]
            if info.slot is not None and info.joined_steps >= 20:
                self._slot_failures[info.slot] = 0  # a slot that trains steadily starts its backoff afresh
        record = {
            "type": "train",
            "time": time.time(),
            "epoch": epoch,
            "step": step,
            "iteration": self.iteration,
            "generation": generation,
            "workers": reports.world_size,
            "metrics": stat_means(self.stat_names, reports.stats),
            "epoch_metrics": averages,
            "micro_batches": {str(r): m for r, m in sorted(reports.micro_batches.items())},
        }
        if inferred:
            record["inferred"] = True
        self._metrics.write(record)
        call_hook(self.logger, "log_train_metrics", averages, self.iteration, epoch, reports.world_size)

    def _on_eval(self, payload: dict[str, Any]) -> None:
        metrics = stat_means(self.stat_names, payload["stats"])
        epoch = payload["epoch"]
        iteration = (epoch + 1) * self.plan.steps_per_epoch  # validation follows the epoch's last step
        if any(t["epoch"] == epoch for t in self.test_history):
            return  # a validation redone after a generation change
        self.test_history.append({"epoch": epoch, **metrics})
        self._metrics.write(
            {
                "type": "test",
                "time": time.time(),
                "epoch": epoch,
                "iteration": iteration,
                "workers": len(self.members),
                "metrics": metrics,
            }
        )
        call_hook(self.logger, "log_test_metrics", metrics, iteration, epoch)

    def _check_replicas(self) -> None:
        """Invariant 4: every replica that finished holds the same weights and optimizer state."""
        finished = {w: d for w, d in self.replica_digests.items() if self._done.get(w, -1) >= self.schedule.total_units}
        self._metrics.write(
            {
                "type": "end",
                "time": time.time(),
                "iteration": self.iteration,
                "replica_digests": {str(k): v for k, v in sorted(finished.items())},
            }
        )
        self.replica_digests = finished
        if len(set(finished.values())) > 1:
            raise ReplicaDivergenceError(f"replicas ended with different states: {finished}")


def _write_join_info(run_dir: Path, address: tuple[str, int], secret: bytes) -> None:
    """Where a worker started by hand connects (readable by this user only)."""
    import json

    path = run_dir / "join.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"driver": f"{address[0]}:{address[1]}", "secret": secret.hex()}, f)


class _AppendingLog(MetricsLog):
    """The metrics log of a resumed run: the earlier attempts' records stay, new ones follow
    (``MetricsLog`` starts the file afresh)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")
        self._flushed = time.monotonic()
