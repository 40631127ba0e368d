"""``deterministic=True`` for torch with few micro-batches a step: the float32 sum in micro-batch order.

Float addition is not associative, but it is deterministic: the same terms added in the same
order give the same bits. So instead of a fixed-point sum (:mod:`.torch_exact`), every replica
gathers every micro-batch's own gradient and buffer deltas (a *term*, computed into the zeroed
float region of the step buffer) and adds them in the step's micro-batch order,
``((0 + c_0) + c_1) + ...``, which is exactly what a lone worker's backward accumulation
computes (with one +0.0 pass for the sign of zero). No rounding passes, no grid, no redo, and
float32's own precision. With at most two terms a step the plain allreduce already computes
it (two floats add alike in either order), so that common case exchanges nothing extra.

The price is the exchange: each worker receives the other workers' terms, ``(k - 1) *
ceil(m / k)`` float32 copies of the region for ``m`` micro-batches on ``k`` workers, where the
fixed-point sum's float64 ring allreduce receives ``2 * (k - 1) / k`` float64 copies. Up to
:data:`MAX_TERMS` micro-batches that is 3/4 to 1.5 times the bytes, and the rounding passes
are saved; beyond it the fixed-point sum is used. The choice depends on the run's
configuration only (never on the worker count), so a run is bitwise the same whatever its
membership. See docs/architecture.md, "Deterministic mode".
"""

from __future__ import annotations

from typing import Any

import torch

from ..exact_grid import EXPONENTS_KEY
from .adapter import TorchAdapter
from .exact import deterministic_kernels

#: The most micro-batches a step may have for the ordered sum (more: the fixed-point sum).
MAX_TERMS = 4
#: Up to this many terms a step, the plain float32 allreduce is already the ordered sum.
ALLREDUCE_TERMS = 2


class OrderedTorchAdapter(TorchAdapter):
    """A :class:`TorchAdapter` that sums the step's terms in micro-batch order on every replica."""

    # A lone worker's backward writes fresh gradients (as a plain loop's does, without zeroing and
    # adding into the step buffer); adding +0.0 at the end turns their -0.0 into +0.0, and then
    # (g_0 + g_1) + 0 has the bits of (0 + g_0) + g_1, the sum of terms each made in zeros.
    lone_direct = True
    whole_step_buffers_in_place = False  # start + change, as the gathered terms give it: the same bits
    max_terms: int = 1  # micro-batches in a step, at most (set in the caller)

    @classmethod
    def from_adapter(cls, adapter: TorchAdapter, max_terms: int) -> OrderedTorchAdapter:
        """The same user objects, in deterministic mode."""
        if adapter.step_fn is not None or max_terms > MAX_TERMS:
            raise ValueError("the ordered sum takes no custom step and at most MAX_TERMS micro-batches")
        ordered = cls.__new__(cls)
        ordered.__dict__.update(adapter.__dict__)
        ordered.max_terms = max_terms
        return ordered

    def setup(self, device: str, num_threads: int) -> None:
        deterministic_kernels(device)
        super().setup(device, num_threads)

    def load_state(self, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        # A checkpoint of the fixed-point sum (a run saved before this scheme existed) holds its grid.
        optimizer_state = {k: v for k, v in optimizer_state.items() if k != EXPONENTS_KEY}
        super().load_state(model_state, optimizer_state)

    def _allocate(self) -> None:
        super()._allocate()
        self._region = self._flat[: self._layout.n_gradients + self._layout.n_buffers]
        # Fresh after an abort too: an abandoned gather may still write into the old ones.
        self._terms_out: torch.Tensor | None = None
        self._terms_in: torch.Tensor | None = None

    def begin_step(self, collective: Any = None) -> None:
        super().begin_step(collective)
        self._world = int(getattr(collective, "world_size", 1) or 1)
        self._count_terms = 0
        if self._world > 1 and not self._two_terms:
            per_worker = -(-self.max_terms // self._world)  # rank r computes r, r + k, ... (plan)
            shape = (per_worker, self._region.numel())
            if self._terms_in is None or self._terms_in.shape != (self._world, *shape):
                self._terms_out = torch.zeros(shape, device=self.device)
                self._terms_in = torch.empty((self._world, *shape), device=self.device)

    @property
    def _two_terms(self) -> bool:
        # Two terms: a + b == b + a exactly, and x + 0 == x for a term (it holds no -0.0). So
        # whatever order or grouping the allreduce uses, with idle members adding zeros, it
        # computes (0 + c_0) + c_1, and the buckets may go out during backward as usual.
        return self.max_terms <= ALLREDUCE_TERMS

    def train_micro_batch(self, batch: Any, num_samples: int, step_samples: int, seed: int, last: bool = False) -> None:
        if self._two_terms:  # a worker of several has one term; a lone worker adds its two in order
            super().train_micro_batch(batch, num_samples, step_samples, seed, last=last)
            return
        alone = self._world == 1
        if not alone and self._count_terms:
            self._region.zero_()  # each term on its own (begin_step zeroed it for the first)
        super().train_micro_batch(batch, num_samples, step_samples, seed, last=False)  # no overlap: gathered
        if not alone:
            assert self._terms_out is not None
            self._terms_out[self._count_terms].copy_(self._region)
        self._count_terms += 1

    def _add_buffer_deltas(self, weight: float) -> None:
        # Multiply, then add: a fused multiply-add would round a term differently when it is
        # added to earlier terms (a lone worker) than when it is made on its own (a gathered term).
        live = self._live_buffers()
        for b, start, view, averaged in zip(live, self._buf_start, self._buf_views, self._buffer_averaged):
            delta = (b.detach() - start).to(torch.float32)
            view.add_(delta * weight if averaged else delta)

    def all_reduce(self, collective: Any) -> None:
        """Gather every worker's terms and add them in micro-batch order; sum the tail."""
        if self._world == 1:  # a lone worker: backward has added the terms in order
            if self._direct:
                torch._foreach_add_([p.grad for p in self._params if p.grad is not None], 0.0)
            return
        if self._two_terms:
            super().all_reduce(collective)
            return
        assert self._terms_out is not None and self._terms_in is not None
        self._terms_out[self._count_terms :].zero_()  # a short step: no term there (adds nothing)
        works = [
            collective.all_gather_start(self._terms_in, self._terms_out),
            collective.all_reduce_start(self._flat[self._region.numel() :]),  # flags, stats, count, vote
        ]
        for work in works:
            collective.wait(work)
        # Micro-batch i is rank i % k's term i // k (plan.assigned_micro_batches).
        per_worker = self._terms_in.shape[1]
        terms = [self._terms_in[i % self._world, i // self._world] for i in range(self._world * per_worker)]
        self._region.copy_(terms[0])  # a term holds no -0.0 (0 + g): copying it is adding it to 0
        for term in terms[1:]:
            self._region.add_(term)  # (a padding term is +0.0: adding it changes no bit)
