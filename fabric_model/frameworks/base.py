"""The interface every framework adapter implements; the worker loop only talks to this."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

import torch


class FrameworkAdapter(abc.ABC):
    """One framework's model, optimizer, loss and metrics, seen by the framework-neutral loop.

    A step is ``begin_step``, then ``train_micro_batch`` for each micro-batch this worker
    holds, then one in-place sum-allreduce of ``step_buffer``, then ``finish_step``. The
    buffer is a flat float32 ``torch.Tensor`` laid out as::

        [ gradients (already weighted by n_j / N) | forward-updated buffers (same weighting) |
          loss sum | metric sums ... | sample count | switch vote ]

    so a single collective carries everything a step needs (DESIGN §3).
    """

    #: Names of the statistics at the tail of the step buffer: "loss", metrics..., in order.
    stat_names: list[str]
    #: The user's model and optimizer, as the worker holds them (callbacks see these).
    model: Any
    optimizer: Any
    #: The worker's training dataset, handed to a custom step as ``train_loader``.
    train_set: Any = None

    @abc.abstractmethod
    def setup(self, device: str, num_threads: int) -> None:
        """Place the model on ``device`` and allocate the step buffer."""

    @abc.abstractmethod
    def collate(self, samples: Sequence[Any]) -> Any:
        """Turn a list of dataset samples into one batch (the user's ``fn_batch_collate`` if given)."""

    @abc.abstractmethod
    def begin_step(self, collective: Any = None) -> None:
        """Zero the step buffer and remember the step's starting buffer values. With a
        ``collective``, the last micro-batch may start reducing gradients during backward."""

    @abc.abstractmethod
    def all_reduce(self, collective: Any) -> None:
        """Sum the step buffer across the group (finishing what backward started)."""

    @abc.abstractmethod
    def train_micro_batch(self, batch: Any, num_samples: int, step_samples: int, seed: int, last: bool = False) -> None:
        """Forward and backward one micro-batch of ``num_samples`` out of the step's ``step_samples``.

        Adds the gradient of its mean loss, weighted by ``num_samples / step_samples``, to the
        buffer, after seeding the framework's RNG with ``seed``.
        """

    @property
    @abc.abstractmethod
    def step_buffer(self) -> torch.Tensor:
        """The flat buffer to sum-allreduce (see the class docstring)."""

    @abc.abstractmethod
    def finish_step(self) -> list[float]:
        """Apply the reduced buffer: set buffers, step the optimizer.

        Returns the buffer's tail: stat sums, sample count, switch vote."""

    @abc.abstractmethod
    def abort_step(self) -> None:
        """Undo what an unfinished step changed (forward-updated buffers), so it can be redone."""

    @abc.abstractmethod
    def load_state(self, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        """Take weights and optimizer state pulled from a peer."""

    @abc.abstractmethod
    def evaluate_batches(self, batches: Any) -> torch.Tensor:
        """Stat sums over an iterator of ``(indices, batch)`` test batches, float64 on the CPU."""

    @abc.abstractmethod
    def evaluate(self, batch: Any, num_samples: int) -> torch.Tensor:
        """Stat sums (loss, metrics..., count) over one test batch, as a float64 CPU tensor."""

    @abc.abstractmethod
    def model_state(self) -> dict[str, Any]:
        """Model weights, as CPU objects that pickle without the framework's model class."""

    @abc.abstractmethod
    def optimizer_state(self) -> dict[str, Any]:
        """Optimizer state (moments, step counts), as CPU objects."""


def metric_name(metric: Callable[..., Any], position: int, taken: set[str] | None = None) -> str:
    """A readable, unique name for a metric callable (its ``__name__`` or ``name``)."""
    name = getattr(metric, "name", None) or getattr(metric, "__name__", None) or f"metric_{position}"
    if name == "<lambda>":
        name = f"metric_{position}"
    taken = taken if taken is not None else set()
    base, suffix = str(name), 1
    while name in taken or name == "loss":
        suffix += 1
        name = f"{base}_{suffix}"
    taken.add(str(name))
    return str(name)
