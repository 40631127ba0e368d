"""``deterministic=True``'s fixed-point step: the step's terms summed exactly (docs/architecture.md,
"Deterministic mode").

Each micro-batch's gradient and buffer deltas are computed on their own (the float region of the
step buffer zeroed before it) and added to a fixed-point total (integers in float64,
:class:`~fabric_model.step.exact_sum.ExactSum`) instead of to each other in float32. The
allreduce sums that total (exact, so its order does not matter) and takes the max of each
tensor's largest exponent; if the agreed grid overflowed or was too coarse, every replica redoes
the step's micro-batches (kept for that) on the new grid. Buckets are not sent during backward:
the reduction needs the whole step. The grid itself is state, the adapter's
(:class:`~..exact.ExactTorchAdapter`).
"""

from __future__ import annotations

from typing import Any

import torch

from ....step.layout import StepResult
from ..step_buffer import StepBuffer
from .replicated import ReplicatedStep
from .update import WholeUpdate


class ExactStep(ReplicatedStep):
    """The fixed-point sum's step, alone or among several."""

    #: Whether a lone worker's only term may be written fresh by backward (not a custom step's).
    fresh_alone = True

    def __init__(self, adapter: Any, buffer: StepBuffer, update: WholeUpdate, world_size: int) -> None:
        super().__init__(adapter, buffer, update, world_size)
        self.exact = adapter.exact_sum
        self.lone = world_size == 1
        self.region = buffer.region
        self.replay: list[tuple[Any, int, int, int]] = []

    def begin(self, collective: Any) -> None:
        self.fresh = False
        super().begin(collective)
        self.exact.zero()
        self.replay = []
        self.adapter.grid_step_begins()

    def micro_batch(self, batch: Any, num_samples: int, step_samples: int, seed: int, last: bool) -> None:
        self.replay.append((batch, num_samples, step_samples, seed))
        self._term(batch, num_samples, step_samples, seed, alone=last and len(self.replay) == 1)

    def _term(self, batch: Any, num_samples: int, step_samples: int, seed: int, alone: bool) -> None:
        buffer, exact = self.buffer, self.exact
        buffer.materialize()  # each term is made in the zeroed buffer (its forward too, here)
        # The step's only term (a lone worker, one micro-batch): backward writes fresh gradients,
        # as in a plain loop, and they are rounded where they are (ExactSum.round_in_place).
        self.fresh = alone and self.lone and self.fresh_alone
        if self.fresh:
            layout = buffer.layout
            buffer.flat[layout.n_gradients : self.region.numel()].zero_()
            for p in self.params:
                p.grad = None
        else:
            self.region.zero_()
        self.compute(batch, num_samples, step_samples, seed, last=False)  # no overlap
        if self.fresh:
            grads = [view.zero_() if p.grad is None else p.grad for p, view in zip(self.params, buffer.grad_views)]
            exact.round_in_place(grads + list(buffer.views.buffers))
        elif alone and self.lone:
            exact.round_in_place(self.region.split(exact.sizes))
        else:
            exact.add(self.region)

    def all_reduce(self, collective: Any) -> None:
        """Sum the fixed-point totals and the float tail, max the exponents; redo the step on a new grid if asked."""
        exact, flat, layout = self.exact, self.buffer.flat, self.buffer.layout
        # This member's own micro-batch count and vote, for a redo to sum again (not the sums).
        own = flat[layout.computed : layout.vote + 1].clone()
        while True:
            if collective.world_size > 1:
                works = [
                    collective.all_reduce_start(exact.total),
                    collective.all_reduce_max_start(exact.maxima),
                    collective.all_reduce_start(flat[self.region.numel() :]),  # flags, stats, count, vote
                ]
                for work in works:
                    collective.wait(work)
            if exact.settle():
                exact.write(self.region)
                return
            self._redo(own)

    def _redo(self, own: torch.Tensor) -> None:
        """Every replica decided alike (from agreed maxima): run this step's micro-batches again;
        ``own``: this member's micro-batch count and vote, as it wrote them before the allreduce."""
        flat, layout = self.buffer.flat, self.buffer.layout
        flat.zero_()
        self.exact.zero()
        with torch.no_grad():
            self.adapter.restore_buffers(self.buf_start)
        for batch, num_samples, step_samples, seed in self.replay:
            self._term(batch, num_samples, step_samples, seed, alone=len(self.replay) == 1)
        flat[layout.computed : layout.vote + 1] = own

    def finish(self) -> StepResult:
        self.replay = []
        self.adapter.grid_step_ends()
        return super().finish()
