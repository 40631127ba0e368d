"""PyTorch batches: a batch's ``(inputs, target)``, and its tensors moved to a device."""

from __future__ import annotations

from typing import Any

import torch

from ...step.tree import map_tree


def split_batch(batch: Any) -> tuple[Any, Any]:
    """``(inputs, target)`` of a collated batch.

    Accepted shapes: a pair ``(x, y)``; a longer tuple ``(x1, ..., xn, y)`` whose inputs are
    passed as ``model(x1, ..., xn)``; a dict with a ``target``/``label``/``labels``/``y`` key,
    the other entries being the input (one entry: its value; several: the dict).
    """
    if isinstance(batch, (tuple, list)):
        if len(batch) < 2:
            raise ValueError(f"A batch must be (inputs, target); received a sequence of {len(batch)} item(s).")
        return (tuple(batch[:-1]) if len(batch) > 2 else batch[0]), batch[-1]
    if isinstance(batch, dict):
        for key in TARGET_KEYS:
            if key in batch:
                rest = {k: v for k, v in batch.items() if k != key}
                inputs = next(iter(rest.values())) if len(rest) == 1 else rest
                return inputs, batch[key]
        raise ValueError(
            f"A dict sample needs a target under one of the keys {TARGET_KEYS}; received keys {sorted(batch)}."
        )
    raise ValueError(
        f"A sample must be a (input, target) tuple or a dict with a target key; received {type(batch).__name__}."
    )


TARGET_KEYS = ("target", "label", "labels", "y")


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it on ``device`` (other leaves as they are)."""
    return map_tree(lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x, obj)


def scalar(value: Any, device: torch.device) -> torch.Tensor:
    """A float32 scalar tensor from a tensor, a number or None (0)."""
    if value is None:
        return torch.zeros((), device=device)
    if isinstance(value, torch.Tensor):
        return value.detach().float().reshape(()).to(device)
    return torch.tensor(float(value), device=device)


def cpu_copy(x: Any) -> Any:
    return x.detach().cpu().clone() if isinstance(x, torch.Tensor) else x
