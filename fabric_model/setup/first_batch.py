"""Early checks of a torch model, loss and metrics on the first micro-batch, in the caller.

Mistakes that would otherwise fail in every worker many seconds in (a loss class instead of an
instance, a per-sample loss or metric, float labels, mismatched shapes, a non-finite loss, a
non-float32 model) fail here, before any worker starts, naming the argument, what was received
and the fix.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..frameworks.torch.calling import ModelCall
from ..frameworks.torch.calling import describe as _describe


def check_loss_object(loss_function: Any) -> None:
    """A loss *class* (``nn.CrossEntropyLoss``) is callable but builds a module instead of a loss."""
    if isinstance(loss_function, type) and issubclass(loss_function, torch.nn.Module):
        raise TypeError(
            f"Expected `loss_function` to be a loss function or a loss module instance. Received: the class "
            f"loss_function={loss_function.__name__}. HINT: instantiate it, loss_function={loss_function.__name__}()."
        )


def check_parameter_dtypes(model: torch.nn.Module, precision: str = "32") -> None:
    """The step buffer and its reduction are float32, so float32 parameters are required at any ``precision``."""
    other = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if other:
        mixed = {"torch.bfloat16": "bf16-mixed", "torch.float16": "16-mixed"}.get(other[0], "bf16-mixed")
        raise TypeError(
            f"Expected `model` to have float32 parameters (fabric_model keeps float32 weights and reduces "
            f"float32 gradients; precision={precision!r} sets the forward pass's precision). Received: parameters "
            f"of dtype {', '.join(other)}. HINT: pass model.float() and FabricModel(..., precision={mixed!r})."
        )


def _scalar_or_raise(value: Any, what: str, output: Any, target: Any, hint: str) -> torch.Tensor:
    try:
        tensor = torch.as_tensor(value, dtype=torch.float32)
    except Exception as exc:
        raise TypeError(f"Expected `{what}` to return a number or a scalar tensor. Received: {value!r}.") from exc
    if tensor.numel() != 1:
        raise ValueError(
            f"Expected `{what}` to return a scalar (the batch mean). Received: a {_describe(value)} for a model "
            f"output of {_describe(output)} and a target of {_describe(target)}. HINT: {hint}"
        )
    return tensor


def _call_loss(loss_function: Any, model_computes: bool, output: Any, target: Any) -> Any:
    """The loss on the first batch; its error, or torch's broadcasting warning, names the argument."""
    shapes = f"model output: {_describe(output)}; target: {_describe(target)}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loss = loss_function(output, target)
        except Exception as exc:
            if model_computes:  # calling.model_loss's own message names the argument and the fix
                raise
            float_labels = isinstance(target, torch.Tensor) and target.is_floating_point() and "Long" in str(exc)
            hint = (
                "class-index targets must be integers: make the labels torch.long in the dataset or fn_batch_collate."
                if float_labels
                else "make the model's output shape and dtype match what the loss expects of the target."
            )
            raise ValueError(
                f"`loss_function` failed on the first training batch ({shapes}): {type(exc).__name__}: {exc}. "
                f"HINT: {hint}"
            ) from exc
    for w in caught:
        if "size" in str(w.message) and "target" in str(w.message):  # torch would broadcast silently
            raise ValueError(
                f"`loss_function` received mismatched shapes on the first training batch ({shapes}); torch "
                f"warned: {w.message} HINT: make the model's output shape match the target's."
            )
    return loss


def forward_first_batch(model: torch.nn.Module, call: ModelCall, inputs: Any) -> Any:
    """One forward pass (eval mode, no autograd), called as training calls it; a failure names ``model``."""
    was_training = model.training
    model.eval()  # no BatchNorm statistics updated, no dropout
    try:
        with torch.no_grad():
            output = call(model, inputs)
    except Exception as exc:
        raise ValueError(
            f"`model` failed on the first training batch (input: {_describe(inputs)}): {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        model.train(was_training)
    return output


def check_loss_and_metrics(
    loss_function: Any, model_computes: bool, metrics: list[Any], output: Any, target: Any
) -> None:
    """The loss is a finite scalar and every metric a scalar on the first batch's output
    (``model_computes``: ``loss_function`` reads the loss the model computed, ``loss_function=None``)."""
    with torch.no_grad():
        loss = _call_loss(loss_function, model_computes, output, target)
    hint = "use reduction='mean' (the default); fabric_model weights each micro-batch's mean by its samples."
    value = _scalar_or_raise(loss, "loss_function", output, target, hint)
    if not torch.isfinite(value):
        raise ValueError(
            f"Expected `loss_function` to be finite on the first training batch. Received: {value.item()} "
            f"(model output: {_describe(output)}; target: {_describe(target)}). HINT: check the data for NaN/inf "
            "and the loss for log(0) or division by zero."
        )
    for i, metric in enumerate(metrics):
        with torch.no_grad():
            result = metric(output, target)
        _scalar_or_raise(result, f"metrics[{i}]", output, target, "return the batch mean, e.g. (...).float().mean().")
