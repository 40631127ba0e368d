"""Keras losses, optimizers and metrics given by name: resolved as Keras resolves them, and a
misspelled name fails in the caller, naming the argument and the closest valid names."""

from __future__ import annotations

import difflib
import re
from typing import Any

from ..base import metric_name
from .flavor import KERAS3, Flavor

#: Names Keras' ``compile`` reads as "the accuracy that fits the loss and the output shape".
ACCURACY_NAMES = ("accuracy", "acc")


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def valid_names(module: Any, base: type | None = None) -> list[str]:
    """The names ``module.get`` accepts (``keras.losses`` / ``keras.optimizers`` /
    ``keras.metrics``): its public functions, and its classes in the forms Keras resolves."""
    candidates: set[str] = set()
    for attr in dir(module):
        if attr.startswith("_") or attr in {"get", "serialize", "deserialize"}:
            continue
        obj = getattr(module, attr)
        if isinstance(obj, type):
            if base is not None and (not issubclass(obj, base) or obj is base):
                continue
            candidates.update({attr, attr.lower(), _snake(attr)})
        elif callable(obj) and attr.islower():
            candidates.add(attr)
    names = []
    for name in sorted(candidates, key=lambda n: (not n.islower(), n)):  # snake_case names first
        try:
            module.get(name)
        except Exception:  # noqa: BLE001 - a form Keras does not resolve
            continue
        names.append(name)
    return names


def unknown_name_error(argument: str, name: str, candidates: list[str]) -> ValueError:
    close = difflib.get_close_matches(name, candidates, n=4, cutoff=0.6)
    if not close:  # a looser match on lower case catches wrong capitalisation and missing underscores
        squash = {c.lower().replace("_", ""): c for c in candidates}
        close = [squash[c] for c in difflib.get_close_matches(name.lower().replace("_", ""), list(squash), n=4)]
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    kind = argument.split("_")[0].split("[")[0].rstrip("s")
    return ValueError(
        f"Expected `{argument}` to be a Keras {kind} name, instance or callable. "
        f"Received: {argument}={name!r}, which Keras does not know.{hint} "
        f"Valid names include: {', '.join(candidates[:12])}, ..."
    )


#: What ``loss_function`` takes for a Keras model.
LOSSES_ACCEPTED = (
    "a keras.losses.Loss, a Keras loss name such as 'sparse_categorical_crossentropy', or a callable "
    "loss(y_true, y_pred) (`loss_function` may also be a dict of them by output name, or a list by output, "
    "as compile(loss=) takes)"
)


def resolve_loss(loss: Any, argument: str = "loss_function", flavor: Flavor = KERAS3) -> Any:
    """A loss, or a dict (by output name) or list (by output) of them, as ``compile(loss=)`` takes;
    names as ``flavor``'s Keras resolves them."""
    keras = flavor.module()
    if isinstance(loss, dict) and argument == "loss_function":
        return {k: resolve_loss(v, f"loss_function[{k!r}]", flavor) for k, v in loss.items()}
    if isinstance(loss, list | tuple) and argument == "loss_function":
        return [resolve_loss(v, f"loss_function[{i}]", flavor) for i, v in enumerate(loss)]
    if isinstance(loss, str):
        try:
            return keras.losses.get(loss)
        except (ValueError, TypeError):
            raise unknown_name_error(argument, loss, valid_names(keras.losses, keras.losses.Loss)) from None
    if isinstance(loss, keras.losses.Loss) or callable(loss):
        return loss
    none = " (or None, for a model that computes its own loss)" if argument == "loss_function" else ""
    raise TypeError(f"Expected `{argument}` to be {LOSSES_ACCEPTED}{none}. Received: {argument}={loss!r}")


def check_own_loss(model: Any, computes_its_own: bool) -> None:
    """``loss_function=None``: refused unless the model computes its own loss (``computes_its_own``: a
    ``compute_loss`` or ``train_step`` override, or ``fn_step_train=``)."""
    if computes_its_own:
        return
    raise TypeError(
        "Expected `loss_function` to be a loss: a Keras model needs one unless it computes its own (a "
        "`compute_loss` or `train_step` override in its keras.Model subclass, or a custom step, fn_step_train=). "
        f"Received: loss_function=None, for a {type(model).__name__} model that overrides neither, and no "
        f"fn_step_train. Accepted: {LOSSES_ACCEPTED}. HINT: pass the loss you would give compile(loss=), "
        "e.g. loss_function='sparse_categorical_crossentropy'."
    )


def resolve_optimizer(optimizer: Any, flavor: Flavor = KERAS3) -> Any:
    """An optimizer of ``flavor``'s Keras (the model's), or a name it resolves."""
    keras = flavor.module()
    if isinstance(optimizer, str):
        try:
            return keras.optimizers.get(optimizer)
        except (ValueError, TypeError):
            raise unknown_name_error("optimizer", optimizer, valid_names(keras.optimizers)) from None
    if isinstance(optimizer, flavor.optimizer_types()):
        return optimizer
    if isinstance(optimizer, type):
        hint = " HINT: pass an instance, e.g. keras.optimizers.SGD(0.1)."
    elif any(c.__module__.split(".")[0] in ("keras", "tf_keras") for c in type(optimizer).__mro__):
        # The other Keras' optimizer: Keras 2 and 3 cannot update each other's variables.
        hint = (
            f" HINT: the model is a {flavor.label} model; build the optimizer with the same Keras as the model "
            "(TF_USE_LEGACY_KERAS=1 makes tf.keras Keras 2, tf_keras; without it tf.keras is Keras 3, keras)."
        )
    else:
        hint = ""
    raise TypeError(
        f"Expected `optimizer` to be {flavor.optimizer_names()} or a name such as 'adam' or 'sgd'. "
        f"Received: optimizer={optimizer!r} ({type(optimizer).__module__}.{type(optimizer).__qualname__}).{hint}"
    )


def resolve_metric(metric: Any, position: int, flavor: Flavor = KERAS3) -> Any:
    """A metric as given, with names checked; "accuracy" stays a name (resolved per output shape)."""
    keras = flavor.module()

    if isinstance(metric, str):
        if metric in ACCURACY_NAMES:
            return metric
        try:
            return keras.metrics.get(metric)
        except (ValueError, TypeError):
            candidates = sorted(set(valid_names(keras.metrics, keras.metrics.Metric)) | set(ACCURACY_NAMES))
            raise unknown_name_error(f"metrics[{position}]", metric, candidates) from None
    if isinstance(metric, keras.metrics.Metric) or callable(metric):
        return metric
    raise TypeError(
        f"Expected `metrics[{position}]` to be a Keras metric name ('accuracy'), a keras.metrics.Metric or a "
        f"callable metric(y_true, y_pred). Received: {metric!r}"
    )


def accuracy_for(y_true_shape: Any, y_pred_shape: Any, flavor: Flavor = KERAS3) -> Any:
    """The accuracy Keras' ``compile(metrics=["accuracy"])`` picks for these shapes."""
    keras = flavor.module()

    if y_pred_shape.rank and y_pred_shape[-1] == 1:
        return keras.metrics.binary_accuracy
    if y_true_shape.rank is not None and (
        y_true_shape.rank < y_pred_shape.rank or (y_true_shape.rank and y_true_shape[-1] == 1)
    ):
        return keras.metrics.sparse_categorical_accuracy
    return keras.metrics.categorical_accuracy


def metric_label(metric: Any, position: int, taken: set[str]) -> str:
    if isinstance(metric, str):
        name = metric
        taken_name, suffix = name, 1
        while taken_name in taken or taken_name == "loss":
            suffix += 1
            taken_name = f"{name}_{suffix}"
        taken.add(taken_name)
        return taken_name
    return metric_name(metric, position, taken)
