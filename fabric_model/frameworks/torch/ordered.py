"""``deterministic=True`` for torch with few micro-batches a step: the float32 sum in micro-batch order.

Float addition is not associative, but it is deterministic: the same terms added in the same
order give the same bits. So instead of a fixed-point sum (:mod:`.exact`), every replica
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

from ..exact_grid import EXPONENTS_KEY
from .adapter import TorchAdapter
from .exact import deterministic_kernels
from .steps.choice import Summing

#: The most micro-batches a step may have for the ordered sum (more: the fixed-point sum).
MAX_TERMS = 4


class OrderedTorchAdapter(TorchAdapter):
    """A :class:`TorchAdapter` that sums the step's terms in micro-batch order on every replica
    (its steps: :class:`~.steps.ordered.OrderedLoneStep`, :class:`~.steps.ordered.OrderedStep`)."""

    summing = Summing.ORDERED
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

    def kernels(self, device: str) -> None:
        super().kernels(device)  # the caller's numerics, then what deterministic mode fixes
        deterministic_kernels(device)

    def load_state(self, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        # A checkpoint of the fixed-point sum (a run saved before this scheme existed) holds its grid.
        optimizer_state = {k: v for k, v in optimizer_state.items() if k != EXPONENTS_KEY}
        super().load_state(model_state, optimizer_state)
