"""``FabricModel.evaluate`` and ``predict``: the trained model, in the caller's process
(docs/architecture.md, "Training features"). After ``train()`` the user's model holds the
trained weights, so evaluating it here needs no workers; the loss and metrics are those
given to ``FabricModel``, averaged over samples as validation averages them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .setup import checks as v
from .step.data import is_batch_level
from .streams.datasets import in_order


class InferenceMixin:
    """``evaluate`` and ``predict`` for :class:`~fabric_model.api.FabricModel`."""

    _framework: Any
    _trained_adapter: Any = None  # the caller's adapter, holding the user's trained model (set by train())
    datasets_function: Any

    def evaluate(self, dataset: Any = None, batch_size: int = 32) -> dict[str, float]:
        """The trained model's loss and metrics on ``dataset`` (default: the test dataset of
        ``datasets_function``), sample-weighted means keyed as in ``test_history``. Torch:
        in eval mode without gradients; Keras: ``model.evaluate`` (the model comes back compiled)."""
        adapter, dataset = self._inference_input("evaluate", dataset, batch_size)
        return dict(self._framework.trained.evaluate(adapter, dataset, batch_size))

    def predict(self, dataset: Any, batch_size: int = 32) -> Any:
        """The trained model's outputs on ``dataset``'s samples, in order, concatenated along the
        batch dimension (torch: a tensor on the model's device; Keras: ``model.predict``'s arrays).
        The samples' targets, if any, are ignored."""
        adapter, dataset = self._inference_input("predict", dataset, batch_size)
        return self._framework.trained.predict(adapter, dataset, batch_size)

    def _inference_input(self, method: str, dataset: Any, batch_size: Any) -> tuple[Any, Any]:
        if self._trained_adapter is None:
            raise RuntimeError(f"Nothing to {method} yet: call train() first; {method}() uses the trained model.")
        v.check_positive_int("batch_size", batch_size)
        if dataset is None:
            dataset = self.datasets_function()[1]
            if dataset is None:
                raise ValueError(
                    f"Expected `dataset` for {method}(): datasets_function returned no test dataset. Received: None"
                )
        dataset = in_order(dataset)  # a sharded one: its samples in the shards' order (docs/data.md)
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise TypeError(
                "Expected `dataset` to be a map-style dataset (__len__ and __getitem__) or a sharded one "
                f"(fabric_model.ShardedDataset, a Hugging Face IterableDataset). Received: {type(dataset)!r}"
            )
        return self._trained_adapter, dataset


def batches(adapter: Any, dataset: Any, batch_size: int) -> Iterator[tuple[int, Any]]:
    """``(samples, batch)`` in order: slices of ``batch_size`` samples collated by the adapter
    (the user's ``fn_batch_collate`` if given), or a batch-level dataset's own batches."""
    if is_batch_level(dataset):
        for i in range(len(dataset)):
            yield -1, dataset[i]
        return
    for start in range(0, len(dataset), batch_size):
        stop = min(start + batch_size, len(dataset))
        yield stop - start, adapter.collate([dataset[i] for i in range(start, stop)])
