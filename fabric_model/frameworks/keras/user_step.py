"""The user's own Keras step: ``fn_step_train`` / ``fn_test``, or a ``keras.Model`` subclass's ``train_step``
(docs/keras.md, "Custom steps").

- How they travel: ``fn_step_train``, ``fn_test`` and ``fn_args`` are pickled together, apart from
  the job, with the user's model and optimizer replaced by references (:func:`pack_user_code`),
  which a worker resolves to its rebuilt model and optimizer (:func:`unpack_user_code`). So a step
  that names the script's ``optimizer`` or ``model`` (a global or a closure, as on one device)
  reaches the worker's own, not a copy.
- How they run: traced in the adapter's micro-batch ``tf.function``, as ``fit`` traces
  ``train_step``, with the optimizer's ``apply`` capturing the gradients (:mod:`.capture`).
- What they return: ``fn_step_train`` ``(metric, loss)`` after applying its gradients, or
  ``(metric, loss, gradients)``; a ``train_step`` its logs, read by name.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import pickle
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .capture import capturing
from .flavor import KERAS3, Flavor, flavor_of
from .names import ACCURACY_NAMES, accuracy_for


@dataclasses.dataclass
class UserCode:
    """``fn_step_train``, ``fn_test`` and ``fn_args`` as given (None where not given)."""

    step_fn: Callable[..., Any] | None = None
    test_fn: Callable[..., Any] | None = None
    fn_args: Any = None


def overridden(model: Any, name: str) -> bool:
    """Whether ``model``'s class overrides ``keras.Model``'s (or ``tf_keras.Model``'s) method ``name``
    (``train_step``, ``compute_loss``)."""
    return getattr(type(model), name, None) is not flavor_of(model).model_method(name)


def computes_own_loss(model: Any) -> bool:
    """Whether ``model``'s class overrides ``train_step`` or ``compute_loss``: it may train without a
    ``loss_function`` (docs/keras.md, "Custom steps")."""
    return overridden(model, "train_step") or overridden(model, "compute_loss")


# -- how the user's code travels --------------------------------------------------------------
def _pickler_class() -> type:
    # The job's pickler, which keeps each function's file for the worker's tracebacks.
    from ..shipping import JobPickler

    return JobPickler


def pack_user_code(code: UserCode, live: dict[str, Any]) -> bytes:
    """``code`` pickled with each object of ``live`` (name -> the user's model, optimizer) as a reference."""
    by_id = {id(obj): name for name, obj in live.items() if obj is not None}

    class Pickler(_pickler_class()):  # type: ignore[misc]
        def persistent_id(self, obj: Any) -> str | None:
            return by_id.get(id(obj))

    buffer = io.BytesIO()
    Pickler(buffer).dump(code)
    return buffer.getvalue()


def unpack_user_code(data: bytes, live: dict[str, Any]) -> UserCode:
    """The user's code, its references resolved to ``live``'s objects (the worker's model, optimizer)."""

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            return live[pid]

    code = Unpickler(io.BytesIO(data)).load()
    assert isinstance(code, UserCode)
    return code


# -- metrics ----------------------------------------------------------------------------------
def metric_value(metric: Any, y_true: Any, y_pred: Any, flavor: Flavor = KERAS3) -> Any:
    """``metric``'s value on one batch, a float32 scalar tensor: a ``keras.metrics.Metric`` from a
    fresh state, a function's mean; ``"accuracy"`` is the accuracy ``compile`` picks for the shapes."""
    import tensorflow as tf

    if isinstance(metric, str) and metric in ACCURACY_NAMES:
        metric = accuracy_for(tf.TensorShape(np.shape(y_true)), tf.TensorShape(np.shape(y_pred)), flavor)
    if isinstance(metric, flavor.module().metrics.Metric):
        metric.reset_state()
        metric.update_state(y_true, y_pred)
        return tf.cast(metric.result(), tf.float32)
    return tf.reduce_mean(tf.cast(metric(y_true, y_pred), tf.float32))


class Eva(list[Any]):
    """A Keras custom step's ``eva(y_true, y_pred)`` (Keras' argument order): the first metric given,
    else the accuracy for the shapes; ``eva[i]`` is the i-th metric given."""

    def __init__(self, metrics: Sequence[Any] = (), flavor: Flavor = KERAS3) -> None:
        super().__init__(metrics)
        self.flavor = flavor

    def __call__(self, y_true: Any, y_pred: Any) -> Any:
        return metric_value(self[0] if self else "accuracy", y_true, y_pred, self.flavor)


# -- running it -------------------------------------------------------------------------------
def _unwrapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    # A tf.function's own Python, traced inside the adapter's: a nested function's tensors (the
    # captured gradients) would be out of reach of the outer graph.
    return getattr(fn, "python_function", fn)


def run_custom_step(
    step_fn: Callable[..., Any],
    model: Any,
    optimizer: Any,
    variables: Sequence[Any],
    data: tuple[Any, Any],
    eva: Eva,
    train_set: Any,
    fn_args: Any,
) -> tuple[list[Any], Any, Any]:
    """Call ``fn_step_train(model, data, eva, train_set, fn_args)`` while tracing; return its gradients
    by position in ``variables`` (None where it gave none), its metric and its loss."""
    with capturing(optimizer, variables, "fn_step_train") as capture:
        result = _unwrapped(step_fn)(model, data, eva, train_set, fn_args)
    if not isinstance(result, tuple | list) or len(result) not in (2, 3):
        raise TypeError(
            "Expected `fn_step_train` to return (metric, loss), or (metric, loss, gradients) without applying them. "
            f"Received: {type(result).__name__}{'' if not isinstance(result, tuple | list) else f' of {len(result)}'}"
        )
    metric, loss = result[0], result[1]
    if len(result) == 3:
        if capture.applied:
            raise ValueError(
                "fn_step_train both applied its gradients and returned them. HINT: do one: "
                "optimizer.apply_gradients(...) and return (metric, loss), or return (metric, loss, gradients)."
            )
        grads, paired = gradient_list(result[2])
        capture.add(grads, paired, "fn_step_train's returned gradients")
    if not capture.applied:
        raise ValueError(
            "fn_step_train neither applied gradients nor returned them. HINT: end the step with "
            "model.optimizer.apply_gradients(zip(grads, model.trainable_variables)), as on one device, "
            "or return (metric, loss, grads) with grads aligned with model.trainable_variables."
        )
    return capture.gradients, metric, loss


def gradient_list(grads: Any) -> tuple[list[Any], list[Any] | None]:
    """Returned gradients as (gradients, their variables or None): a list aligned with the model's
    trainable variables, or ``(gradient, variable)`` pairs as ``apply_gradients`` takes."""
    items = list(grads)
    if items and all(isinstance(item, tuple) and len(item) == 2 for item in items):
        return [g for g, _ in items], [v for _, v in items]
    return items, None


def run_train_step(
    model: Any, optimizer: Any, variables: Sequence[Any], data: tuple[Any, Any], names: Sequence[str]
) -> tuple[list[Any], list[Any]]:
    """The model's ``train_step(data)`` while tracing, from reset metrics (so its logs are this
    micro-batch's); return its gradients by position and the logs named ``names``."""
    model.reset_metrics()
    with capturing(optimizer, variables, f"{type(model).__name__}.train_step") as capture:
        logs = _flat_logs(_unwrapped(type(model).train_step)(model, data))
    missing = [n for n in names if not isinstance(logs, dict) or n not in logs]
    if missing:
        shown = sorted(logs) if isinstance(logs, dict) else type(logs).__name__
        raise ValueError(
            f"{type(model).__name__}.train_step returned the logs {shown}; fabric_model shows 'loss' and the metrics "
            f"given, and misses {missing}. HINT: return them under these names (compute_metrics() does), or pass "
            "metrics= naming the logs you return."
        )
    if not capture.applied:
        raise ValueError(f"{type(model).__name__}.train_step applied no gradients with self.optimizer.")
    return capture.gradients, [logs[n] for n in names]


def _flat_logs(logs: Any) -> Any:
    """A train_step's logs with nested dicts (``compile_metrics``' result) merged in, as ``fit`` shows them."""
    if not isinstance(logs, dict):
        return logs
    flat: dict[str, Any] = {}
    for name, value in logs.items():
        if isinstance(value, dict):
            flat.update(_flat_logs(value))
        else:
            flat[name] = value
    return flat


def run_test_fn(
    test_fn: Callable[..., Any], model: Any, batches: Iterator[tuple[Any, Any]], fn_args: Any, n_stats: int
) -> tuple[list[float], int]:
    """``fn_test(model, test_iter, fn_args)`` eagerly over ``(indices, (x, y))`` batches: its values as
    [loss, metric...] padded with NaN to ``n_stats``, and the samples it was given. An empty test
    shard is not handed to it (IBM's ``fn_test`` divides by its count)."""
    from ..torch.ibm import test_result  # IBM's contract, the same for both frameworks

    first = next(batches, None)
    if first is None:
        return [0.0] * n_stats, 0
    count = 0

    def test_iter() -> Iterator[tuple[Any, Any]]:
        nonlocal count
        for indices, pair in itertools.chain([first], batches):
            count += len(indices)
            yield pair

    values = [float(np.asarray(v)) for v in test_result(test_fn(model, test_iter(), fn_args))]
    return (values + [float("nan")] * n_stats)[:n_stats], count
