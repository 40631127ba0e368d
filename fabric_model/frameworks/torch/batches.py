"""PyTorch batches: their tensors moved to a device, scalars and CPU copies.

A batch's inputs and target, and the model's call on them: :mod:`.calling`."""

from __future__ import annotations

from typing import Any

import torch

from ...step.tree import map_tree


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
