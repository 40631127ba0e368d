"""Evaluating and predicting with the trained torch model in the caller (``FabricModel.evaluate`` / ``predict``)."""

from __future__ import annotations

from typing import Any

import torch

from ...inference import batches
from ...step.metrics import stat_means
from .batches import to_device


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters(), torch.zeros(())).device


def evaluate(adapter: Any, dataset: Any, batch_size: int) -> dict[str, float]:
    """Sample-weighted means of the loss and the metrics, in eval mode, as a validation computes them."""
    model, device = adapter.model, _device(adapter.model)
    names = ["loss"] + adapter.stat_names[1 : 1 + len(adapter.metrics)]
    sums = [0.0] * (len(names) + 1)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for n, batch in batches(adapter, dataset, batch_size):
                inputs, target = adapter.call.split(to_device(batch, device))
                output = adapter.call(model, inputs)
                values = [float(adapter.compute_loss(output, target))]
                values += [float(m(output, target)) for m in adapter.metrics]
                sums = [s + x * n for s, x in zip(sums, values + [1.0])]
    finally:
        model.train(training)
    return stat_means(names, sums)


def predict(adapter: Any, dataset: Any, batch_size: int) -> Any:
    """The model's outputs in eval mode, concatenated along dimension 0."""
    model, device = adapter.model, _device(adapter.model)
    training = model.training
    model.eval()
    outputs = []
    try:
        with torch.no_grad():
            for _, batch in batches(adapter, dataset, batch_size):
                outputs.append(adapter.call(model, adapter.call.split(to_device(batch, device))[0]))
    finally:
        model.train(training)
    return torch.cat(outputs) if outputs and isinstance(outputs[0], torch.Tensor) else outputs
