"""How a Keras model travels to the workers: its ``.keras`` file, the optimizer's config and state, the
custom objects and the metrics' configs, checked once in the caller by rebuilding the model as a
worker will (see docs/architecture.md, "Frameworks")."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .batches import split_keras_batch
from .flavor import KERAS3, Flavor

if TYPE_CHECKING:
    import torch


def model_to_bytes(model: Any) -> bytes:
    """The model's ``.keras`` file (architecture, weights), as bytes."""
    with tempfile.TemporaryDirectory(prefix="fabric-keras-") as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def model_from_bytes(data: bytes, custom_objects: dict[str, Any], flavor: Flavor = KERAS3) -> Any:
    """The model of a ``.keras`` file's bytes, loaded by ``flavor``'s Keras (Keras 2 and 3 both write the format)."""
    with tempfile.TemporaryDirectory(prefix="fabric-keras-") as tmp:
        path = os.path.join(tmp, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return flavor.load_model(path, custom_objects)


def shipped_custom_objects(user: dict[str, Any] | None, flavor: Flavor = KERAS3) -> dict[str, Any]:
    """The user's ``keras_custom_objects`` plus Keras' registry of
    ``@register_keras_serializable`` classes: a worker has not run the code that registered them."""
    objects = flavor.registered_objects()
    objects.update(user or {})
    return objects


def checked_form(
    model: Any,
    optimizer: Any,
    metric_specs: list[Any],
    custom_objects: dict[str, Any],
    first_batch: Any,
    flavor: Flavor = KERAS3,
) -> dict[str, Any]:
    """The shipped form (see :func:`shipped_form`), checked: run the model on the first batch, then
    rebuild it as a worker will and check that the rebuilt model computes the same outputs. Raises,
    before any worker starts, a ValueError when the model cannot take the batch and a TypeError
    pointing to ``keras_custom_objects`` when it cannot be rebuilt, or is rebuilt into a model that
    computes something else."""
    x, _ = split_keras_batch(first_batch)
    try:
        expected = _outputs(model, x, flavor)
    except Exception as exc:
        raise ValueError(
            f"The Keras model fails on the first training batch ({type(exc).__name__}: {str(exc)[:600]}). "
            f"Inputs received: {_describe(x)}. HINT: `datasets_function` must return samples (x, y) whose x the model "
            "takes once stacked into a batch (a dict of arrays keyed by input name for several inputs), or pass "
            "`fn_batch_collate` returning (x, y)."
        ) from exc
    custom = shipped_custom_objects(custom_objects, flavor)
    try:
        data = model_to_bytes(model)
        rebuilt = model_from_bytes(data, custom, flavor)
        rebuilt_optimizer = flavor.optimizer_from_config(flavor.optimizer_config(optimizer), custom)
        metric_configs(metric_specs, flavor)
        got = _outputs(rebuilt, x, flavor)
    except Exception as exc:
        raise TypeError(
            f"Could not rebuild the Keras model the way each worker must ({type(exc).__name__}: "
            f"{str(exc)[:600]}). HINT: pass keras_custom_objects={{'MyLayer': MyLayer, ...}} naming every custom "
            "layer, model, loss and metric class the model uses (a subclassed model's own class included), "
            "and give each a get_config() returning its constructor arguments."
        ) from exc
    worst = _max_difference(expected, got)
    if not worst <= 1e-5 * max(1.0, _max_abs(expected)):
        raise TypeError(
            f"The Keras model rebuilt from its saved form computes other outputs than `model` on the first "
            f"batch (max difference {worst:.3g}), so the workers would train another model. HINT: a custom "
            "layer's or model's get_config() must return every constructor argument that call() or build() "
            "uses, and from_config() must restore them; see keras_custom_objects."
        )
    return shipped_form(
        model, optimizer, metric_specs, custom_objects, data=data, config_of=rebuilt_optimizer, flavor=flavor
    )


def shipped_form(
    model: Any,
    optimizer: Any,
    metric_specs: list[Any],
    custom_objects: dict[str, Any],
    *,
    data: bytes | None = None,
    config_of: Any = None,
    flavor: Flavor = KERAS3,
) -> dict[str, Any]:
    """What travels instead of the live model, optimizer and metrics: the model's ``.keras`` bytes
    (``data`` if already made), the optimizer's config (``config_of``'s, if given) and state, the
    custom objects and the metrics' configs."""
    state = flavor.user_optimizer_state(optimizer, model.trainable_variables)
    return {
        "model": model_to_bytes(model) if data is None else data,
        "optimizer": flavor.optimizer_config(optimizer if config_of is None else config_of),
        "optimizer_state": None if state is None else [v.numpy() for v in state],
        "custom_objects": shipped_custom_objects(custom_objects, flavor),
        "metrics": metric_configs(metric_specs, flavor),
    }


def _outputs(model: Any, x: Any, flavor: Flavor) -> list[np.ndarray]:
    return [np.asarray(o) for o in flavor.flatten(model(x, training=False))]


def _max_abs(arrays: list[np.ndarray]) -> float:
    return max((float(np.max(np.abs(a), initial=0.0)) for a in arrays), default=0.0)


def _max_difference(ours: list[np.ndarray], theirs: list[np.ndarray]) -> float:
    if len(ours) != len(theirs) or any(a.shape != b.shape for a, b in zip(ours, theirs)):
        return float("inf")
    diffs = [np.abs(a.astype(np.float64) - b.astype(np.float64)) for a, b in zip(ours, theirs)]
    return max((float(np.max(d, initial=0.0)) for d in diffs), default=0.0)


def _describe(x: Any) -> str:
    """Shapes and dtypes of a batch's inputs, for error messages."""
    if isinstance(x, Mapping):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in x.items()) + "}"
    if isinstance(x, tuple | list):
        return f"{type(x).__name__} of {len(x)}: (" + ", ".join(_describe(v) for v in x) + ")"
    return f"array{tuple(np.shape(x))} {getattr(x, 'dtype', type(x).__name__)}"


def metric_configs(metrics: list[Any], flavor: Flavor = KERAS3) -> list[tuple[str, Any]]:
    """Metrics as they travel: names and callables as they are, Metric objects (which hold
    variables) as their Keras config."""
    keras = flavor.module()

    shipped: list[tuple[str, Any]] = []
    for m in metrics:
        if isinstance(m, keras.metrics.Metric):
            shipped.append(("config", keras.metrics.serialize(m)))
        else:
            shipped.append(("value", m))
    return shipped


def metrics_from_configs(shipped: list[tuple[str, Any]], custom: dict[str, Any], flavor: Flavor = KERAS3) -> list[Any]:
    keras = flavor.module()

    return [keras.metrics.deserialize(v, custom_objects=custom) if kind == "config" else v for kind, v in shipped]


def variables_state(variables: Sequence[Any]) -> dict[str, torch.Tensor]:
    """Variables as CPU torch tensors keyed by position and path (positions, not paths, are
    what match between processes: Keras numbers auto-named objects per process)."""
    import torch

    state = {}
    for i, v in enumerate(variables):
        array = np.asarray(v.numpy())
        if array.dtype == np.uint32:  # torch's uint32 support is partial; the value fits int64
            array = array.astype(np.int64)
        # copy(): keeps 0-d shapes, owns its memory
        state[f"{i:05d}:{variable_name(v)}"] = torch.from_numpy(array.copy())
    return state


def assign_all(variables: Sequence[Any], values: Sequence[Any], what: str) -> None:
    if len(variables) != len(values):
        raise ValueError(f"{what} state has {len(values)} variables; this {what} has {len(variables)}")
    for v, value in zip(variables, values):
        array = np.asarray(value)
        if tuple(array.shape) != tuple(v.shape):
            raise ValueError(
                f"{what} state for {variable_name(v)} has shape {array.shape}; the variable has {tuple(v.shape)}"
            )
        v.assign(array.astype(getattr(v.dtype, "as_numpy_dtype", v.dtype)))  # Keras 2's dtype is a tf.DType


def variable_name(variable: Any) -> str:
    """A variable's path (Keras 3) or name (Keras 2 and plain TensorFlow variables), for keys and messages."""
    return str(getattr(variable, "path", None) or variable.name)
