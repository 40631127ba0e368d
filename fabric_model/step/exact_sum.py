"""Exact, order-independent sums of float32 tensors in fixed point (``deterministic=True``).

Floating-point addition is not associative, so a sum of micro-batch gradients depends on which
worker added which and in what order the collective combined them. Here each micro-batch's
contribution is rounded once, on its own, to a fixed-point grid that every replica agrees on
before the step; sums of integers are exact and associative, so the step's total is the same
whatever the grouping. See docs/architecture.md, "Deterministic mode".

The integers are held in float64 (every integer below ``2**53`` is exact there, and float64
sums of them are exact): the rounding and the accumulation are then plain vector operations, and
the collective sums float64. The grid, per tensor: an exponent ``E`` (every value expected below
``2**E`` in magnitude) and ``guard`` bits for the number of terms, so each term is below
``2**(52 - guard)`` units and a sum of up to ``2**guard`` terms below ``2**52``. A term is
``round(x * 2**(52 - guard - E))``, computed in float32 (a power-of-two scaling is exact there).
Each step also takes each tensor's largest binary exponent (a max-allreduce: exact); after it,
every replica decides alike from those agreed maxima:

- overflow (a value reached ``2**E``), or fewer than ``PRECISION_BITS`` bits kept below the
  step's largest value: the step is redone on the grid ``E = max + HEADROOM_BITS``;
- the largest value fell more than ``2 * HEADROOM_BITS`` bits below ``E``: the next step uses
  ``E = max + HEADROOM_BITS`` (so the grid, and its cost, change only now and then);
- tensors whose values are all exactly 0 are exact on any grid and keep their ``E``.

``E`` is kept at or above ``MIN_EXPONENT``, so that ``2**(52 - guard - E)`` stays a float32;
a tensor whose values are all below ``2**MIN_EXPONENT`` is kept to that absolute grid.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

#: Growth of a tensor's largest value from one step to the next absorbed without a redo (256x).
HEADROOM_BITS = 8
#: Bits kept below each tensor's largest value, at least (float32 keeps 24): each term's rounding
#: error is at most 2**-25 of the largest. Typically ``52 - guard - HEADROOM_BITS`` (42 for 4 terms).
PRECISION_BITS = 24
#: The first step's guess (values below 1); a wrong guess costs one redo.
INITIAL_EXPONENT = 0
#: The smallest ``E``: ``2**(52 - guard - E)`` must stay below float32's largest power of two.
MIN_EXPONENT = -64
#: Bits of a float64 integer used by a sum.
SUM_BITS = 52
#: A tensor with no nonzero value this step.
NO_VALUE = -(1 << 20)
#: A tensor with an inf or NaN this step: the result is NaN, as a float sum would be.
NON_FINITE = 1 << 20


def guard_bits(max_terms: int) -> int:
    """Bits reserved so that ``max_terms`` terms cannot leave the exact range of float64."""
    bits = max(1, math.ceil(math.log2(max(2, max_terms))))
    if SUM_BITS - bits - HEADROOM_BITS < PRECISION_BITS:
        raise ValueError(f"deterministic=True sums at most 2**20 micro-batches a step; {max_terms} asked")
    return bits


class ExactSum:
    """Per-tensor fixed-point accumulation of a flat float32 region, tensor by tensor.

    Args:
        sizes: the elements of each tensor, in the region's order.
        max_terms: the most terms (micro-batches) a sum may have.
        device: where the sum lives (the collective's device).
    """

    def __init__(self, sizes: list[int], max_terms: int, device: torch.device) -> None:
        self.sizes = list(sizes)
        self.guard = guard_bits(max_terms)
        self.device = device
        n = len(self.sizes)
        self.exponents = torch.full((n,), INITIAL_EXPONENT, dtype=torch.int64)
        self._total = torch.zeros(sum(self.sizes), dtype=torch.float64, device=device)
        self.maxima = torch.full((n,), NO_VALUE, dtype=torch.int64, device=device)
        self._index = torch.repeat_interleave(torch.arange(n, device=device), torch.tensor(self.sizes, device=device))
        # Preallocated: a fresh multi-megabyte temporary per term costs more in page faults than the
        # arithmetic (an implicit float32 -> float64 promotion in add_ tripled the cost of a term).
        self._scratch = torch.empty(sum(self.sizes), dtype=torch.float32, device=device)
        self._scratch64 = torch.empty(sum(self.sizes), dtype=torch.float64, device=device)
        self._terms = 0  # terms added since zero(); the first is copied, not added
        self._in_place: list[torch.Tensor] = []  # the step's one term, rounded where it is (round_in_place)
        self.redos = 0  # steps redone, for the record
        self._set_scales()

    def _set_scales(self) -> None:
        self.exponents = self.exponents.clamp(min=MIN_EXPONENT)
        shifts = ((SUM_BITS - self.guard) - self.exponents).tolist()  # quantum of tensor t: 2**-shift
        # Python floats: a per-tensor scalar multiply reads no per-element scale array.
        self._scales = [2.0**shift for shift in shifts]
        self._unscales = [2.0**-shift for shift in shifts]

    def zero(self) -> None:
        """Start a new sum (a step, or its redo)."""
        self._terms, self._in_place = 0, []
        self.maxima.fill_(NO_VALUE)

    @property
    def total(self) -> torch.Tensor:
        """The sum so far, in float64 integers per tensor (what the collective reduces)."""
        if self._terms == 0:
            self._total.zero_()
            self._terms = -1  # zeroed: the next add adds
        return self._total

    @torch.no_grad()
    def add(self, region: torch.Tensor) -> None:
        """Round one term (a flat float32 tensor of all segments) onto the grid and add it."""
        segments = region.split(self.sizes)
        self._record_maxima(segments)
        for segment, scaled, scale in zip(segments, self._scratch.split(self.sizes), self._scales):
            torch.mul(segment, scale, out=scaled)  # exact: a power of two
        self._scratch.round_()  # the one rounding of this term (half to even)
        if self._terms == 0:  # exact: float32 integers are float64 integers
            self._total.copy_(self._scratch)
        else:
            self._scratch64.copy_(self._scratch)
            self._total.add_(self._scratch64)  # exact: integers below 2**53
        self._terms = max(self._terms, 0) + 1

    @torch.no_grad()
    def round_in_place(self, segments: Sequence[torch.Tensor]) -> None:
        """The whole sum when it has one term and no other replica (a lone worker's only
        micro-batch): each tensor (one per size, any shape: the parameters' own gradients, say)
        is rounded onto the grid where it is, in float32, which holds one term's integers
        exactly; ``write`` then leaves them as they are. Bitwise what ``add`` and ``write`` give,
        without the float64 round trip."""
        segments = list(segments)
        self._record_maxima(segments)
        torch._foreach_mul_(segments, self._scales)  # exact: powers of two
        _foreach_round_(segments)
        torch._foreach_mul_(segments, self._unscales)  # exact, as in write
        self._in_place = segments

    def _record_maxima(self, segments: Sequence[torch.Tensor]) -> None:
        """Each tensor's largest binary exponent, into the step's maxima."""
        # One aminmax per tensor: no |x| temporary, and a single pass (a scatter-amax would be
        # flagged by use_deterministic_algorithms on CUDA; an inf-norm is ten times slower on CPU).
        # NaN propagates through aminmax, so isfinite below sees it.
        lows, highs = zip(*(torch.aminmax(s) for s in segments))
        peaks = torch.maximum(torch.stack(highs), -torch.stack(lows))
        _, exponent = torch.frexp(peaks)  # peak = mantissa * 2**exponent, peak < 2**exponent
        exponent = exponent.to(torch.int64)
        exponent = torch.where(peaks == 0, NO_VALUE, exponent)
        exponent = torch.where(torch.isfinite(peaks), exponent, NON_FINITE)
        torch.maximum(self.maxima, exponent, out=self.maxima)

    def settle(self) -> bool:
        """After the totals and maxima were reduced: True if the sum stands, False to redo it.

        Either way the grid for what comes next is set from the step's maxima, the same on every replica."""
        maxima = self.maxima.cpu()
        valid = (maxima != NO_VALUE) & (maxima != NON_FINITE)
        target = (maxima + HEADROOM_BITS).clamp(min=MIN_EXPONENT)
        overflow = valid & (maxima > self.exponents)
        coarse = valid & ((SUM_BITS - self.guard) - (self.exponents - maxima) < PRECISION_BITS)
        coarse &= self.exponents != target  # at MIN_EXPONENT a redo would not help
        drifted = valid & (self.exponents - maxima > 2 * HEADROOM_BITS)
        self._written_unscales = self._unscales  # the grid this step's total is on
        if bool((overflow | coarse | drifted).any()):
            self.exponents = torch.where(overflow | coarse | drifted, target, self.exponents)
            self._set_scales()
        if bool((overflow | coarse).any()):
            self.redos += 1
            return False
        return True

    @torch.no_grad()
    def write(self, region: torch.Tensor) -> None:
        """The exact total (after ``settle`` accepted it) back to float32 into ``region``, rounded once;
        NaN where a term was not finite."""
        # Rounding the integer to float32, then scaling by a power of two, is rounding the value
        # once (no float32 underflow: MIN_EXPONENT keeps quanta far above 2**-126).
        bad = self.maxima == NON_FINITE
        if self._in_place:
            for i in bad.nonzero().flatten().tolist():
                self._in_place[i].fill_(float("nan"))
            return
        region.copy_(self.total)
        torch._foreach_mul_(list(region.split(self.sizes)), self._written_unscales)
        if bool(bad.any()):
            region.masked_fill_(bad[self._index], float("nan"))


def _foreach_round_(tensors: list[torch.Tensor]) -> None:
    """Round half to even, in place (one fused call where this torch has it)."""
    fused = getattr(torch, "_foreach_round_", None)
    if fused is not None:
        fused(tensors)
    else:
        for t in tensors:
            t.round_()
