"""Simulated workers: many of them, against a real driver, to measure and test the control plane
at scale (benchmarks/bench_scale.py; docs/architecture.md, "Scale").

A simulated worker is no model and no collective: a connection that speaks the real control
protocol (the HMAC handshake, ``Hello``, ``Ready``, ``Entered``, heartbeats, rank 0's ``StepDone``
reports with the plan's micro-batches, ``LeftGeneration`` after an abort or a vote, leaving on a
notice). Many live in one process, read by one thread (a selector over their connections), so a
few processes hold thousands. The driver is the real one (:class:`~fabric_model.driver.driver.Driver`)
in a process of its own, with no local workers: every simulated worker joins as a worker
started by hand would. What a collective decides among real workers (the switch vote, the
step they stop after) the orchestrator decides for all: :class:`Simulation` steps every
process's members in lockstep and tells them when to switch.

    python -m fabric_model.testing.simulated driver RUN_DIR MAX_WORKERS   # the driver (Simulation starts it)
    python -m fabric_model.testing.simulated workers HOST PORT MICRO_BATCHES FD   # a process of workers
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pickle
import selectors
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..transport import protocol as p
from ..transport import sealed
from ..transport.descriptors import allow_many_descriptors

#: Units in the simulated schedule: one epoch of this many steps, never reached.
STEPS = 1_000_000


# -- the driver ------------------------------------------------------------------------------------
def run_driver(run_dir: str, max_workers: int) -> None:
    """The real driver of a job of simulated workers: ``max_workers`` engines, none local, a
    schedule that never ends, no checkpoint or snapshot; it runs until killed."""
    from ..driver.driver import Driver, DriverSetup
    from ..launchers.base import Launcher
    from ..run.hooks import Hooks
    from ..run.rundir import RunDirectory
    from ..setup.config import EngineSizing, SnapshotCadence, Timeouts, TrainConfig
    from ..step.plan import Plan

    class NoLauncher(Launcher):
        """Every worker joins by itself."""

        def start(self, worker_id: int, device: str | None) -> None:
            raise AssertionError("a job of simulated workers starts none")

        def exited(self) -> dict[int, int]:
            return {}

        def kill(self, worker_id: int) -> None:
            pass

        def wait_all(self, timeout: float) -> bool:
            return True

        def stop_all(self, timeout: float) -> None:
            pass

        def log_tail(self, worker_id: int, lines: int = 30) -> str:
            return ""

    plan = Plan(num_samples=STEPS * max_workers, items_per_micro_batch=1, micro_batches=max_workers, seed=0)
    config = TrainConfig(
        epochs=1,
        batch_size=1,
        sizing=EngineSizing(max_workers, max_workers, plan.global_batch),
        num_dataloader_threads=None,
        validation_freq=1,
        checkpoint_freq=0,
        timeouts=Timeouts.from_environment(),
        snapshots=SnapshotCadence(steps=0, seconds=0, share=0),
        backend="gloo",
    )
    setup = DriverSetup(
        payload=b"a simulated job",
        config=config,
        plan=plan,
        has_test=False,
        stat_names=["loss"],
        devices=[],
        threads=1,
        framework="torch",
        keep_checkpoints=1,
        max_workers=max_workers,
    )
    run = RunDirectory(run_dir).create()
    Driver(setup, run, Hooks([]), launcher_factory=lambda address, secret: NoLauncher()).run()


# -- the workers -----------------------------------------------------------------------------------
@dataclasses.dataclass
class SimWorker:
    """One simulated worker's connection and position."""

    conn: Connection
    worker_id: int = -1
    generation: int = -1  # the last generation entered
    rank: int = 0
    world: int = 1
    unit: int = 0  # next_unit
    member: bool = False  # in ``generation``, stepping
    pending: int = -1  # a JoinPending's generation
    last: p.StepDone | None = None  # its copy of its last step's report (rank 0 sends it)
    ready_sent: bool = False
    has_job: bool = False


class SimulatedWorkers:
    """Simulated workers in this process: one reader thread for all their connections."""

    def __init__(self, address: tuple[str, int], secret: bytes, micro_batches: int) -> None:
        self.address, self.secret, self.micro_batches = address, secret, micro_batches
        self.workers: list[SimWorker] = []
        self._lock = threading.Lock()  # sends, and the workers' fields
        self._selector = selectors.DefaultSelector()
        self._closed = False
        self.auto_ready = False  # joiners say Ready as soon as they have the job
        # The counts status() returns, kept as the workers change (``_change``): the orchestrator
        # polls every few ms, and reading thousands of workers each time would take the cores
        # the driver is being measured on.
        self._at: collections.Counter[int] = collections.Counter()  # generation -> members in it
        self._pending = 0  # members told of a generation past theirs
        self._ready = 0  # workers that said Ready
        self._thread = threading.Thread(target=self._read, name="sim-reader", daemon=True)
        self._thread.start()
        threading.Thread(target=self._beat, name="sim-heartbeat", daemon=True).start()

    def _tally(self, worker: SimWorker, sign: int) -> None:
        if worker.member:
            self._at[worker.generation] += sign
            self._pending += sign * (worker.pending > worker.generation)
        self._ready += sign * worker.ready_sent

    def _change(self, worker: SimWorker, **fields: Any) -> None:
        """Set ``worker``'s fields, keeping the counts (call with the lock held)."""
        self._tally(worker, -1)
        for name, value in fields.items():
            setattr(worker, name, value)
        self._tally(worker, 1)

    def _send(self, worker: SimWorker, message: Any) -> None:
        try:
            worker.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            pass

    def connect(self, count: int, ready: bool) -> None:
        """``count`` more workers connect and say Hello (and Ready once they have the job, if ``ready``)."""
        with self._lock:
            self.auto_ready = ready
        for _ in range(count):
            conn = sealed.dial(self.address, self.secret, timeout=10)
            worker = SimWorker(conn)
            with self._lock:
                self.workers.append(worker)
                self._send(worker, p.Hello(None, os.getpid(), socket.gethostname()))
                self._selector.register(conn.fileno(), selectors.EVENT_READ, worker)

    def ready(self) -> None:
        """Every worker that has the job and has not said so says Ready."""
        with self._lock:
            self.auto_ready = True
            for worker in self.workers:
                if worker.has_job and not worker.ready_sent:
                    self._change(worker, ready_sent=True)
                    self._send(worker, p.Ready(1))

    def _read(self) -> None:
        while not self._closed:
            try:
                events = self._selector.select(timeout=0.2)
            except (OSError, ValueError):
                continue
            for key, _ in events:
                worker = key.data
                try:
                    message = pickle.loads(worker.conn.recv_bytes())
                except (EOFError, OSError):
                    self._drop(worker)
                    continue
                with self._lock:
                    self._handle(worker, message)

    def _drop(self, worker: SimWorker) -> None:
        with self._lock:
            try:
                self._selector.unregister(worker.conn.fileno())
            except (KeyError, ValueError, OSError):
                pass
            worker.conn.close()
            if worker in self.workers:
                self._tally(worker, -1)
                self.workers.remove(worker)
            worker.member = False

    def _handle(self, worker: SimWorker, message: Any) -> None:
        if isinstance(message, p.Assigned):
            worker.worker_id = message.worker_id
        elif isinstance(message, p.JobSpec):
            worker.has_job = True
            if self.auto_ready:
                self._change(worker, ready_sent=True)
                self._send(worker, p.Ready(1))
        elif isinstance(message, p.EnterGeneration):
            worker.rank, worker.world = message.rank, message.world_size
            self._change(worker, generation=message.generation, unit=message.resume_unit, member=True)
            self._send(worker, p.Entered(message.generation))
        elif isinstance(message, p.JoinPending):
            self._change(worker, pending=message.generation)
        elif isinstance(message, p.Abort):
            if worker.member and message.generation >= worker.generation:  # its collective fails: the step undone
                self._change(worker, member=False)
                self._send(
                    worker, p.LeftGeneration(worker.generation, worker.unit, True, "aborted", last=self._last(worker))
                )
        elif isinstance(message, p.Stop):
            self._change(worker, member=False)

    @staticmethod
    def _last(worker: SimWorker) -> p.StepDone | None:
        last = worker.last
        return last if last is not None and last.generation == worker.generation else None

    def _beat(self) -> None:
        """Every worker's heartbeat, once a second (worker/inbox.py's interval)."""
        while not self._closed:
            time.sleep(1.0)
            with self._lock:
                for worker in self.workers:
                    self._send(worker, p.Heartbeat())

    def step(self, switch: bool = False, leaving: int = 0) -> float:
        """Every member reports the step at its unit; with ``switch``, then leaves its generation
        as after a vote (the first ``leaving`` members for good, on a notice). Returns when rank
        0's report went out (``time.time()``; 0 where no member here is rank 0)."""
        with self._lock:
            members = [w for w in self.workers if w.member]
            samples = float(self.micro_batches)  # one sample a micro-batch
            sent = 0.0
            for worker in members:  # rank 0 reports for its generation; every member keeps its copy
                mbs = tuple(range(worker.rank, self.micro_batches, worker.world))
                stats, computed = (0.5 * samples, samples), self.micro_batches
                report = p.StepDone(worker.generation, 0, worker.unit, worker.rank, worker.world, mbs, stats, computed)
                worker.last = report
                if worker.rank == 0:
                    self._send(worker, report)
                    sent = time.time()
                worker.unit += 1
            if switch:
                for i, worker in enumerate(members):
                    self._change(worker, member=False)
                    last = self._last(worker)
                    left = p.LeftGeneration(worker.generation, worker.unit, False, "switch", i < leaving, last)
                    self._send(worker, left)
        if switch:
            for worker in members[:leaving]:
                self._drop(worker)
        return sent

    def crash(self, count: int) -> None:
        """``count`` members' connections close, as a worker killed would leave them."""
        with self._lock:
            gone = [w for w in self.workers if w.member][:count]
        for worker in gone:
            self._drop(worker)

    def status(self) -> dict[str, Any]:
        with self._lock:
            newest = max((g for g, n in self._at.items() if n > 0), default=-1)
            return {
                "connected": len(self.workers),
                "members": sum(self._at.values()),
                "generation": newest,
                "at": self._at[newest] if newest >= 0 else 0,
                "pending": self._pending,
                "ready": self._ready,
            }

    def close(self) -> None:
        self._closed = True
        with self._lock:
            for worker in self.workers:
                worker.conn.close()


def serve_workers(pipe: Connection, address: tuple[str, int], secret: bytes, micro_batches: int) -> None:
    """A process of simulated workers, doing what the orchestrator's pipe asks: ``(name, args)``
    calls of :class:`SimulatedWorkers`' methods, each answered with its result."""
    allow_many_descriptors()  # thousands of connections in one process
    workers = SimulatedWorkers(address, secret, micro_batches)
    try:
        while True:
            name, args = pipe.recv()
            if name == "quit":
                break
            pipe.send(getattr(workers, name)(*args))
    finally:
        workers.close()


class Simulation:
    """A real driver in a process of its own and ``processes`` processes of simulated workers.

    Args:
        run_dir: the driver's run directory.
        max_workers: engines_number, the most workers at once.
        processes: processes the simulated workers are spread over.
        env: the driver's environment on top of this one's (its ``EDT_*`` bounds).
    """

    def __init__(self, run_dir: Path, max_workers: int, processes: int = 4, env: dict[str, str] | None = None) -> None:
        from ..run.rundir import RunDirectory

        self.run_dir, self.max_workers = Path(run_dir), max_workers
        self._read_to = 0  # how far formed_after read the driver's metrics.jsonl
        self.join_sizes: list[int] = []  # the last join storm's generations (more than one vote: the late joiners')
        command = [sys.executable, "-m", "fabric_model.testing.simulated", "driver", str(run_dir), str(max_workers)]
        environment = dict(os.environ, **(env or {}))
        package_root = str(Path(__file__).resolve().parents[2])  # this copy of the package, wherever it is
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, environment.get("PYTHONPATH")]))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / "driver.out", "ab") as out:  # its log lines, one per worker at times
            self.driver = subprocess.Popen(command, env=environment, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        run = RunDirectory(run_dir)
        deadline = time.monotonic() + 60
        while (info := run.read_join_info()) is None:
            if self.driver.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the simulated job's driver did not start")
            time.sleep(0.05)
        address, secret = info
        self.pipes: list[Connection] = []
        self.processes: list[subprocess.Popen[bytes]] = []
        for _ in range(processes):  # a socket pair each: the process's end is its descriptor 3
            mine, theirs = socket.socketpair()
            arguments = ["workers", address[0], str(address[1]), str(max_workers), str(theirs.fileno())]
            process = subprocess.Popen(
                [sys.executable, "-m", "fabric_model.testing.simulated", *arguments],
                env=dict(environment, FABRIC_MODEL_SECRET=secret.hex()),
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
            theirs.close()
            self.pipes.append(Connection(mine.detach()))
            self.processes.append(process)

    def call(self, name: str, *args: Any, per_process: list[tuple[Any, ...]] | None = None) -> list[Any]:
        """``name`` in every process of workers (``per_process``: each its own arguments), at once."""
        for i, pipe in enumerate(self.pipes):
            pipe.send((name, per_process[i] if per_process is not None else args))
        return [pipe.recv() for pipe in self.pipes]

    def spread(self, count: int) -> list[tuple[Any, ...]]:
        """``count`` cut into one share per process."""
        k = len(self.pipes)
        return [(count // k + (1 if i < count % k else 0),) for i in range(k)]

    def totals(self) -> dict[str, Any]:
        statuses = self.call("status")
        generation = max(s["generation"] for s in statuses)
        return {
            "connected": sum(s["connected"] for s in statuses),
            "members": sum(s["members"] for s in statuses),
            "generation": generation,
            "at": sum(s["at"] for s in statuses if s["generation"] == generation),
            "pending": sum(s["pending"] for s in statuses),
            "ready": sum(s["ready"] for s in statuses),
        }

    def wait_until(self, test: Any, timeout: float, what: str) -> float:
        """Seconds until ``test(totals)`` holds; ``TimeoutError`` naming ``what`` after ``timeout``."""
        started = time.monotonic()
        while True:
            totals = self.totals()
            if test(totals):
                return time.monotonic() - started
            if self.driver.poll() is not None:
                raise RuntimeError(f"the driver ended ({self.driver.returncode}) waiting for {what}: {totals}")
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"no {what} within {timeout:.0f} s: {totals}")
            time.sleep(0.005)

    # -- the scenarios ---------------------------------------------------------------------------
    def form(self, count: int, timeout: float = 120) -> float:
        """``count`` workers connect; then all say Ready at once: seconds to the generation they all entered."""
        self.call("connect", per_process=[(n, False) for (n,) in self.spread(count)])
        started = time.monotonic()
        self.call("ready")
        self.wait_until(lambda t: t["members"] == count and t["at"] == count, timeout, f"generation of {count}")
        return time.monotonic() - started

    def step(self, switch: bool = False, leaving: list[tuple[Any, ...]] | None = None) -> float:
        """One step of every member (``time.time()`` when rank 0's report went out)."""
        if leaving is not None:
            return max(self.call("step", per_process=[(switch, n) for (n,) in leaving]))
        return max(self.call("step", switch, 0))

    def crash(self, timeout: float = 120) -> float:
        """One member's connection closes: seconds to the next generation, entered by the rest."""
        before = self.totals()
        started = time.monotonic()
        self.call("crash", per_process=[(1,)] + [(0,)] * (len(self.pipes) - 1))
        expected = before["members"] - 1
        self.wait_until(
            lambda t: t["generation"] > before["generation"] and t["at"] == expected, timeout, "crash recovery"
        )
        return time.monotonic() - started

    def join_storm(self, count: int, timeout: float = 120) -> float:
        """``count`` workers join at once: seconds to the generation that takes them all, the
        members switching after the step that follows the driver's JoinPending."""
        before = self.totals()
        started = time.monotonic()
        self.call("connect", per_process=[(n, True) for (n,) in self.spread(count)])
        # Every joiner says Ready before the vote. A real generation votes at its next step after
        # the first JoinPending, and joiners whose Ready the driver read after the change wait
        # for the next vote: so do these, until a generation takes them all.
        every = before["connected"] + count
        self.wait_until(lambda t: t["ready"] == every and t["pending"] == before["members"], timeout, "joiners ready")
        expected = min(self.max_workers, before["members"] + count)
        generation = before["generation"]
        self.join_sizes = []
        while True:
            self.step(switch=True)
            formed = self.formed_after(generation, timeout - (time.monotonic() - started))
            generation, size = formed["generation"], len(formed["members"])
            self.join_sizes.append(size)
            self.wait_until(lambda t, g=generation, n=size: t["generation"] == g and t["at"] == n, timeout, "join")
            if size >= expected:
                return time.monotonic() - started
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"no generation of {expected} within {timeout:.0f} s (the last: {size})")
            self.wait_until(lambda t, n=size: t["pending"] == n, timeout, "the next vote")  # the rest are ready

    def formed_after(self, generation: int, timeout: float) -> dict[str, Any]:
        """The driver's record of the first generation formed after ``generation``. Read on from
        where the last call stopped: a step's record of thousands of ranks is tens of kB, and
        parsing the whole file every few ms would take the cores being measured."""
        deadline = time.monotonic() + timeout
        with open(self.run_dir / "logs" / "metrics.jsonl", "rb") as log:
            log.seek(self._read_to)
            pending = b""
            while True:
                pending += log.read()
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._read_to += len(line) + 1
                    if b'"type": "generation"' in line:
                        record = json.loads(line)
                        if record["generation"] > generation:
                            return record
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no generation after {generation} within {timeout:.0f} s")
                time.sleep(0.005)

    def preempt(self, count: int, timeout: float = 120) -> float:
        """``count`` members get a notice: they leave after the next step, as the others switch;
        seconds to the generation of the rest."""
        before = self.totals()
        started = time.monotonic()
        self.step(switch=True, leaving=self.spread(count))
        expected = before["members"] - count
        self.wait_until(lambda t: t["at"] == expected and t["generation"] > before["generation"], timeout, "leave")
        return time.monotonic() - started

    def committed(self) -> list[dict[str, Any]]:
        """The driver's records of committed steps (logs/metrics.jsonl)."""
        from ..run.metrics_log import read_records

        return [r for r in read_records(self.run_dir / "logs" / "metrics.jsonl") if r.get("type") == "train"]

    def close(self) -> None:
        for pipe in getattr(self, "pipes", []):
            try:
                pipe.send(("quit", ()))
            except OSError:
                pass
        for process in getattr(self, "processes", []):
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        if self.driver.poll() is None:
            self.driver.kill()
        self.driver.wait(timeout=30)


if __name__ == "__main__":
    if sys.argv[1:2] == ["driver"]:
        run_driver(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1:2] == ["workers"]:  # HOST PORT MICRO_BATCHES FD, the secret in FABRIC_MODEL_SECRET
        from ..settings.registry import SECRET

        host, port, micro_batches, fd = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
        serve_workers(Connection(fd), (host, port), bytes.fromhex(SECRET.get() or ""), micro_batches)
