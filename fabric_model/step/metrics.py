"""Averaging the loss and metrics that steps report as sums (a leaf module: no torch).

A step's statistics travel as ``[sum_0, ..., sum_k, count]``: per-sample sums of the loss and
each metric, then the number of samples, so that averages over workers and over an epoch
are weighted by samples, whatever the split.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence


def stat_means(names: Sequence[str], sums: Sequence[float]) -> dict[str, float]:
    """Turn ``[sum_0, ..., sum_k, count]`` into ``{name: sum / count}``."""
    count = sums[-1]
    return {name: (float(s) / count if count else float("nan")) for name, s in zip(names, sums)}


def validation_means(names: Sequence[str], sums: Sequence[float]) -> dict[str, float]:
    """:func:`stat_means` of a validation, less the metrics it has no number for: a custom
    ``fn_test`` that returns the loss alone leaves its metric NaN, and ``metric=nan`` on the
    screen would say the model is broken when the script simply computed no metric (IBM's
    runtime showed none). The loss is always kept, NaN or not."""
    means = stat_means(names, sums)
    return {k: v for k, v in means.items() if k == names[0] or v == v}  # v != v: NaN


class EpochAverage:
    """Sample-weighted running sums of the loss and metrics over the current epoch."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.epoch = -1
        self._sums = [0.0] * (len(self.names) + 1)

    def add(self, epoch: int, sums: Sequence[float]) -> dict[str, float]:
        """Add a step's sums; returns the epoch's averages so far (a new ``epoch`` starts afresh)."""
        self.accumulate(epoch, sums)
        return stat_means(self.names, self._sums)

    def accumulate(self, epoch: int, sums: Sequence[float]) -> None:
        """:meth:`add` without the averages (a worker's every step needs none)."""
        if epoch != self.epoch:
            self.epoch, self._sums = epoch, [0.0] * (len(self.names) + 1)
        self._sums = list(map(operator.add, self._sums, map(float, sums)))  # (no Python frame a step)
