"""Early checks of a torch model, loss and metrics on the first micro-batch, in the caller.

Mistakes that would otherwise fail in every worker many seconds in (a loss class instead of an
instance, a per-sample loss or metric, float labels, mismatched shapes, a non-finite loss, a
non-float32 model), or silently train something else (a loss summed over the batch; with
``loss_function=None``, an output of several scalar tensors and no ``loss`` field, refused by
:func:`fabric_model.frameworks.torch.calling.model_loss`, the rule the workers apply), fail here, before any
worker starts, naming the argument, what was received and the fix.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ...setup.checks import check_loss_reduction
from .calling import ModelCall
from .calling import describe as _describe

#: What to do about a loss summed over the batch.
SUM_FIX = (
    'use reduction="mean" (the default), e.g. torch.nn.CrossEntropyLoss() or F.cross_entropy(output, target), '
    'not reduction="sum".'
)


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
    if "torch.float64" in other:  # no precision setting makes float64: say so rather than offer a lower one
        raise TypeError(
            f"Expected `model` to have float32 parameters: float64 parameters are not supported (fabric_model "
            "keeps float32 weights and sums gradients across workers in a float32 buffer, so float64 would "
            f"silently lose its precision). Received: parameters of dtype {', '.join(other)}. HINT: pass "
            "model.float() to train in float32 (the default precision='32'); precision='bf16-mixed' or '16-mixed' "
            "only lowers the forward pass's precision."
        )
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
            # calling.model_loss, the workers' own rule (no loss, or several scalar tensors to guess
            # from), raises here first, and its message already names the argument and the fix.
            if model_computes:
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
    if not model_computes:  # the model's own loss (Hugging Face's) is its batch mean
        check_summed_loss(loss_function, output, target, value.item())
    for i, metric in enumerate(metrics):
        with torch.no_grad():
            result = metric(output, target)
        _scalar_or_raise(result, f"metrics[{i}]", output, target, "return the batch mean, e.g. (...).float().mean().")


def split_samples(value: Any, size: int, cut: int) -> tuple[Any, Any] | None:
    """``value``'s first ``cut`` samples and the rest (tensors cut along their first dimension, inside
    tuples, lists and dicts); None where that is not a cut into samples (another leading size, a
    scalar, an object of another kind)."""
    if isinstance(value, torch.Tensor):
        return (value[:cut], value[cut:]) if value.dim() > 0 and value.shape[0] == size else None
    if isinstance(value, Mapping):
        keys, values = list(value), list(value.values())
    elif type(value) in (tuple, list):
        keys, values = [], list(value)
    else:
        return None
    parts = [split_samples(v, size, cut) for v in values]
    firsts, rests = [p[0] for p in parts if p is not None], [p[1] for p in parts if p is not None]
    if not parts or len(firsts) < len(parts):
        return None
    if isinstance(value, Mapping):
        return dict(zip(keys, firsts)), dict(zip(keys, rests))
    return type(value)(firsts), type(value)(rests)


def check_summed_loss(loss_function: Any, output: Any, target: Any, whole: float) -> None:
    """Refuse a loss summed over the batch (:func:`.checks.check_loss_reduction`): the loss of the first
    batch's output against that of its two halves. The output is cut, not recomputed: the model runs
    no more, so its state (BatchNorm statistics, random generators) is untouched."""
    size = target.shape[0] if isinstance(target, torch.Tensor) and target.dim() > 0 else 0
    if size < 2:  # one sample has no halves
        return
    cut = size // 2
    outputs, targets = split_samples(output, size, cut), split_samples(target, size, cut)
    if outputs is None or targets is None:
        return
    halves = []
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for out, tgt, n in zip(outputs, targets, (cut, size - cut)):
                halves.append((float(torch.as_tensor(loss_function(out, tgt), dtype=torch.float32)), n))
    except Exception:  # a loss that cannot take fewer samples: nothing to compare
        return
    check_loss_reduction(whole, halves, SUM_FIX)
