"""Fault injection for testing elastic jobs, with no test branch in the product's code paths
(docs/architecture.md, "Testing seams").

Worker-side faults ride in a worker logger, through the hooks' seams: the worker's collective
is what :meth:`FaultInjector.wrap_collective` returns (the manner of torchft's
``FakeProcessGroupWrapper``). Checkpoint files are written by the driver, so
:class:`CheckpointFault` acts through the driver's hooks: a ``FaultInjector`` given as the
driver logger (or a driver logger calling its ``wrap_checkpoint_stream``). Adding a worker is
a driver logger that starts one by hand, the way a user would on another host::

    faults = FaultInjector([Kill(worker=1, step=5), Hang(worker=2, step=9)], marker_dir=tmp)
    starter = WorkerStarter(run_dir, at_iterations=[7])
    FabricModel(..., worker_logger_callback=faults, driver_logger_callback=starter).train(...)
    starter.close()

``step`` is the global step (``epoch * steps_per_epoch + step``); ``worker`` is the worker id.
Each fault fires once per run (a marker file in ``marker_dir`` records it), so a step redone
after recovery runs clean; ``CheckpointFault("enospc", unit)`` alone fires on every write, as
a full disk would.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Literal

from .context import worker_context
from .hooks import Hooks
from .launchers.base import module_command
from .rundir import RunDirectory


@dataclasses.dataclass(frozen=True)
class Kill:
    """SIGKILL worker ``worker`` in step ``step``: inside the step, just before its allreduce
    (``before_allreduce``), or once the step has committed (``after_step``)."""

    worker: int
    step: int
    when: str = "before_allreduce"


@dataclasses.dataclass(frozen=True)
class Hang:
    """SIGSTOP worker ``worker`` just before the allreduce of step ``step`` (it freezes)."""

    worker: int
    step: int
    when: str = "before_allreduce"


@dataclasses.dataclass(frozen=True)
class FailCollective:
    """Make worker ``worker``'s allreduce in step ``step`` raise, as a broken link would."""

    worker: int
    step: int
    when: str = "before_allreduce"


@dataclasses.dataclass(frozen=True)
class HoldForJoin:
    """Every worker waits after step ``step`` until a worker is waiting to join (at most
    ``timeout`` seconds), so that a join started around then lands right after it, however
    long the newcomer takes to start: joins in tests become deterministic, not paced."""

    step: int
    timeout: float = 120.0
    when: str = "after_step"
    worker: int | None = None  # every worker


@dataclasses.dataclass(frozen=True)
class CheckpointFault:
    """Fail the checkpoint write of ``unit`` or later, after its first ``after_bytes`` bytes
    (what was written is fsynced, so a partial temporary file stays): ``"kill"`` SIGKILLs the
    writing process (the driver, which writes checkpoints), in the first such write of the run; ``"enospc"`` raises
    ``OSError(ENOSPC)`` in every such write, as a full disk would."""

    mode: Literal["kill", "enospc"]
    unit: int
    after_bytes: int = 1024

    def __post_init__(self) -> None:
        if self.mode not in ("kill", "enospc"):
            raise ValueError(f"Expected `mode` to be 'kill' or 'enospc'. Received: mode={self.mode!r}")


StepFault = Kill | Hang | FailCollective | HoldForJoin
Fault = StepFault | CheckpointFault


class FaultInjector:
    """A worker logger that injects ``faults``; ``inner`` (the user's worker logger) still runs.

    Args:
        faults: the faults to inject.
        marker_dir: a directory shared by the workers, recording which faults fired.
        inner: the user's worker logger (either signature), called as if it were given alone.
        step_delay: seconds to sleep after each step, to pace a run so that a joining
            worker (which takes seconds to start) lands mid-run.
    """

    def __init__(
        self, faults: Sequence[Fault], marker_dir: str | os.PathLike[str], inner: Any = None, step_delay: float = 0.0
    ) -> None:
        self.faults = list(faults)
        self.marker_dir = str(marker_dir)
        self.inner = inner
        self.step_delay = step_delay

    # -- the hooks ------------------------------------------------------------------------
    @functools.cached_property
    def _inner(self) -> Hooks:
        return Hooks.for_worker(self.inner)  # the user's logger, of either signature

    def on_train_begin(self) -> None:
        self._inner.on_train_begin()

    def on_train_end(self) -> None:
        self._inner.on_train_end()

    def log_train_metrics(self, metrics: dict[str, float], iteration: int, epoch: int, workers: int) -> None:
        self._fire("after_step")
        self._inner.log_train_metrics(metrics, iteration, epoch, workers)
        if self.step_delay:
            time.sleep(self.step_delay)

    def log_test_metrics(self, metrics: dict[str, float], iteration: int, epoch: int) -> None:
        self._inner.log_test_metrics(metrics, iteration, epoch)

    # -- the seams --------------------------------------------------------------------------
    def wrap_collective(self, collective: Any) -> Any:
        """The worker's collective, firing the ``before_allreduce`` faults as each allreduce starts."""
        return self._inner.wrap_collective(_FaultyCollective(collective, self))

    def wrap_checkpoint_stream(self, stream: IO[bytes], unit: int) -> Any:
        """The checkpoint file of ``unit``, failing as the first due :class:`CheckpointFault` says."""
        stream = self._inner.wrap_checkpoint_stream(stream, unit)
        for i, fault in enumerate(self.faults):
            if not isinstance(fault, CheckpointFault) or unit < fault.unit:
                continue
            if fault.mode == "enospc" or self._claim(i):
                return _FaultyStream(stream, fault)
        return stream

    # -- firing ---------------------------------------------------------------------------
    def _fire(self, when: str) -> None:
        ctx = worker_context()
        if ctx is None:
            return
        for i, fault in enumerate(self.faults):
            if isinstance(fault, CheckpointFault) or fault.when != when or fault.step != ctx.global_step:
                continue
            if fault.worker is not None and fault.worker != ctx.worker_id:
                continue
            if isinstance(fault, HoldForJoin):
                if self._claim(f"{i}-{ctx.worker_id}"):
                    deadline = time.monotonic() + fault.timeout
                    while not ctx.join_pending and time.monotonic() < deadline:
                        time.sleep(0.02)
                continue
            if not self._claim(i):
                continue
            if isinstance(fault, Kill):
                os.kill(os.getpid(), signal.SIGKILL)
            elif isinstance(fault, Hang):
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                raise _InjectedFailure(f"injected collective failure at step {fault.step} on worker {fault.worker}")

    def _claim(self, index: int | str) -> bool:
        """True the first time fault ``index`` fires in this run, across all processes.

        The marker file holds the wall-clock time the fault fired (see :func:`fired_at`)."""
        try:
            fd = os.open(os.path.join(self.marker_dir, f"fault-{index}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(fd, repr(time.time()).encode())
        os.close(fd)
        return True


def fired_at(marker_dir: str | os.PathLike[str], index: int) -> float | None:
    """When fault ``index`` of a :class:`FaultInjector` fired (``time.time()``), or None."""
    path = Path(marker_dir) / f"fault-{index}"
    return float(path.read_text()) if path.exists() else None


class _InjectedFailure(RuntimeError):
    pass


class _FaultyCollective:
    """The real collective, with the injector's ``before_allreduce`` faults fired as each
    allreduce (or the ordered sum's gather) starts; everything else is the real one's."""

    def __init__(self, inner: Any, injector: FaultInjector) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_injector", injector)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "_inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)  # state lives in the real collective

    def all_reduce_start(self, tensor: Any) -> Any:
        from .collective import CollectiveError  # imports torch.distributed: only in a worker

        try:
            self._injector._fire("before_allreduce")
        except _InjectedFailure as exc:
            raise CollectiveError(str(exc)) from exc
        return self._inner.all_reduce_start(tensor)

    def all_gather_start(self, output: Any, tensor: Any) -> Any:
        """The step's first exchange when the ordered sum gathers (deterministic mode)."""
        from .collective import CollectiveError

        try:
            self._injector._fire("before_allreduce")
        except _InjectedFailure as exc:
            raise CollectiveError(str(exc)) from exc
        return self._inner.all_gather_start(output, tensor)


class _FaultyStream:
    """A file that fails after the fault's ``after_bytes`` bytes, part of the checkpoint written."""

    def __init__(self, raw: IO[bytes], fault: CheckpointFault) -> None:
        self.raw, self.fault, self.written = raw, fault, 0

    def write(self, data: bytes) -> int:
        room = self.fault.after_bytes - self.written
        if len(data) < room:
            self.written += len(data)
            return self.raw.write(data)
        self.raw.write(bytes(memoryview(data)[:room]))
        self.raw.flush()
        os.fsync(self.raw.fileno())
        if self.fault.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + f" (injected: {self.fault})")

    def flush(self) -> None:
        self.raw.flush()


class WorkerStarter:
    """A driver logger that starts one extra worker by hand when ``iteration`` reaches each of
    ``at_iterations``, with the command line a user would run on another host."""

    def __init__(self, run_dir: str | os.PathLike[str], at_iterations: Sequence[int], inner: Any = None) -> None:
        self.run_dir = Path(run_dir)
        self.at_iterations = sorted(at_iterations)
        self.inner = inner
        self.processes: list[subprocess.Popen[bytes]] = []

    @functools.cached_property
    def _inner(self) -> Hooks:
        return Hooks.for_driver(self.inner)  # the user's logger, of either signature

    def on_train_begin(self) -> None:
        self._inner.on_train_begin()

    def on_train_end(self) -> None:
        self._inner.on_train_end()

    def log_test_metrics(self, metrics: dict[str, float], iteration: int, epoch: int) -> None:
        self._inner.log_test_metrics(metrics, iteration, epoch)

    def log_train_metrics(self, metrics: dict[str, float], iteration: int, epoch: int, workers: int) -> None:
        while self.at_iterations and iteration >= self.at_iterations[0]:
            self.at_iterations.pop(0)
            self.start()
        self._inner.log_train_metrics(metrics, iteration, epoch, workers)

    def start(self, device: str | None = None) -> subprocess.Popen[bytes]:
        run = RunDirectory(self.run_dir)
        info = json.loads(run.join_json.read_text())
        env = dict(os.environ, FABRIC_MODEL_SECRET=info["secret"], PYTHONPATH=os.pathsep.join(sys.path))
        cmd = module_command("fabric_model", "worker", "--driver", info["driver"])
        if device:
            cmd += ["--device", device]
        log = open(run.joined_log(len(self.processes)), "ab")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        self.processes.append(proc)
        return proc

    def close(self, timeout: float = 15.0) -> None:
        """Wait for the started workers to exit (they do when the job ends); kill stragglers."""
        deadline = time.monotonic() + timeout
        for proc in self.processes:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
