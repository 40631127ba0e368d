"""Evaluating and predicting with the trained Keras model in the caller: the model comes back
compiled with the loss, optimizer and metrics given, so this is Keras' own ``evaluate`` / ``predict``."""

from __future__ import annotations

from typing import Any

from ...step.data import is_batch_level
from .adapter import split_keras_batch


def compile_trained(adapter: Any) -> None:
    """Compile the user's model as ``FabricModel`` was given it (the optimizer holds the trained state)."""
    adapter.model.compile(optimizer=adapter.optimizer, loss=adapter.loss_spec, metrics=list(adapter.metric_specs))


def _arrays(adapter: Any, dataset: Any) -> tuple[Any, Any]:
    return split_keras_batch(adapter.collate([dataset[i] for i in range(len(dataset))]))


def evaluate(adapter: Any, dataset: Any, batch_size: int) -> dict[str, float]:
    if is_batch_level(dataset):
        result = adapter.model.evaluate(dataset, verbose=0, return_dict=True)
    else:
        x, y = _arrays(adapter, dataset)
        result = adapter.model.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    return {k: float(v) for k, v in result.items()}


def predict(adapter: Any, dataset: Any, batch_size: int) -> Any:
    if is_batch_level(dataset):
        return adapter.model.predict(dataset, verbose=0)
    return adapter.model.predict(_arrays(adapter, dataset)[0], batch_size=batch_size, verbose=0)
