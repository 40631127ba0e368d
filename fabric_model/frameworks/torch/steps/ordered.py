"""``deterministic=True`` with few micro-batches a step: the float32 sum in micro-batch order.

Float addition is not associative, but it is deterministic: the same terms added in the same
order give the same bits. So instead of a fixed-point sum (:mod:`.exact`), every replica gathers
every micro-batch's own gradient and buffer deltas (a *term*, computed into the zeroed float
region of the step buffer) and adds them in the step's micro-batch order, ``((0 + c_0) + c_1) +
...``, which is exactly what a lone worker's backward accumulation computes (with one +0.0 pass
for the sign of zero). With at most two terms a step the plain allreduce already computes it
(two floats add alike in either order), so that common case exchanges nothing extra. Why this
costs what it does, and where the fixed-point sum takes over: :mod:`..ordered`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..step_buffer import StepBuffer
from .base import TorchStep
from .lone import LoneStep
from .replicated import ReplicatedStep
from .update import WholeUpdate

#: Up to this many terms a step, the plain float32 allreduce is already the ordered sum.
ALLREDUCE_TERMS = 2


class OrderedDeltas(TorchStep):
    """Buffer deltas multiplied, then added: a fused multiply-add would round a term differently
    when it is added to earlier terms (a lone worker) than when it is made on its own (a gathered term)."""

    def add_buffer_deltas(self, weight: float) -> None:
        adapter = self.adapter
        live = adapter.live_buffers()
        for b, start, view, averaged in zip(live, self.buf_start, self.buffer.views.buffers, adapter.buffer_averaged):
            delta = (b.detach() - start).to(torch.float32)
            view.add_(delta * weight if averaged else delta)


class OrderedLoneStep(OrderedDeltas, LoneStep):
    """Alone: backward adds the terms in order into fresh gradients; +0.0 turns their -0.0 into
    +0.0, and then (g_0 + g_1) + 0 has the bits of (0 + g_0) + g_1, the sum of terms each made in zeros."""

    buffers_in_place = False  # start + change, as the gathered terms give it: the same bits

    def all_reduce(self, collective: Any) -> None:
        torch._foreach_add_([p.grad for p in self.params if p.grad is not None], 0.0)


class OrderedStep(OrderedDeltas, ReplicatedStep):
    """Among several: every worker's terms gathered and added in micro-batch order."""

    def __init__(self, adapter: Any, buffer: StepBuffer, update: WholeUpdate, world_size: int) -> None:
        super().__init__(adapter, buffer, update, world_size)
        self.world = max(world_size, 1)
        self.max_terms = adapter.max_terms
        self.region = buffer.region
        # Two terms: a + b == b + a exactly, and x + 0 == x for a term (it holds no -0.0). So
        # whatever order or grouping the allreduce uses, with idle members adding zeros, it
        # computes (0 + c_0) + c_1, and the buckets may go out during backward as usual.
        self.gathers = self.world > 1 and self.max_terms > ALLREDUCE_TERMS
        self.terms_out: torch.Tensor | None = None
        self.terms_in: torch.Tensor | None = None
        if self.gathers:
            per_worker = -(-self.max_terms // self.world)  # rank r computes r, r + k, ... (plan)
            shape = (per_worker, self.region.numel())
            self.terms_out = torch.zeros(shape, device=adapter.device)
            self.terms_in = torch.empty((self.world, *shape), device=adapter.device)
        self.count_terms = 0

    def begin(self, collective: Any) -> None:
        super().begin(collective)
        self.count_terms = 0

    def micro_batch(self, batch: Any, num_samples: int, step_samples: int, seed: int, last: bool) -> None:
        if not self.gathers:  # a worker of several has one term; a lone worker adds its two in order
            self.compute(batch, num_samples, step_samples, seed, last)
            return
        assert self.terms_out is not None
        if self.count_terms:
            self.region.zero_()  # each term on its own (begin zeroed it for the first)
        self.compute(batch, num_samples, step_samples, seed, last=False)  # no overlap: gathered
        self.terms_out[self.count_terms].copy_(self.region)
        self.count_terms += 1

    def all_reduce(self, collective: Any) -> None:
        """Gather every worker's terms and add them in micro-batch order; sum the tail."""
        if self.world == 1:  # (no group: nothing to sum)
            return
        if not self.gathers:
            super().all_reduce(collective)
            return
        assert self.terms_out is not None and self.terms_in is not None
        self.terms_out[self.count_terms :].zero_()  # a short step: no term there (adds nothing)
        flat = self.buffer.flat
        works = [
            collective.all_gather_start(self.terms_in, self.terms_out),
            collective.all_reduce_start(flat[self.region.numel() :]),  # flags, stats, count, vote
        ]
        for work in works:
            collective.wait(work)
        # Micro-batch i is rank i % k's term i // k (plan.assigned_micro_batches).
        per_worker = self.terms_in.shape[1]
        terms = [self.terms_in[i % self.world, i // self.world] for i in range(self.world * per_worker)]
        self.region.copy_(terms[0])  # a term holds no -0.0 (0 + g): copying it is adding it to 0
        for term in terms[1:]:
            self.region.add_(term)  # (a padding term is +0.0: adding it changes no bit)
