"""``deterministic=True`` for torch: the step's gradients and buffer deltas summed exactly.

:class:`ExactTorchAdapter` is the :class:`TorchAdapter` with three differences (see
docs/architecture.md, "Deterministic mode"):

- each micro-batch's gradient and buffer deltas are computed on their own (the float region of
  the step buffer is zeroed before it) and added to a fixed-point total (integers in float64)
  (:class:`~fabric_model.exact_sum.ExactSum`) instead of to each other in float32;
- the allreduce sums that total (exact, so its order does not matter) and takes the max
  of each tensor's largest exponent; if the agreed grid overflowed or was too coarse, every
  replica redoes the step's micro-batches (kept for that) on the new grid. Buckets are not sent
  during backward: the reduction needs the whole step;
- torch's deterministic algorithms are on; the intra-op thread count is chosen in the caller.

The grid's exponents are state (a resumed or joined replica must round as the others do): they
travel in the optimizer state under :data:`EXPONENTS_KEY`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..exact_sum import INITIAL_EXPONENT, ExactSum
from ..step_layout import StepResult
from .torch_adapter import TorchAdapter

#: The optimizer state's extra entry holding the fixed-point exponents (popped before torch sees it).
EXPONENTS_KEY = "fabric_model_exact_exponents"


class ExactTorchAdapter(TorchAdapter):
    """A :class:`TorchAdapter` whose step sums are bitwise independent of how micro-batches are divided."""

    max_terms: int = 1  # micro-batches in a step, at most (set in the caller)
    lone_direct = False  # every micro-batch's gradient goes through the step buffer, even alone

    @classmethod
    def from_adapter(cls, adapter: TorchAdapter, max_terms: int) -> ExactTorchAdapter:
        """The same user objects, in deterministic mode."""
        exact = cls.__new__(cls)
        exact.__dict__.update(adapter.__dict__)
        exact.max_terms = max_terms
        return exact

    def setup(self, device: str, num_threads: int) -> None:
        if device.startswith("cuda"):  # before cuBLAS starts: its deterministic workspace
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True)
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
        self._region.zero_()
        super().train_micro_batch(batch, num_samples, step_samples, seed, last=False)  # no overlap
        if alone and self._lone:  # the step's only term: rounded where it is (ExactSum.round_in_place)
            self._exact.round_in_place(self._region)
        else:
            self._exact.add(self._region)

    def all_reduce(self, collective: Any) -> None:
        """Sum the fixed-point totals and the float tail, max the exponents; redo the step on a new grid if asked."""
        assert self._exact is not None
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
            self._redo()

    def _redo(self) -> None:
        """Every replica decided alike (from agreed maxima): run this step's micro-batches again."""
        assert self._exact is not None
        # The reduced vote, summed again on the redo, is still > 0 exactly when some member voted.
        vote = float(self._flat[self._layout.vote])
        self._flat.zero_()
        self._exact.zero()
        with torch.no_grad():
            for b, start in zip(self._buffers, self._buf_start):
                b.copy_(start)
        for batch, num_samples, step_samples, seed in self._replay:
            self._exact_micro_batch(batch, num_samples, step_samples, seed, alone=len(self._replay) == 1)
        self._flat[self._layout.vote] = vote

    def finish_step(self) -> StepResult:
        self._replay, self._step_exponents = [], None
        return super().finish_step()

    def abort_step(self) -> None:
        # A redo decided in the interrupted step may have moved the grid on some replicas only:
        # the step is undone, so is its grid.
        start = getattr(self, "_step_exponents", None)
        super().abort_step()
        if start is not None and self._exact is not None:
            self._set_exponents(start)
        self._step_exponents = None

    def _set_exponents(self, exponents: torch.Tensor) -> None:
        assert self._exact is not None
        self._exact.exponents = exponents.clone().to(torch.int64)
        self._exact._set_scales()

    def load_state(self, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        optimizer_state = dict(optimizer_state)
        exponents = optimizer_state.pop(EXPONENTS_KEY, None)
        super().load_state(model_state, optimizer_state)
        exact = getattr(self, "_exact", None)
        if exact is not None:  # (the caller's copy has no step buffer)
            # A state without a grid (the job's initial state, a run saved without
            # deterministic=True) starts from the first step's grid, as a fresh run does.
            self._set_exponents(torch.full_like(exact.exponents, INITIAL_EXPONENT) if exponents is None else exponents)

    def optimizer_state(self) -> dict[str, Any]:
        state = super().optimizer_state()
        exact = getattr(self, "_exact", None)
        if exact is not None:
            state[EXPONENTS_KEY] = exact.exponents.clone()
        return state
