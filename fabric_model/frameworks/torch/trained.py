"""The trained torch model in the caller: ``FabricModel.evaluate``/``predict`` and the ONNX export."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ...step.data import is_batch_level
from ..base import FrameworkAdapter, TrainedModel


class TorchTrainedModel(TrainedModel):
    """A trained ``torch.nn.Module``: torch.onnx's exporter, its outputs in eval mode, inference."""

    def onnx_requirements(self) -> tuple[str, ...]:
        """torch.onnx's exporter needs onnxscript."""
        return ("onnx", "onnxruntime", "onnxscript")

    def export_inputs(self, adapter: FrameworkAdapter, train_set: Any) -> Any:
        """The inputs of a real training batch (up to 4 samples) as training splits it (``adapter.call``),
        less a target the forward takes but does not need (a Hugging Face model's ``labels``): the file
        is for inference, and with the target it would need one to run and would output a loss."""
        from .calling import TARGET_KEYS, ModelCall

        if is_batch_level(train_set):
            batch = train_set[0]
        else:
            batch = adapter.collate([train_set[i] for i in range(min(len(train_set), 4))])
        call = getattr(adapter, "call", None)
        if not isinstance(call, ModelCall):  # an adapter without one: the call its model's forward implies
            call = ModelCall.of(getattr(adapter, "model", None), target_required=False)
        inputs, target = call.split(batch)
        if isinstance(inputs, Mapping) and target is not None:
            key = next((k for k in TARGET_KEYS if k in inputs and inputs[k] is target), None)
            if key is not None and key not in call.required:
                inputs = {k: v for k, v in inputs.items() if k != key}
        return inputs

    def write_onnx(self, model: Any, sample: Any, path: str) -> None:
        """torch.onnx.export over torch.export of the call training makes, every input's first dimension one
        shared dynamic batch."""
        from .export import export_torch

        export_torch(model, sample, path)

    def onnx_inputs(self, batch: Any, input_names: list[str]) -> list[Any]:
        """The batch's arrays by the file's input names (the export names them), else in order."""
        from .export import named_inputs

        found = named_inputs(batch)
        named = dict(found)
        if all(name in named for name in input_names):
            return [named[name] for name in input_names]
        return [x for _, x in found]

    def inference_outputs(self, model: Any, batch: Any) -> tuple[list[np.ndarray], list[str] | None]:
        """The model called as training calls it, in eval mode without autograd, its tensors flattened as the
        file's outputs are (same order)."""
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
