"""IBM EDT's semantics for torch: the default accuracy, ``eva``, ``fn_test``'s value, the custom step's rules.

The accuracy a torch run shows when ``metrics`` is None, as IBM's EDT did.

IBM's scripts never pass ``metrics``: they read an accuracy from ``eva(outputs, labels)`` in
their ``fn_step_train`` and from their loggers. It is the argmax accuracy of a classifier
(outputs ``(N, C>1, ...)``, class-index targets ``(N, ...)``), a fraction in [0, 1]. Where it
cannot apply (a regression output), the run shows no accuracy rather than fail.
"""

from __future__ import annotations

from typing import Any

import torch

from .calling import primary_output


def accuracy(output: Any, target: torch.Tensor) -> torch.Tensor:
    """The fraction of samples whose highest output (its ``logits`` for a structured output) is the target class."""
    return (primary_output(output).argmax(dim=1) == target).float().mean()


accuracy.__name__ = "accuracy"  # the name the metrics show


def accuracy_applies(output: Any, target: Any) -> bool:
    """Whether ``output`` (or its ``logits``) is a classifier's (N, C>1, ...) and ``target`` holds class
    indices (N, ...)."""
    output = primary_output(output)
    if not (isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor)):
        return False
    if output.ndim < 2 or output.shape[1] < 2 or target.is_floating_point() or target.is_complex():
        return False
    return tuple(target.shape) == (output.shape[0], *output.shape[2:])


class Eva(list[Any]):
    """A custom step's ``eva``: IBM's ``eva(outputs, labels)`` (the first metric, else the default
    accuracy as a fraction), and still the list of metrics (``eva[0]``) this package passed before."""

    def __call__(self, output: Any, target: Any) -> Any:
        return self[0](output, target) if self else accuracy(output, target)


def test_result(result: Any) -> list[Any]:
    """``fn_test``'s value as [loss, metric...]: one number is the loss (IBM's); a pair is (metric, loss)."""
    if isinstance(result, (tuple, list)):
        if len(result) != 2:
            raise TypeError(
                f"Expected `fn_test` to return the mean loss or a (metric, loss) pair. Received: a "
                f"{type(result).__name__} of {len(result)} values"
            )
        return [result[1], result[0]]
    return [result]


def forbidden_step(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError(
        "fn_step_train called optimizer.step(): leave the step to fabric_model, which applies it once per global "
        "batch, after the gradients of all workers are summed. Call only loss.backward() (and clip, if you wish)."
    )
