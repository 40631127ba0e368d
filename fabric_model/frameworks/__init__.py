"""Framework adapters. The framework is detected once, from the model, without importing
a framework the user does not use."""

from __future__ import annotations

from typing import Any


def detect_framework(model: Any) -> str:
    """``"torch"`` or ``"keras"``; raises TypeError for anything else."""
    for cls in type(model).__mro__:
        module = cls.__module__ or ""
        if module.startswith("torch.nn"):
            return "torch"
        if module.startswith(("keras", "tensorflow", "tf_keras")):
            return "keras"
    raise TypeError(
        "Expected `model` to be a torch.nn.Module or a tf.keras.Model. "
        f"Received: model of type {type(model).__module__}.{type(model).__qualname__}"
    )
