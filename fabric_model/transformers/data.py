"""The training data ``FabricTrainer`` hands FabricModel: Trainer's dataset and collator, with
Trainer's sampler order for each epoch and Trainer's loss normalisation as loss weights
(fabric_model/step/sampling.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..step.sampling import ItemWeights, MicroBatchWeights, SummedLosses, Weighting

#: The label Hugging Face losses ignore (padding, masked positions).
IGNORE_INDEX = -100


class TrainerData:
    """A map-style dataset: ``dataset``'s samples, visited in ``orders[epoch]``, weighted by ``weighting``."""

    def __init__(self, dataset: Any, orders: Sequence[np.ndarray], weighting: Weighting) -> None:
        self.dataset, self.orders, self.loss_weighting = dataset, list(orders), weighting

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[int(i)]

    def __getitems__(self, indices: Sequence[int]) -> Any:
        # A datasets.Dataset reads a whole micro-batch in one gather (as its DataLoader does).
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is None:
            return [self.dataset[int(i)] for i in indices]
        return getitems([int(i) for i in indices])

    def epoch_order(self, epoch: int) -> np.ndarray:
        return self.orders[epoch]


class TrainerDatasets:
    """``datasets_function`` for FabricModel: the training data and no test set (Trainer's
    evaluation runs in the caller, ``FabricTrainer.evaluate``)."""

    def __init__(self, data: TrainerData) -> None:
        self.data = data

    def __call__(self) -> tuple[TrainerData, None]:
        return self.data, None


def sampler_orders(dataloader: Any, epochs: int, num_samples: int) -> list[np.ndarray]:
    """The sample order Trainer's training DataLoader gives in each epoch: its batch sampler's
    indices, read without reading any sample, the epoch set as Trainer's loop sets it."""
    orders = []
    for epoch in range(epochs):
        if hasattr(dataloader, "set_epoch"):
            dataloader.set_epoch(epoch)
        inner: Any = getattr(getattr(dataloader, "batch_sampler", None), "batch_sampler", None)
        if hasattr(inner, "set_epoch"):
            inner.set_epoch(epoch)
        order = np.fromiter((int(i) for batch in dataloader.batch_sampler for i in batch), dtype=np.int64)
        if order.size != num_samples:
            raise ValueError(
                f"Expected Trainer's training sampler to visit each of the {num_samples} samples once an epoch "
                f"(FabricTrainer trains on whole epochs of the plan). Received: {order.size} indices in epoch {epoch}. "
                "HINT: leave `dataloader_drop_last` False and the sampler Trainer builds."
            )
        orders.append(order)
    return orders


class CountingCollator:
    """Trainer's collator, and each batch's ``num_items_in_batch``: its labels counted as Trainer
    counts them (ignored labels left out; a causal LM's shifted when its loss shifts them).

    The model then divides its summed loss by the micro-batch's own items, and FabricModel weighs
    the micro-batch by them over the step's (:class:`ItemWeights`): the step's loss is its summed
    loss over the step's items, as Trainer's is."""

    def __init__(self, collator: Any, shifts: bool) -> None:
        self.collator, self.shifts = collator, shifts

    def count(self, batch: Any) -> Any:
        if "shift_labels" in batch:
            labels = batch["shift_labels"]
        else:
            labels = batch["labels"][..., 1:] if self.shifts else batch["labels"]
        return (labels != IGNORE_INDEX).sum()

    def __call__(self, samples: list[Any]) -> Any:
        batch = self.collator(samples)
        batch["num_items_in_batch"] = self.count(batch)
        return batch


def loss_weighting(trainer: Any, dataset: Any, collator: Any) -> tuple[Weighting, Any]:
    """Trainer's normalisation of the loss across a step's micro-batches, and the collator that
    goes with it.

    Trainer passes ``num_items_in_batch`` to a model that takes loss keywords, when the batches
    hold ``labels``, and then adds the micro-batches' losses unscaled:

    - a model that divides its summed loss by it (a causal LM): the step's loss is its summed loss
      over the step's items, so the micro-batches weigh by their items (:class:`CountingCollator`);
    - a model that ignores it (a sequence classifier): the micro-batches' means are added
      (:class:`SummedLosses`).

    Otherwise Trainer divides each micro-batch's mean by the step's micro-batches."""
    first = collator([dataset[0]])
    if "labels" not in first or not trainer.model_accepts_loss_kwargs:
        return MicroBatchWeights(), collator
    counting = CountingCollator(collator, bool(getattr(trainer, "_loss_shifts_labels", False)))
    if not takes_item_count(trainer.model, first, counting.count(first)):
        return SummedLosses(), collator
    counts = np.zeros(len(dataset), dtype=np.float64)
    for i in range(len(dataset)):
        # Collated alone: padding a batch adds only ignored labels, so a sample's count is its own.
        counts[i] = float(counting.count(first if i == 0 else collator([dataset[i]])))
    return ItemWeights(counts), counting


def takes_item_count(model: Any, batch: Any, count: Any) -> bool:
    """Whether ``model``'s loss on ``batch`` is divided by the ``num_items_in_batch`` it is given:
    two forwards in evaluation mode, without gradients, with the count and twice it."""
    import torch

    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            device = next(model.parameters()).device
            inputs = {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}
            once = model(**inputs, num_items_in_batch=count).loss
            twice = model(**inputs, num_items_in_batch=count * 2).loss
    finally:
        model.train(training)
    return bool(torch.isclose(once, twice * 2, rtol=1e-3).item()) and not bool(torch.isclose(once, twice).item())
