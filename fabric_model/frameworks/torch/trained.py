"""The trained torch model in the caller: ``FabricModel.evaluate``/``predict`` and the ONNX export."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...step.tree import leaves
from ..base import FrameworkAdapter, TrainedModel


class TorchTrainedModel(TrainedModel):
    """A trained ``torch.nn.Module``: torch.onnx's exporter, its outputs in eval mode, inference."""

    def onnx_requirements(self) -> tuple[str, ...]:
        """torch.onnx's exporter needs onnxscript."""
        return ("onnx", "onnxruntime", "onnxscript")

    def write_onnx(self, model: Any, sample: Any, path: str) -> None:
        """torch.onnx.export over torch.export, every input's first dimension one shared dynamic batch."""
        from .export import export_torch

        export_torch(model, sample, path)

    def onnx_inputs(self, batch: Any, input_names: list[str]) -> list[Any]:
        """The batch's tensors in order, dicts in insertion order (as the exporter flattened them)."""
        return leaves(batch)

    def inference_outputs(self, model: Any, batch: Any) -> tuple[list[np.ndarray], list[str] | None]:
        """``model(*batch)`` in eval mode without autograd, flattened; the file's outputs are in the same order."""
        from .export import torch_outputs

        return torch_outputs(model, batch), None

    def grow_batch(self, sample: Any) -> Any:
        """Tensors and arrays grown by their first row."""
        from .export import grow_torch_batch

        return grow_torch_batch(sample)

    def evaluate(self, adapter: FrameworkAdapter, dataset: Any, batch_size: int) -> dict[str, float]:
        from .inference import evaluate

        return evaluate(adapter, dataset, batch_size)

    def predict(self, adapter: FrameworkAdapter, dataset: Any, batch_size: int) -> Any:
        from .inference import predict

        return predict(adapter, dataset, batch_size)
