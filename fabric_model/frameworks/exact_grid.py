"""What the torch and Keras adapters of ``deterministic=True`` share: the fixed-point grid as state.

The grid's exponents (:class:`~fabric_model.step.exact_sum.ExactSum`) must be the same on every
replica, so they travel in the optimizer state under :data:`EXPONENTS_KEY` (popped before the
framework sees it): checkpoints, snapshots and a newcomer's pull carry them. A mixin placed
before the framework's adapter (docs/architecture.md, "Deterministic mode").
"""

from __future__ import annotations

from typing import Any

import torch

from ..step.exact_sum import INITIAL_EXPONENT, ExactSum

#: The optimizer state's extra entry holding the fixed-point exponents (popped before the framework sees it).
EXPONENTS_KEY = "fabric_model_exact_exponents"


class ExactGrid:
    """The grid's life: made from a plain adapter, restored after an abort, saved and loaded."""

    max_terms: int = 1  # micro-batches in a step, at most (set in the caller)
    _exact: ExactSum | None = None
    _step_exponents: torch.Tensor | None = None  # the grid the current step started on

    @classmethod
    def from_adapter(cls, adapter: Any, max_terms: int) -> Any:
        """The same user objects, in deterministic mode."""
        exact = cls.__new__(cls)
        exact.__dict__.update(adapter.__dict__)
        exact.max_terms = max_terms
        return exact

    @property
    def exact_sum(self) -> ExactSum:
        """The step's fixed-point sum (set up in the worker)."""
        assert self._exact is not None
        return self._exact

    def _set_exponents(self, exponents: torch.Tensor) -> None:
        assert self._exact is not None
        self._exact.exponents = exponents.clone().to(torch.int64)
        self._exact._set_scales()

    def grid_step_begins(self) -> None:
        """A step starts on the current grid (kept until it ends, for an abort to go back to)."""
        self._step_exponents = self.exact_sum.exponents.clone()

    def grid_step_ends(self) -> None:
        self._step_exponents = None

    def _restore_step_grid(self) -> None:
        """An aborted step is undone, and so is a grid change a redo in it made on some replicas only."""
        if self._step_exponents is not None and self._exact is not None:
            self._set_exponents(self._step_exponents)
        self._step_exponents = None

    def load_state(self, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        optimizer_state = dict(optimizer_state)
        exponents = optimizer_state.pop(EXPONENTS_KEY, None)
        super().load_state(model_state, optimizer_state)  # type: ignore[misc]
        if self._exact is not None:  # (the caller's copy has no step buffer)
            # A state without a grid (the job's initial state, a run saved without
            # deterministic=True) starts from the first step's grid, as a fresh run does.
            initial = torch.full_like(self._exact.exponents, INITIAL_EXPONENT)
            self._set_exponents(initial if exponents is None else exponents)

    def optimizer_state(self) -> dict[str, Any]:
        state: dict[str, Any] = super().optimizer_state()  # type: ignore[misc]
        if self._exact is not None:
            state[EXPONENTS_KEY] = self._exact.exponents.clone()
        return state

    def _live_optimizer_state(self) -> dict[str, Any]:
        """The torch adapter's live optimizer state (for its replica fingerprint), with the grid."""
        state: dict[str, Any] = super()._live_optimizer_state()  # type: ignore[misc]
        if self._exact is not None:
            state[EXPONENTS_KEY] = self._exact.exponents
        return state
