"""``deterministic=True`` for torch: the step's gradients and buffer deltas summed exactly.

:class:`ExactTorchAdapter` is the :class:`TorchAdapter` with three differences (see
docs/architecture.md, "Deterministic mode"):

- each micro-batch's gradient and buffer deltas are computed on their own (the float region of
  the step buffer is zeroed before it) and added to a fixed-point total (integers in float64)
  (:class:`~fabric_model.step.exact_sum.ExactSum`) instead of to each other in float32;
- the allreduce sums that total (exact, so its order does not matter) and takes the max
  of each tensor's largest exponent; if the agreed grid overflowed or was too coarse, every
  replica redoes the step's micro-batches (kept for that) on the new grid. Buckets are not sent
  during backward: the reduction needs the whole step;
- torch's deterministic algorithms are on; the intra-op thread count is chosen in the caller.

The grid's exponents are state (a resumed or joined replica must round as the others do):
:class:`~.exact_grid.ExactGrid` carries them in the optimizer state.
"""

from __future__ import annotations

import os

import torch

from ...step.exact_sum import ExactSum
from ..exact_grid import ExactGrid
from .adapter import TorchAdapter
from .steps.choice import Summing


def deterministic_kernels(device: str) -> None:
    """torch's deterministic algorithms (and cuDNN's and cuBLAS's on a GPU), before any kernel runs."""
    if device.startswith("cuda"):  # before cuBLAS starts: its deterministic workspace
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


class ExactTorchAdapter(ExactGrid, TorchAdapter):
    """A :class:`TorchAdapter` whose step sums are bitwise independent of how micro-batches are
    divided: its steps are :class:`~.steps.exact.ExactStep`; the grid they sum on is its state."""

    summing = Summing.EXACT

    def kernels(self, device: str) -> None:
        super().kernels(device)  # the caller's numerics, then what deterministic mode fixes
        deterministic_kernels(device)

    def setup(self, device: str, num_threads: int) -> None:
        self._exact: ExactSum | None = None
        super().setup(device, num_threads)

    def _allocate(self) -> None:
        super()._allocate()
        sizes = [p.numel() for p in self.params] + [b.numel() for b in self.model_buffers]
        previous = getattr(self, "_exact", None)
        self._exact = ExactSum(sizes, self.max_terms, self.device)
        if previous is not None:  # a fresh buffer after an abort keeps the agreed grid
            self._set_exponents(previous.exponents)

    def abort_step(self) -> None:
        super().abort_step()  # (its fresh step buffer keeps the current grid: _allocate)
        self._restore_step_grid()
