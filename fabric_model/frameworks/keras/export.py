"""The Keras side of the ONNX export: Keras' exporter (or tf2onnx) and the model's own inference output.

Framework-neutral steps (staging, the fixed-batch check, onnxruntime's comparison) are in
:mod:`fabric_model.frameworks.export`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from ...step.tree import map_tree
from ..export import _error, _require, _to_numpy
from .flavor import Flavor, flavor_of


def keras_signature(model: Any, sample: Any) -> list[Any]:
    """Positional input signature for model.export: the sample's structure, every batch dimension None.

    Shapes and dtypes come from the model's declared inputs where it has them (Sequential with an Input,
    functional; they may also leave other dimensions open), else from the sample (subclassed models).
    """
    tf = importlib.import_module("tensorflow")
    try:
        declared = list(model.inputs or [])
    except (AttributeError, ValueError):  # subclassed or never-built models have no symbolic inputs
        declared = []
    by_name = {getattr(t, "name", None): t for t in declared}

    def spec(x: Any, name: str | None, declared_input: Any = None) -> Any:
        if declared_input is not None and len(declared_input.shape) == len(x.shape):
            shape = (None, *declared_input.shape[1:])
            dtype = declared_input.dtype
        else:
            shape = (None, *x.shape[1:])
            dtype = x.dtype
        return tf.TensorSpec(shape, tf.as_dtype(dtype), name=name)

    if isinstance(sample, dict):
        return [{key: spec(value, key, by_name.get(key)) for key, value in sample.items()}]
    if isinstance(sample, list | tuple):
        pairs = zip(sample, declared) if len(declared) == len(sample) else ((x, None) for x in sample)
        return [[spec(x, f"input_{i}", d) for i, (x, d) in enumerate(pairs)]]
    single = declared[0] if len(declared) == 1 else None
    return [spec(sample, getattr(single, "name", None) or "input", single)]


@contextlib.contextmanager
def environ_kept() -> Iterator[None]:
    """Undo os.environ changes made in the block.

    tf2onnx.convert sets TF_CPP_MIN_LOG_LEVEL=3 when imported (and TensorFlow sets TF2_BEHAVIOR, KMP_*...):
    an export must not change the environment of the training process and of the workers it starts later.
    """
    before = dict(os.environ)
    try:
        yield
    finally:
        after = dict(os.environ)  # undo key by key: what the block left alone stays untouched
        for key in after.keys() - before.keys():
            del os.environ[key]
        for key, value in before.items():
            if after.get(key) != value:
                os.environ[key] = value


def export_keras(model: Any, sample: Any, path: str) -> None:
    """Write ``model`` to ``path`` through a tf.function over a signature whose batch dimension is open."""
    flavor = flavor_of(model)
    name = flavor.name
    _require(flavor.package, name, model)
    tf = _require("tensorflow", name, model)
    if not flavor.is_model(model):
        raise _error(
            name, model, f"the model is not a {flavor.package}.Model (a bare layer or function cannot be exported)"
        )
    _require("onnx", name, model)
    # Both paths convert a tf.function with tf2onnx; import it here so its absence gets the install hint.
    tf2onnx = _require("tf2onnx.convert", name, model)
    if not model.built:
        # A subclassed model has no weights (and model.export refuses it) until it is called once.
        try:
            model(sample, training=False)
        except Exception as exc:
            raise _error(name, model, "the model fails on sample_input", exc) from exc
    signature = keras_signature(model, sample)
    try:
        with warnings.catch_warnings():
            # Keras' patch of tf2onnx for numpy 2 probes np.object, which numpy answers with a
            # FutureWarning on the user's screen: the probe is Keras' business, not the user's.
            warnings.filterwarnings("ignore", message=r"In the future `np\.object`", category=FutureWarning)
            if flavor.has_onnx_exporter():
                # Keras' own exporter traces call(training=False) over the signature and patches tf2onnx for
                # numpy 2; it wants an explicit signature for models that were never called.
                model.export(path, format="onnx", verbose=False, input_signature=signature)
            else:
                # tf2onnx.convert.from_keras fails on Keras 3 models (KeyError on 'keras_tensor_N'); a
                # tf.function over the same signature converts (Keras 2 models too, which have no exporter).
                function = tf.function(lambda *args: model(*args, training=False), input_signature=signature)
                tf2onnx.from_function(function, input_signature=signature, output_path=path)
    except Exception as exc:
        raise _error(
            name,
            model,
            "the model could not be traced and converted",
            exc,
            "call() must run inside a tf.function: TensorFlow/Keras ops only, no .numpy() or Python branches on "
            "tensor values; the dtype policy must be float32",
        ) from exc


def keras_outputs(model: Any, sample: Any) -> tuple[list[np.ndarray], list[str] | None]:
    """The model's outputs (training=False), flattened as its Keras does; a dict's keys, sorted, with them."""
    out = model(sample, training=False)
    names = sorted(out) if isinstance(out, dict) else None  # keras.tree and tf.nest flatten dicts by sorted key
    return [_to_numpy(x) for x in flavor_of(model).flatten(out)], names


def keras_inputs(batch: Any, input_names: list[str], flavor: Flavor) -> list[Any]:
    """A dict batch by the file's input names where it has them all, else flattened as ``flavor``'s Keras does."""
    if isinstance(batch, dict) and all(name in batch for name in input_names):
        return [batch[name] for name in input_names]
    return flavor.flatten(batch)


def grow_keras_batch(sample: Any) -> Any:
    """``sample`` with its first row repeated at the end (NumPy arrays and TensorFlow tensors)."""

    def grow(x: Any) -> Any:
        if isinstance(x, np.ndarray):
            return np.concatenate([x, x[:1]])
        tf = importlib.import_module("tensorflow")
        return tf.concat([x, x[:1]], axis=0)

    return map_tree(grow, sample)
