"""A lone worker's step: backward writes fresh gradients, as in a plain loop.

A generation of one reduces nothing, so instead of adding into a zeroed step buffer, backward
writes fresh ``.grad`` tensors and the optimizer steps on them; the step buffer keeps only its
tail (buffer deltas, flags, sums, votes), and on a CPU the sums are added in Python
(docs/architecture.md, "The step"). No gradient hooks: no Python call per parameter, which on
CUDA is also a GIL handoff from autograd's device thread.
"""

from __future__ import annotations

from typing import Any

from ..step_buffer import StepBuffer
from .base import TorchStep
from .sums import PythonSums, TensorSums
from .update import WholeUpdate


class LoneStep(TorchStep):
    """The step of a generation of one, without a custom step or a deterministic sum."""

    buffers_in_place = True

    def __init__(self, adapter: Any, buffer: StepBuffer, update: WholeUpdate, world_size: int) -> None:
        super().__init__(adapter, buffer, update, world_size)
        self.fresh = True
        # Whether the steps write the lone buffer themselves: sums in the buffer always, buffer
        # deltas where a step has more than one micro-batch (``record_buffers``; one leaves the
        # buffers as its forward did). A step that did not, and that no code outside the step
        # wrote into (a vote: ``lent``), leaves it zero: the next neither zeroes it nor is its tail
        # read back (two tensor operations a step; on a CPU each costs microseconds inside a
        # step, docs/architecture.md).
        self.sums_in_buffer = not isinstance(self.sums, PythonSums)
        self.wrote = True  # (a buffer another strategy used first is zeroed once)
        layout = buffer.full_layout
        self.tail_size = layout.n_stats + 1 + layout.LOOP_SLOTS  # (the tail: step/layout.py)

    def make_sums(self) -> TensorSums | PythonSums:
        if self.adapter.device.type == "cpu":
            return PythonSums(self.adapter, self.buffer.full_layout.n_stats)
        return super().make_sums()

    def begin_buffer(self) -> None:
        buffer = self.buffer
        buffer.bind_lone()  # .grad None, as after zero_grad(set_to_none=True)
        if self.wrote or buffer.lent:
            buffer.views.after_gradients.zero_()  # the whole lone buffer
            buffer.lent = False
        self.wrote = self.sums_in_buffer

    def record_buffers(self, share: float) -> None:
        self.wrote = True
        super().record_buffers(share)

    def read_tail(self) -> list[float]:
        if self.wrote or self.buffer.lent:
            return super().read_tail()
        return [0.0] * self.tail_size  # what the zeroed tail holds

    def all_reduce(self, collective: Any) -> None:
        # A group of one sums nothing: one call, still a fault seam (a worker told to stop fails it).
        collective.wait(collective.all_reduce_start(self.buffer.views.after_gradients))
