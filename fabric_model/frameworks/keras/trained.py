"""The trained Keras model in the caller: ``FabricModel.evaluate``/``predict`` and the ONNX export."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..base import FrameworkAdapter, TrainedModel


class KerasTrainedModel(TrainedModel):
    """A trained ``keras.Model`` or ``tf_keras`` model: Keras' exporter (or tf2onnx), its outputs with
    ``training=False``, inference."""

    def onnx_requirements(self) -> tuple[str, ...]:
        """Keras' exporter converts with tf2onnx."""
        return ("onnx", "onnxruntime", "tf2onnx")

    def write_onnx(self, model: Any, sample: Any, path: str) -> None:
        """Keras' exporter (or tf2onnx on a tf.function), leaving the process' environment as it was."""
        from .export import environ_kept, export_keras

        with environ_kept():
            export_keras(model, sample, path)

    def onnx_inputs(self, batch: Any, input_names: list[str]) -> list[Any]:
        """A dict batch by input name, else flattened as the model's Keras does."""
        from .export import keras_inputs
        from .framework import KerasFramework

        assert isinstance(self.framework, KerasFramework)
        return keras_inputs(batch, input_names, self.framework.flavor)

    def inference_outputs(self, model: Any, batch: Any) -> tuple[list[np.ndarray], list[str] | None]:
        """``model(batch, training=False)`` flattened; a dict's names, which the file's outputs carry."""
        from .export import keras_outputs

        return keras_outputs(model, batch)

    def grow_batch(self, sample: Any) -> Any:
        """Arrays and TensorFlow tensors grown by their first row."""
        from .export import grow_keras_batch

        return grow_keras_batch(sample)

    def evaluate(self, adapter: FrameworkAdapter, dataset: Any, batch_size: int) -> dict[str, float]:
        from .inference import evaluate

        return evaluate(adapter, dataset, batch_size)

    def predict(self, adapter: FrameworkAdapter, dataset: Any, batch_size: int) -> Any:
        from .inference import predict

        return predict(adapter, dataset, batch_size)
