"""A training dataset's own sampling: each epoch's order, and each micro-batch's weight in a step.

By default the plan draws each epoch's order from ``(seed, epoch)`` (:func:`plan.epoch_permutation`)
and a micro-batch weighs in a step's loss by its samples. A map-style training dataset may say
otherwise (docs/training.md, "A dataset's own order and weights"):

- ``dataset.epoch_order(epoch)``: the epoch's order, a permutation of ``range(len(dataset))``, the
  same in every worker and on every call (a sampler's order made ahead: ``FabricTrainer`` gives
  ``transformers.Trainer``'s);
- ``dataset.loss_weighting``: a :class:`Weighting`, such as :class:`ItemWeights` (a micro-batch
  weighs by the items its loss averages, a causal LM's tokens with labels) or
  :class:`MicroBatchWeights` (every micro-batch of a step weighs the same) or :class:`SummedLosses`.

Both are read once per worker; the plan's steps and micro-batches (which samples, in which
micro-batch) are unchanged, so every guarantee holds as with the default (docs/architecture.md,
"The step").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .plan import Plan, epoch_permutation


class EpochOrder:
    """The order in which an epoch visits the training samples; the last epoch's is kept."""

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples
        self._epoch = -1
        self._order = np.zeros(0, dtype=np.int64)

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._order, self._epoch = self.draw(epoch), epoch
        return self._order

    def draw(self, epoch: int) -> np.ndarray:
        raise NotImplementedError


class SeededOrder(EpochOrder):
    """The plan's own order: drawn from the run's seed and the epoch."""

    def __init__(self, seed: int, num_samples: int) -> None:
        super().__init__(num_samples)
        self.seed = seed

    def draw(self, epoch: int) -> np.ndarray:
        return epoch_permutation(self.seed, epoch, self.num_samples)


class DatasetOrder(EpochOrder):
    """The dataset's ``epoch_order(epoch)``, checked to be a permutation of its samples."""

    def __init__(self, dataset: Any, num_samples: int) -> None:
        super().__init__(num_samples)
        self.dataset = dataset

    def draw(self, epoch: int) -> np.ndarray:
        return checked_order(self.dataset.epoch_order(epoch), self.num_samples, epoch)


def checked_order(order: Sequence[int] | np.ndarray, num_samples: int, epoch: int) -> np.ndarray:
    """``order`` as an int64 array, or a ValueError saying how it is not a permutation."""
    array = np.asarray(order, dtype=np.int64).reshape(-1)
    if array.size != num_samples or (
        num_samples and (array.min() < 0 or array.max() >= num_samples or np.bincount(array).max() != 1)
    ):
        raise ValueError(
            f"Expected the training dataset's `epoch_order({epoch})` to be a permutation of "
            f"range({num_samples}) (every sample once). Received: {array.size} indices"
            + (f" from {array.min()} to {array.max()}." if array.size else ".")
        )
    return array


class Weighting:
    """How a micro-batch's loss weighs in its step: its weight over the step's total.

    The weight also weighs the micro-batch's loss and metrics in the step's and the epoch's
    averages, so the reported loss is the one the gradient follows."""

    def micro(self, indices: np.ndarray) -> float:
        """The weight of the micro-batch of these samples."""
        raise NotImplementedError

    def step_total(self, plan: Plan, order: EpochOrder, epoch: int, step: int) -> float:
        """The weights of every micro-batch of the step, summed (on every worker alike)."""
        raise NotImplementedError


class SampleWeights(Weighting):
    """A micro-batch weighs by its samples (the default): the step's loss is the mean over its samples."""

    micro = staticmethod(len)  # type: ignore[assignment]  # as cheap a call as the count was

    def step_total(self, plan: Plan, order: EpochOrder, epoch: int, step: int) -> float:
        return plan.step_samples(epoch, step)


class ItemWeights(Weighting):
    """A micro-batch weighs by the items its loss is the mean of, ``counts[i]`` for sample ``i``:
    the step's loss is the mean over every item of the step (``transformers.Trainer``'s
    ``num_items_in_batch``: tokens with a label, padding left out).

    The model's loss must be the micro-batch's mean over its items, as a Hugging Face model's is.
    A step without items (every label masked) changes nothing."""

    def __init__(self, counts: Sequence[float] | np.ndarray) -> None:
        self.counts = np.asarray(counts, dtype=np.float64).reshape(-1)
        if self.counts.size and (not np.all(np.isfinite(self.counts)) or self.counts.min() < 0):
            raise ValueError("Expected ItemWeights' counts to be finite and non-negative.")

    def micro(self, indices: np.ndarray) -> float:
        return float(self.counts[indices].sum())

    def step_total(self, plan: Plan, order: EpochOrder, epoch: int, step: int) -> float:
        perm = order.permutation(epoch)
        total = sum(
            self.micro(plan.micro_batch_indices(epoch, step, j, perm))
            for j in range(plan.num_micro_batches(epoch, step))
        )
        return total or 1.0  # (every share is 0 then)


class MicroBatchWeights(Weighting):
    """Every micro-batch of a step weighs the same, a short one too: the step's loss is the mean of
    its micro-batches' losses (``transformers.Trainer``'s loss divided by the accumulation steps)."""

    def micro(self, indices: np.ndarray) -> float:
        return 1.0

    def step_total(self, plan: Plan, order: EpochOrder, epoch: int, step: int) -> float:
        return float(plan.num_micro_batches(epoch, step))


class SummedLosses(Weighting):
    """Every micro-batch's loss weighs 1: the step's gradient is that of the sum of its
    micro-batches' losses (``transformers.Trainer``'s, for a model that takes loss keywords but
    averages its loss itself). The reported loss is the mean of the micro-batches' losses."""

    def micro(self, indices: np.ndarray) -> float:
        return 1.0

    def step_total(self, plan: Plan, order: EpochOrder, epoch: int, step: int) -> float:
        return 1.0


def order_of(dataset: Any, plan: Plan) -> EpochOrder:
    """The dataset's own order if it has one (``epoch_order``), else the plan's."""
    if callable(getattr(dataset, "epoch_order", None)):
        return DatasetOrder(dataset, plan.num_samples)
    return SeededOrder(plan.seed, plan.num_samples)


def weighting_of(dataset: Any, num_samples: int) -> Weighting:
    """The dataset's ``loss_weighting`` if it has one, else :class:`SampleWeights`."""
    weighting = getattr(dataset, "loss_weighting", None)
    if weighting is None:
        return SampleWeights()
    if not isinstance(weighting, Weighting):
        raise TypeError(
            "Expected the training dataset's `loss_weighting` to be a fabric_model.step.sampling.Weighting "
            f"(ItemWeights, MicroBatchWeights) or None. Received: {type(weighting).__name__}."
        )
    if isinstance(weighting, ItemWeights) and weighting.counts.size != num_samples:
        raise ValueError(
            f"Expected the training dataset's ItemWeights to hold one count per sample ({num_samples}). "
            f"Received: {weighting.counts.size} counts."
        )
    return weighting


def check_sampling(dataset: Any, num_samples: int) -> None:
    """In the caller, before any worker starts: the dataset's order for epoch 0 and its weighting."""
    order_of(dataset, Plan(num_samples, 1, 1, 0)).permutation(0)
    weighting_of(dataset, num_samples)
