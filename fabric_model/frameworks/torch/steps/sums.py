"""A step's stat sums (loss, metrics) and sample count: in the step buffer, or in Python.

Where the step reduces its buffer, a micro-batch adds ``[loss, metrics..., 1] * n`` to the
buffer's stat sums in one tensor operation. A lone CPU worker reduces nothing, so it adds them
in numpy float32 scalars instead (:class:`PythonSums`): the same roundings, without the tensor
operations that cost 10-20 us each inside a step on CPU (cold caches).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from ....profiling import phases as ph
from ..calling import detached
from ..step_buffer import StepBuffer


def _grad_mode(output: Any) -> contextlib.AbstractContextManager[Any]:
    # A structured output is not detached (calling.detached): no graph is recorded for its metrics.
    return contextlib.nullcontext() if isinstance(output, torch.Tensor) else torch.no_grad()


class TensorSums:
    """The sums in the step buffer's stat region, reduced with it."""

    def __init__(self, adapter: Any, buffer: StepBuffer) -> None:
        self.adapter, self.buffer = adapter, buffer  # (its bound part may change: read at each add)
        self.one = torch.ones((), device=adapter.device)

    def begin(self) -> None:
        """(The buffer's zeroing starts the sums.)"""

    def add(self, loss: torch.Tensor, output: Any, target: Any, n: int) -> None:
        """The micro-batch's loss, metrics (of the model's ``output``) and sample count into the step's sums."""
        adapter = self.adapter
        values = [loss.detach().float()]
        if adapter.metrics:
            output = detached(output)
            with adapter.phases(ph.METRICS), _grad_mode(output):
                values += [
                    torch.as_tensor(metric(output, target), dtype=torch.float32, device=adapter.device)
                    for metric in adapter.metrics
                ]
        values.append(self.one)
        # Multiply, then add, as value by value before: the same two roundings per sum.
        self.buffer.views.stats_and_count.add_(torch.stack(values) * n)

    def into(self, tail: list[float]) -> None:
        """(The tail read from the buffer holds them.)"""


class PythonSums:
    """The tensor path's ``sums += stack([loss, metrics..., 1]) * n`` in numpy float32 scalars.

    Each value is rounded to float32 once, as ``torch.as_tensor(v, dtype=float32)`` does, then
    multiplied and added in float32 (IEEE operations, correctly rounded): the same bits."""

    def __init__(self, adapter: Any, n_stats: int) -> None:
        self.adapter, self.n_stats = adapter, n_stats
        self.sums: list[np.float32] = []

    def begin(self) -> None:
        self.sums = [np.float32(0.0)] * (self.n_stats + 1)

    def add(self, loss: torch.Tensor, output: Any, target: Any, n: int) -> None:
        adapter = self.adapter
        n32 = np.float32(n)
        values = [loss.item()]
        if adapter.metrics:
            output = detached(output)
            with adapter.phases(ph.METRICS), _grad_mode(output):
                values += [float(metric(output, target)) for metric in adapter.metrics]
        values.append(1.0)
        self.sums = [s + np.float32(v) * n32 for s, v in zip(self.sums, values)]

    def into(self, tail: list[float]) -> None:
        """The sums and count over the tail's (zero) stat region, which starts it."""
        tail[: self.n_stats + 1] = map(float, self.sums)
