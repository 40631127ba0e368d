"""A Keras custom step's gradients, taken from the optimizer's ``apply`` (docs/keras.md, "Custom steps").

A step written for one device ends with ``optimizer.apply_gradients(zip(grads, variables))``.
In a worker that call must change nothing: the step's gradient is the weighted sum of every
worker's micro-batches, applied once per global step, identically on every replica. So while
the user's code is traced, :func:`capturing` makes the job's optimizer record the gradients by
variable instead of applying them (as the torch custom step collects ``.grad`` and forbids
``optimizer.step()``); the adapter then weights, reduces and applies them.

Any *other* optimizer's ``apply`` fails while capturing: it would update this replica alone,
with its own state, and the replicas would silently part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from .flavor import flavor_of


class GradientCapture:
    """The gradients one micro-batch's user code handed the optimizer, by position in ``variables``."""

    def __init__(self, variables: Sequence[Any]) -> None:
        self._variables = list(variables)
        self._position: dict[int, int] = {}
        for i, v in enumerate(self._variables):
            self._position[id(v)] = i
            value = getattr(v, "value", None)  # a Keras variable's backend variable, if the code passed that
            if value is not None:
                self._position.setdefault(id(value), i)
        self.gradients: list[Any] = [None] * len(self._variables)
        self.applied = False  # whether the code called apply at all (with every gradient None, too)

    def add(self, grads: Sequence[Any], variables: Sequence[Any] | None, source: str) -> None:
        """Record ``grads`` for ``variables`` (None: the optimizer's own, the model's trainable variables)."""
        grads = list(grads)
        if variables is None:
            variables = self._variables
        variables = list(variables)
        if len(grads) != len(variables):
            raise ValueError(f"{source} received {len(grads)} gradient(s) for {len(variables)} variable(s).")
        self.applied = True
        for grad, variable in zip(grads, variables):
            i = self._position.get(id(variable))
            if i is None:
                raise ValueError(
                    f"{source} received a gradient for {_name(variable)}, which is not one of the model's trainable "
                    "variables. HINT: fabric_model trains the variables of the model it was given."
                )
            if grad is None:
                continue
            if self.gradients[i] is not None:
                raise ValueError(
                    f"{source} received a second gradient for {_name(variable)} in one step. fabric_model applies one "
                    "optimizer update per global batch: add the gradients and apply them once."
                )
            self.gradients[i] = grad


def _name(variable: Any) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", None) or variable)


@contextlib.contextmanager
def capturing(optimizer: Any, variables: Sequence[Any], who: str) -> Iterator[GradientCapture]:
    """Within the block, ``optimizer.apply`` / ``apply_gradients`` record into the capture yielded;
    any other optimizer of the same Keras raises when it applies. ``who`` names the user's code in messages."""
    capture = GradientCapture(variables)
    source = f"{who}'s optimizer.apply"

    def record(grads: Sequence[Any], trainable_variables: Sequence[Any] | None) -> None:
        capture.add(grads, trainable_variables, source)

    def refuse(other: Any) -> None:
        raise RuntimeError(
            f"{who} applied gradients with an optimizer other than the one given to FabricModel "
            f"({type(other).__name__}). Its update would reach this worker's replica alone. HINT: apply with "
            "model.optimizer (the optimizer given to FabricModel), or return the gradients: (metric, loss, grads)."
        )

    # Keras 3 records `apply` (apply_gradients calls it), Keras 2 `apply_gradients` (minimize calls it).
    with flavor_of(optimizer).intercepting(optimizer, record, refuse):
        yield capture
