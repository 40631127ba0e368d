"""A micro-batch's size in floating-point operations, counted on the first batch in the caller.

The run's intra-op threads depend on it (orchestrator/run_setup.worker_threads): a step of a
few million FLOPs is a chain of small operations whose time is torch's dispatch, and a second
thread's fork and join at each parallel region then cost more than it saves, while the thread
spins on a core the driver and the worker's own threads need (docs/architecture.md, "Intra-op
threads"). The count is torch's own flop counter around the first-batch check's forward pass,
which runs anyway (frameworks/torch/first_batch.py): no extra pass over the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def counted(forward: Callable[[], T]) -> tuple[T, int | None]:
    """``forward()``'s result and the FLOPs torch's counter saw in it; None where the counter
    could not follow it (``forward`` is then called again without the counter, so that an error
    of the user's code is raised as itself)."""
    try:
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            result = forward()
        return result, int(counter.get_total_flops())
    except Exception:  # the counter's own failure, or the model's: the plain call tells which
        return forward(), None
