"""Where a worker is, readable from user code running inside it (loggers, losses, callbacks).

from fabric_model import worker_context
ctx = worker_context()      # None in the driver
ctx.rank, ctx.world_size, ctx.generation, ctx.epoch, ctx.step, ctx.global_step, ctx.join_pending
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass
class WorkerContext:
    """Updated by the worker loop; read-only for user code."""

    worker_id: int
    rank: int = 0
    world_size: int = 1
    generation: int = -1
    epoch: int = 0
    step: int = 0  # the step within the epoch being computed or just committed
    global_step: int = 0  # epoch * steps_per_epoch + step
    #: Set by the worker: whether a worker is waiting to join this generation.
    pending_join: Callable[[], bool] = dataclasses.field(default=lambda: False, repr=False)
    #: Set by the worker: bytes of optimizer state it holds (its slices' with ``shard_optimizer_state``).
    state_bytes: Callable[[], int] = dataclasses.field(default=lambda: 0, repr=False)
    #: Set by the worker: bytes of gradients it holds now.
    grad_bytes: Callable[[], int] = dataclasses.field(default=lambda: 0, repr=False)

    @property
    def join_pending(self) -> bool:
        """True while a worker waits to join: the members switch after their next step."""
        return self.pending_join()

    @property
    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this worker holds now: all of it, or with
        ``train(shard_optimizer_state=True)`` its own slices' and its buddy copy's."""
        return self.state_bytes()

    @property
    def gradient_bytes(self) -> int:
        """Bytes of gradients this worker holds now. Between steps (in a callback, a logger)
        none with ``train(shard_optimizer_state=True)`` among several workers: they exist from a
        step's first backward to its update only; else the step buffer, which stays."""
        return self.grad_bytes()


_current: WorkerContext | None = None


def worker_context() -> WorkerContext | None:
    """This worker's context, or None outside a worker."""
    return _current


def _install(context: WorkerContext) -> None:
    global _current
    _current = context
