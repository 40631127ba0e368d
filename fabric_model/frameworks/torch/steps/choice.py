"""Which step strategy runs a generation: chosen once, from the generation's size and the run's options.

This is the one place that reads the step's options (docs/architecture.md, "Adding a step mode"):

===========================  ===========================  ============================
options                      a generation of one          a generation of several
===========================  ===========================  ============================
(none)                       :class:`.LoneStep`           :class:`.ReplicatedStep`
a custom step                :class:`.CustomStep`         :class:`.CustomStep`
deterministic, ordered sum   :class:`.OrderedLoneStep`    :class:`.OrderedStep`
deterministic, fixed point   :class:`.ExactStep`          :class:`.ExactStep`
the same, a custom step      :class:`.ExactCustomStep`    :class:`.ExactCustomStep`
===========================  ===========================  ============================

The update each uses is the state layout's (:meth:`~..sharded.WholeOptimizer.update`): the whole
optimizer, or this member's slices (``shard_optimizer_state=True``) with any of the above.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from ..step_buffer import StepBuffer
from .base import TorchStep
from .custom import CustomStep, ExactCustomStep
from .exact import ExactStep
from .lone import LoneStep
from .ordered import OrderedLoneStep, OrderedStep
from .replicated import ReplicatedStep


class Summing(Enum):
    """How a step's terms are summed: float32 in any order, or ``deterministic=True``'s two sums."""

    FLOAT = "float"
    ORDERED = "ordered"  # few micro-batches a step (steps/ordered.py)
    EXACT = "exact"  # fixed point (steps/exact.py)


def choose_step(adapter: Any, buffer: StepBuffer, world_size: int) -> TorchStep:
    """The strategy for a generation of ``world_size`` (0: no group) of ``adapter``'s run."""
    custom = adapter.step_fn is not None
    summing: Summing = adapter.summing
    lone = world_size == 1
    cls: type[TorchStep]
    if summing is Summing.EXACT:
        cls = ExactCustomStep if custom else ExactStep
    elif summing is Summing.ORDERED:
        cls = OrderedLoneStep if lone else OrderedStep
    elif custom:
        cls = CustomStep
    else:
        cls = LoneStep if lone else ReplicatedStep
    update = adapter.held_optimizer.update(adapter.grad_step, adapter.params, world_size)
    return cls(adapter, buffer, update, world_size)
