"""The PyTorch side of the ONNX export: torch.onnx's exporter and the model's own inference output.

Framework-neutral steps (staging, the fixed-batch check, onnxruntime's comparison) are in
:mod:`fabric_model.frameworks.export`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from ...step.tree import leaves, map_tree
from ..export import _EXTERNAL_DATA_BYTES, _INSTALL_HINT, _batch_size, _error, _require, _to_numpy


@contextlib.contextmanager
def torch_inference(model: Any) -> Iterator[None]:
    """Eval mode and no autograd for the block; every submodule's own training flag is restored after.

    The caller's model is switched in place rather than deep-copied: a copy doubles the (GPU) memory and some
    models do not copy; restoring each submodule's flag also keeps a submodule the user froze in eval mode.
    """
    import torch

    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training


def torch_args(model: Any, sample: Any) -> tuple[Any, ...]:
    """The model's positional inputs, on the model's device."""
    import torch

    args = sample if isinstance(sample, tuple | list) else (sample,)
    try:
        device = next(model.parameters()).device
    except StopIteration:
        return tuple(args)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def export_torch(model: Any, sample: Any, path: str) -> None:
    """Write ``model`` to ``path`` with torch.onnx's torch.export-based exporter, batch dimension dynamic."""
    torch = _require("torch", "torch", model)
    if not isinstance(model, torch.nn.Module):
        raise _error("torch", model, "the model is not a torch.nn.Module")
    _require("onnx", "torch", model)
    _require("onnxscript", "torch", model)
    args = torch_args(model, sample)
    if _batch_size(args) == 1:
        # torch.export specializes a dimension of size 1 (it cannot tell it from broadcasting), so a
        # one-sample batch would give a fixed batch of 1: export with the sample repeated instead.
        args = tuple(torch.cat([a, a]) if isinstance(a, torch.Tensor) else a for a in args)
    # The torch.export-based exporter (dynamo=True): it is the default since torch 2.9, while the TorchScript
    # exporter warns that it is deprecated. It needs onnxscript. One Dim shared by every input says they
    # share the batch size. Note it silently falls back to a static dimension when the model fixes the batch
    # size (e.g. x.view(4, -1)): export_onnx checks the file's input shape for that.
    batch = torch.export.Dim("batch")
    dynamic_shapes = tuple({0: batch} if isinstance(a, torch.Tensor) and a.dim() > 0 else None for a in args)
    names = ["input"] if len(args) == 1 else [f"input_{i}" for i in range(len(args))]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with torch_inference(model):
        try:
            torch.onnx.export(
                model,
                args,
                path,
                dynamo=True,
                input_names=names,
                dynamic_shapes=dynamic_shapes,
                # One self-contained file unless it cannot be (the exporter's default is an extra .data file).
                external_data=weight_bytes > _EXTERNAL_DATA_BYTES,
                verbose=False,
            )
        except ImportError as exc:
            hint = _INSTALL_HINT["onnxscript"]
            raise _error("torch", model, "a module the exporter needs is missing", exc, hint) from exc
        except Exception as exc:
            raise _error(
                "torch",
                model,
                "torch.onnx.export could not trace the model",
                exc,
                "the forward must be traceable by torch.export: no Python branches on tensor values, no "
                "conversions to numpy or Python numbers (see the exportdb in the torch docs)",
            ) from exc


def torch_outputs(model: Any, sample: Any) -> list[np.ndarray]:
    """The model's outputs in inference mode, flattened as torch's pytree flattens them."""
    with torch_inference(model):
        out = model(*torch_args(model, sample))
    return [_to_numpy(x) for x in leaves(out)]


def grow_torch_batch(sample: Any) -> Any:
    """``sample`` with its first row repeated at the end (tensors and NumPy arrays)."""
    import torch

    def grow(x: Any) -> Any:
        if isinstance(x, np.ndarray):
            return np.concatenate([x, x[:1]])
        return torch.cat([x, x[:1]])

    return map_tree(grow, sample)
