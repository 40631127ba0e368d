"""How a step's reduced gradient becomes new weights: the whole optimizer, or this member's slices.

The update is the state layout's half of a step (docs/architecture.md, "Adding a state layout"):
the object that holds the optimizer state (:class:`~..sharded.WholeOptimizer` or
:class:`~..sharded.ShardedOptimizer`) makes it for each generation, and every step strategy
uses it the same way: ``begin_gradients`` when the step starts, ``apply`` for the optimizer's
step, ``after`` once the update is applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ....profiling import phases as ph
from ..precision import GradientStep
from ..step_buffer import StepBuffer


class WholeUpdate:
    """Every member updates every parameter with the user's optimizer (a replicated state)."""

    def __init__(self, grad_step: GradientStep, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]):
        self.grad_step, self.optimizer, self.params = grad_step, optimizer, params
        #: A collective failure after this member's update was applied (the gather of updated
        #: slices): the step counts as done here, the loop raises it after (``failure_after_step``).
        self.failure: Exception | None = None

    def begin_gradients(self, buffer: StepBuffer) -> None:
        """The step's gradients start as zeros in the step buffer, each ``.grad`` its view."""
        buffer.materialize()
        buffer.flat.zero_()
        buffer.attach()

    def apply(self) -> None:
        """float16's unscale and overflow check, clipping, then the optimizer's step."""
        self.grad_step.apply(self.optimizer, self.params)

    def after(self, buffer: StepBuffer, collective: Any, phases: ph.Phases) -> None:
        """The update is applied: the gradients stay until the next step, as in a plain loop, and
        there is nothing to hand on (every member applied the whole update)."""

    def take_failure(self) -> Exception | None:
        failure, self.failure = self.failure, None
        return failure


class ShardedUpdate(WholeUpdate):
    """This member updates its slices (clipping still sees the whole gradient), then the updated
    slices are gathered. Among several members the step's gradients exist only from its first
    backward to its update (ZeRO stage 2: docs/elasticity.md, "Sharded optimizer state")."""

    def __init__(self, grad_step: GradientStep, sharded: Any, params: Sequence[torch.Tensor], world: int):
        super().__init__(grad_step, sharded.optimizer, params)
        self.sharded, self.transient = sharded, world > 1

    def begin_gradients(self, buffer: StepBuffer) -> None:
        if self.transient:  # made, zeroed, at the step's first backward (after its forward's peak)
            buffer.release()
        else:
            super().begin_gradients(buffer)

    def apply(self) -> None:
        self.sharded.step(lambda: self.grad_step.apply(self.optimizer, self.params))

    def after(self, buffer: StepBuffer, collective: Any, phases: ph.Phases) -> None:
        """The gradients given back (among several), then the gather of the updated slices."""
        if self.transient:  # its slices are updated: no one needs this member's gradients again
            buffer.release()
        if collective is None:
            return
        try:  # the update is applied to this member's slices: a failure from here leaves the step done
            with phases(ph.REDUCE):
                self.sharded.spread(collective)
        except Exception as exc:  # CollectiveError (imported with torch.distributed in a worker only)
            self.failure = exc
