"""Frameworks: each one's driver half (:class:`~.base.Framework`) and worker half
(:class:`~.base.FrameworkAdapter`). The framework is chosen once, from the model, without
importing a framework the user does not use."""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import Framework

# name -> (module, class), imported on first use.
_REGISTRY = {
    "torch": ("fabric_model.frameworks.torch.framework", "TorchFramework"),
    "keras": ("fabric_model.frameworks.keras.framework", "KerasFramework"),
    # Keras 2: the tf_keras package (tf.keras under TF_USE_LEGACY_KERAS=1), an optional extra.
    "tf_keras": ("fabric_model.frameworks.keras.framework", "TfKerasFramework"),
}
FRAMEWORKS = tuple(_REGISTRY)


@functools.cache
def framework_named(name: str) -> Framework:
    """The framework called ``name`` ("torch", "keras" or "tf_keras"); raises ValueError for anything else."""
    if name not in _REGISTRY:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, got {name!r}")
    module, cls = _REGISTRY[name]
    framework: Framework = getattr(importlib.import_module(module), cls)()
    return framework


def resolve_framework(framework: str | Framework) -> Framework:
    """``framework`` itself, or the framework of that name."""
    return framework_named(framework) if isinstance(framework, str) else framework


def framework_name(model: Any) -> str:
    """The name of ``model``'s framework, from the modules of its classes (importing nothing):
    "tf_keras" for a Keras 2 model (the ``tf_keras`` package), "keras" for Keras 3; raises
    TypeError for anything else."""
    for cls in type(model).__mro__:
        module = cls.__module__ or ""
        if module.startswith("torch.nn"):
            return "torch"
        if module == "tf_keras" or module.startswith("tf_keras."):
            return "tf_keras"
        if module.startswith(("keras", "tensorflow")):
            return "keras"
    raise TypeError(
        "Expected `model` to be a torch.nn.Module, a Keras 3 keras.Model or a Keras 2 tf_keras Model "
        "(tf.keras.Model). "
        f"Received: model of type {type(model).__module__}.{type(model).__qualname__}"
    )


def detect_framework(model: Any) -> Framework:
    """The framework of ``model`` (see :func:`framework_name`)."""
    return framework_named(framework_name(model))
