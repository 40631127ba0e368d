"""Exact, order-independent sums of float32 tensors in int64 fixed point (``deterministic=True``).

Floating-point addition is not associative, so a sum of micro-batch gradients depends on which
worker added which and in what order the collective combined them. Here each micro-batch's
contribution is rounded once, on its own, to a fixed-point grid that every replica agrees on
before the step; integer sums are exact and associative, so the step's total is the same
whatever the grouping. See docs/architecture.md, "Deterministic mode".

The grid, per tensor: an exponent ``E`` (every value expected below ``2**E`` in magnitude) and
``guard`` bits for the number of terms, so each term is below ``2**(62 - guard)`` and the sum of
up to ``2**guard`` terms below ``2**62``. A term is ``round(x * 2**(62 - guard - E))``. The step
also records each tensor's largest binary exponent (a max-allreduce, exact); after the step:

- overflow (some value reached ``2**E``) or a grid too coarse (fewer than ``PRECISION_BITS`` bits
  below the step's largest value) makes every replica redo the step with ``E`` set from the
  step's maxima; the decision depends only on agreed values, so it is the same everywhere;
- otherwise ``E`` for the next step is the step's largest exponent plus ``HEADROOM_BITS``.

Tensors whose values are all exactly 0 are exact on any grid and keep their ``E``.
"""

from __future__ import annotations

import math

import torch

#: Growth of a tensor's largest value from one step to the next absorbed without a redo (256x).
HEADROOM_BITS = 8
#: Bits kept below each tensor's largest value, at least: each term's rounding error is at most
#: 2**-33 of the tensor's max (float32 keeps 24 bits).
PRECISION_BITS = 32
#: The first step's guess (values below 1); a wrong guess costs one redo.
INITIAL_EXPONENT = 0
#: A tensor with no nonzero value this step.
NO_VALUE = -(1 << 20)
#: A tensor with an inf or NaN this step: the result is NaN, as a float sum would be.
NON_FINITE = 1 << 20


def guard_bits(max_terms: int) -> int:
    """Bits reserved so that ``max_terms`` terms cannot overflow int64."""
    return max(1, math.ceil(math.log2(max(2, max_terms))))


class ExactSum:
    """Per-tensor fixed-point accumulation of a flat float32 region, segment by segment.

    Args:
        sizes: the elements of each tensor, in the region's order.
        max_terms: the most terms (micro-batches) a sum may have.
        device: where the accumulator lives (the collective's device).
    """

    def __init__(self, sizes: list[int], max_terms: int, device: torch.device) -> None:
        self.sizes = list(sizes)
        self.guard = guard_bits(max_terms)
        self.device = device
        n = len(self.sizes)
        self.exponents = torch.full((n,), INITIAL_EXPONENT, dtype=torch.int64)
        self.total = torch.zeros(sum(self.sizes), dtype=torch.int64, device=device)
        self.maxima = torch.full((n,), NO_VALUE, dtype=torch.int64, device=device)
        self._index = torch.repeat_interleave(torch.arange(n, device=device), torch.tensor(self.sizes, device=device))
        self.redos = 0  # steps redone, for the record
        self._set_scales()

    def _set_scales(self) -> None:
        shifts = (62 - self.guard) - self.exponents  # quantum of tensor t: 2**-shift
        self._scale = torch.pow(2.0, shifts.double()).to(self.device)[self._index]
        self._unscale = torch.pow(2.0, (-shifts).double()).to(self.device)[self._index]  # of this grid

    def zero(self) -> None:
        """Start a new sum (a step, or its redo)."""
        self.total.zero_()
        self.maxima.fill_(NO_VALUE)

    @torch.no_grad()
    def add(self, region: torch.Tensor) -> None:
        """Round one term (a flat float32 tensor of all segments) onto the grid and add it."""
        # One amax per tensor (a scatter-amax would be flagged by use_deterministic_algorithms on CUDA).
        peaks = torch.stack([s.abs().amax() for s in region.split(self.sizes)])
        mantissa, exponent = torch.frexp(peaks)  # peak = mantissa * 2**exponent, peak < 2**exponent
        exponent = exponent.to(torch.int64)
        exponent = torch.where(peaks == 0, NO_VALUE, exponent)
        exponent = torch.where(torch.isfinite(peaks), exponent, NON_FINITE)
        torch.maximum(self.maxima, exponent, out=self.maxima)
        self.total += torch.round(region.double() * self._scale).to(torch.int64)

    def settle(self) -> bool:
        """After the totals and maxima were reduced: True if the sum stands, False to redo it.

        Either way the exponents are set from the step's maxima (the same on every replica)."""
        maxima = self.maxima.cpu()
        valid = (maxima != NO_VALUE) & (maxima != NON_FINITE)
        overflow = valid & (maxima > self.exponents)
        coarse = valid & ((62 - self.guard) - (self.exponents - maxima) < PRECISION_BITS)
        self._written_unscale = self._unscale  # the grid this step's total is on
        self.exponents = torch.where(valid, maxima + HEADROOM_BITS, self.exponents)
        self._set_scales()
        if bool((overflow | coarse).any()):
            self.redos += 1
            return False
        return True

    @torch.no_grad()
    def write(self, region: torch.Tensor) -> None:
        """The exact total (after ``settle`` accepted it) back to float32 into ``region``, rounded once;
        NaN where a term was not finite."""
        region.copy_(self.total.double() * self._written_unscale)
        bad = (self.maxima == NON_FINITE)[self._index]
        region.masked_fill_(bad, float("nan"))
