"""Faults injected into a running job: kills, freezes, failed collectives and checkpoint writes
(see :mod:`fabric_model.testing`)."""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Literal

from ..context import worker_context
from ..run.hooks import Hooks


@dataclasses.dataclass(frozen=True)
class Kill:
    """SIGKILL worker ``worker`` in step ``step``: inside the step, just before its allreduce
    (``before_allreduce``), once the step has committed (``after_step``), or, with a sharded
    optimizer state, after its update, before the updated slices are gathered (``before_spread``),
    or in the first blocking sum from that step on (``in_exchange``: a validation's, a sharded
    state's gather; a snapshot due by time is voted for only once rank 0's clock has moved past
    the last one's mark, so an exact step could pass without a gather)."""

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
class Preempt:
    """Send worker ``worker`` the signal ``signal_name`` in step ``step``, as a platform taking
    its machine back would (docs/architecture.md, "Preemption"): just before its allreduce, or
    once the step has committed (``after_step``, the default)."""

    worker: int
    step: int
    when: str = "after_step"
    signal_name: str = "SIGTERM"


@dataclasses.dataclass(frozen=True)
class FailCollective:
    """Make worker ``worker``'s allreduce in step ``step`` raise, as a broken link would: before
    it starts (``before_allreduce``), or once its first part is through on this worker
    (``in_allreduce``), so that its peers may finish it while this worker gives it up."""

    worker: int
    step: int
    when: str = "before_allreduce"


@dataclasses.dataclass(frozen=True)
class HoldForJoin:
    """Every worker waits after step ``step`` until a worker is waiting to join (at most
    ``timeout`` seconds), so that a join started around then lands right after it, however
    long the newcomer takes to start: joins in tests become deterministic, not paced. With
    ``workers``, no wait where the generation has that many members already (the newcomer
    came in time for it: nobody else will join)."""

    step: int
    timeout: float = 120.0
    when: str = "after_step"
    worker: int | None = None  # every worker
    workers: int | None = None


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


StepFault = Kill | Hang | Preempt | FailCollective | HoldForJoin
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
            if isinstance(fault, CheckpointFault) or fault.when != when:
                continue
            if fault.step != ctx.global_step and not (when == "in_exchange" and ctx.global_step > fault.step):
                continue
            if fault.worker is not None and fault.worker != ctx.worker_id:
                continue
            if isinstance(fault, HoldForJoin):
                full = fault.workers is not None and ctx.world_size >= fault.workers
                if self._claim(f"{i}-{ctx.worker_id}") and not full:
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
            elif isinstance(fault, Preempt):
                os.kill(os.getpid(), signal.Signals[fault.signal_name])
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

    def _fire(self, when: str) -> None:
        """The injector's faults of ``when``; an injected failure as the collective's own error."""
        from ..transport.collective import CollectiveError  # imports torch.distributed: only in a worker

        try:
            self._injector._fire(when)
        except _InjectedFailure as exc:
            raise CollectiveError(str(exc)) from exc

    def all_reduce_start(self, tensor: Any) -> Any:
        self._fire("before_allreduce")
        return self._inner.all_reduce_start(tensor)

    def all_gather_start(self, output: Any, tensor: Any) -> Any:
        """The step's first exchange when the ordered sum gathers (deterministic mode)."""
        self._fire("before_allreduce")
        return self._inner.all_gather_start(output, tensor)

    def wait(self, work: Any) -> None:
        """The real wait, then the ``in_allreduce`` faults (at a step's first wait only: they fire once)."""
        self._inner.wait(work)
        self._fire("in_allreduce")

    def all_reduce_sum(self, tensor: Any) -> None:
        """A blocking sum: a validation's, or a sharded state's exchange (an upload's gather, a
        new division, the end's gather of every slice into the user's optimizer): ``in_exchange``."""
        self._fire("in_exchange")
        self._inner.all_reduce_sum(tensor)

    def spread_start(self, output: Any, tensor: Any) -> Any:
        """The gather of a sharded state's updated slices, after this member's update (``before_spread``)."""
        self._fire("before_spread")
        return self._inner.spread_start(output, tensor)


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
