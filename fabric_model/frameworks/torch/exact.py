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
from typing import Any

import torch

from ...step.exact_sum import ExactSum
from ...step.layout import StepResult
from ..exact_grid import ExactGrid
from .adapter import TorchAdapter


def deterministic_kernels(device: str) -> None:
    """torch's deterministic algorithms (and cuDNN's and cuBLAS's on a GPU), before any kernel runs."""
    if device.startswith("cuda"):  # before cuBLAS starts: its deterministic workspace
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


class ExactTorchAdapter(ExactGrid, TorchAdapter):
    """A :class:`TorchAdapter` whose step sums are bitwise independent of how micro-batches are divided."""

    lone_direct = False  # every micro-batch's gradient goes through the step buffer, even alone
    whole_step_buffers_in_place = False

    def setup(self, device: str, num_threads: int) -> None:
        deterministic_kernels(device)
        self._exact: ExactSum | None = None
        self._loaded_exponents: torch.Tensor | None = None
        super().setup(device, num_threads)

    def _allocate(self) -> None:
        super()._allocate()
        sizes = [p.numel() for p in self._params] + [b.numel() for b in self._buffers]
        previous = getattr(self, "_exact", None)
        self._exact = ExactSum(sizes, self.max_terms, self.device)
        if previous is not None:  # a fresh buffer after an abort keeps the agreed grid
            self._set_exponents(previous.exponents)
        self._region = self._flat[: self._layout.n_gradients + self._layout.n_buffers]

    def begin_step(self, collective: Any = None) -> None:
        super().begin_step(collective)
        self._lone = getattr(collective, "world_size", 0) == 1
        assert self._exact is not None
        self._exact.zero()
        self._replay: list[tuple[Any, int, int, int]] = []
        self._step_exponents: torch.Tensor | None = self._exact.exponents.clone()

    def train_micro_batch(self, batch: Any, num_samples: int, step_samples: int, seed: int, last: bool = False) -> None:
        self._replay.append((batch, num_samples, step_samples, seed))
        self._exact_micro_batch(batch, num_samples, step_samples, seed, alone=last and len(self._replay) == 1)

    def _exact_micro_batch(self, batch: Any, num_samples: int, step_samples: int, seed: int, alone: bool) -> None:
        assert self._exact is not None
        self._materialize()  # each term is made in the zeroed buffer (its forward too, here)
        # The step's only term (a lone worker, one micro-batch): backward writes fresh gradients,
        # as in a plain loop, and they are rounded where they are (ExactSum.round_in_place).
        self._direct = alone and self._lone and self.step_fn is None
        if self._direct:
            self._flat[self._layout.n_gradients : self._region.numel()].zero_()
            for p in self._params:
                p.grad = None
        else:
            self._region.zero_()
        super().train_micro_batch(batch, num_samples, step_samples, seed, last=False)  # no overlap
        if self._direct:
            grads = [view.zero_() if p.grad is None else p.grad for p, view in zip(self._params, self._grad_views)]
            self._exact.round_in_place(grads + list(self._buf_views))
        elif alone and self._lone:
            self._exact.round_in_place(self._region.split(self._exact.sizes))
        else:
            self._exact.add(self._region)

    def all_reduce(self, collective: Any) -> None:
        """Sum the fixed-point totals and the float tail, max the exponents; redo the step on a new grid if asked."""
        assert self._exact is not None
        # This member's own micro-batch count and vote, for a redo to sum again (not the sums).
        layout = self._layout
        own = self._flat[layout.computed : layout.vote + 1].clone()
        while True:
            if collective.world_size > 1:
                works = [
                    collective.all_reduce_start(self._exact.total),
                    collective.all_reduce_max_start(self._exact.maxima),
                    collective.all_reduce_start(self._flat[self._region.numel() :]),  # flags, stats, count, vote
                ]
                for work in works:
                    collective.wait(work)
            if self._exact.settle():
                self._exact.write(self._region)
                return
            self._redo(own)

    def _redo(self, own: torch.Tensor) -> None:
        """Every replica decided alike (from agreed maxima): run this step's micro-batches again;
        ``own``: this member's micro-batch count and vote, as it wrote them before the allreduce."""
        assert self._exact is not None
        self._flat.zero_()
        self._exact.zero()
        with torch.no_grad():
            self._restore_buffers(self._buf_start)
        for batch, num_samples, step_samples, seed in self._replay:
            self._exact_micro_batch(batch, num_samples, step_samples, seed, alone=len(self._replay) == 1)
        self._flat[self._layout.computed : self._layout.vote + 1] = own

    def finish_step(self) -> StepResult:
        self._replay, self._step_exponents = [], None
        return super().finish_step()

    def abort_step(self) -> None:
        super().abort_step()  # (its fresh step buffer keeps the current grid: _allocate)
        self._restore_step_grid()
