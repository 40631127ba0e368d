"""The replicated step: gradients summed into the step buffer, its buckets reduced during backward.

Each parameter's ``.grad`` is a view into the step buffer. On this worker's last micro-batch of
the step, a gradient-ready hook launches each bucket's allreduce as soon as backward has
produced all of its gradients (last parameters first), so the reduction overlaps backward; the
tail (buffer deltas, flags, sums, count, votes) goes last, in one piece.
"""

from __future__ import annotations

from typing import Any

import torch

from ..step_buffer import StepBuffer
from .base import TorchStep
from .update import WholeUpdate

#: Gradient bucket size, in float32 elements (4 MiB), for overlapping the allreduce with
#: backward: big enough that per-operation overhead stays small, small enough that the first
#: buckets go out while backward still runs.
BUCKET_ELEMENTS = 1 << 20


def buckets_of(sizes: list[int], limit: int = BUCKET_ELEMENTS) -> tuple[list[tuple[int, int]], list[int]]:
    """Cut the gradient part of the buffer into buckets, last parameters first (backward
    produces their gradients first): each bucket's ``(start, end)`` and each parameter's bucket."""
    offsets, offset = [], 0
    for size in sizes:
        offsets.append(offset)
        offset += size
    buckets: list[tuple[int, int]] = []
    bucket_of = [0] * len(sizes)
    end, members = offset, []
    for i in reversed(range(len(sizes))):
        start = offsets[i]
        members.append(i)
        if end - start >= limit or i == 0:
            for m in members:
                bucket_of[m] = len(buckets)
            buckets.append((start, end))
            end, members = start, []
    return buckets, bucket_of


class ReplicatedStep(TorchStep):
    """The step of a generation of several (and of a custom or deterministic step alone)."""

    def __init__(self, adapter: Any, buffer: StepBuffer, update: WholeUpdate, world_size: int) -> None:
        super().__init__(adapter, buffer, update, world_size)
        self.buckets, self.bucket_of = buckets_of([p.numel() for p in self.params])
        self.bucket_sizes = [0] * len(self.buckets)
        for b in self.bucket_of:
            self.bucket_sizes[b] += 1
        self.overlap = False
        self.works: list[Any] = []
        self.launched, self.pending = 0, list(self.bucket_sizes)
        self.deferred_error: Exception | None = None
        self._hooks: list[Any] = []

    def activate(self) -> None:
        for i, p in enumerate(self.params):
            self._hooks.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: self.on_grad_ready(i)))

    def deactivate(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def begin_buffer(self) -> None:
        self.buffer.bind_full()
        self.works, self.launched, self.pending = [], 0, list(self.bucket_sizes)
        self.update.begin_gradients(self.buffer)

    def backward(self, loss: torch.Tensor, weight: float, last: bool) -> None:
        # On this worker's last micro-batch, buckets go out while backward still runs.
        self.overlap = last and self.collective is not None and self.collective.world_size > 1
        try:
            super().backward(loss, weight, last)
        finally:
            self.overlap = False

    def on_grad_ready(self, index: int) -> None:
        """A parameter received a gradient; on the last micro-batch, launch its bucket once full, in order."""
        self.got[index] = 1.0  # a list: a tensor element write per parameter costs microseconds
        if not self.overlap:
            return
        bucket = self.bucket_of[index]
        self.pending[bucket] -= 1
        try:
            while self.launched < len(self.buckets) and self.pending[self.launched] == 0:
                start, end = self.buckets[self.launched]
                self.works.append(self.collective.all_reduce_start(self.buffer.flat[start:end]))
                self.launched += 1
        except Exception as exc:  # raised out of autograd it would lose its type: keep it for all_reduce
            self.overlap, self.deferred_error = False, exc

    def all_reduce(self, collective: Any) -> None:
        """Finish the step's allreduce: the buckets not yet launched, in order, then the tail."""
        if self.deferred_error is not None:
            error, self.deferred_error = self.deferred_error, None
            raise error
        buffer = self.buffer
        buffer.materialize()
        if collective.world_size == 1:  # a group of one sums nothing: one call, not one per bucket
            collective.wait(collective.all_reduce_start(buffer.views.after_gradients))  # (still a fault seam)
            return
        while self.launched < len(self.buckets):
            start, end = self.buckets[self.launched]
            self.works.append(collective.all_reduce_start(buffer.flat[start:end]))
            self.launched += 1
        # The rest (buffer deltas, flags, stats, count, vote) in one piece, after the gradients.
        self.works.append(collective.all_reduce_start(buffer.views.after_gradients))
        for work in self.works:
            collective.wait(work)
        self.works = []
