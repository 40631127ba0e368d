"""Mixed precision and gradient clipping in the torch step (``FabricModel(precision=, gradient_clip_norm=)``).

The forward pass and the loss run under ``torch.autocast``; parameters, gradients, the step
buffer and the optimizer stay float32, so the reduction is what it is at ``precision="32"``.

For ``"16-mixed"`` the loss is multiplied by a scale before backward (float16 flushes small
gradients to zero) and the *reduced* gradient is divided by it before the optimizer, with
``torch.amp.GradScaler``'s rule: on an inf or NaN, skip the step and halve the scale; after
``growth_interval`` finite steps, double it. Every decision is taken on the reduced gradient,
identical on every replica, so the replicas keep one scale without exchanging it; the scale is
state, carried in the optimizer state under :data:`SCALER_KEY` wherever that goes (checkpoints,
snapshots, what a joining worker pulls). Clipping, last, sees the true whole-step gradient,
as ``clip_grad_norm_`` does in a plain loop after ``scaler.unscale_``. docs/architecture.md,
"Training features".
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from ...step.options import StepOptions

#: The optimizer state's extra entry holding the loss scale (popped before torch sees it).
SCALER_KEY = "fabric_model_loss_scale"

_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class GradientStep:
    """Autocast for the forward, and the step from the reduced gradient: unscale, clip, apply."""

    INITIAL_SCALE = 2.0**16  # torch.amp.GradScaler's defaults
    GROWTH_INTERVAL = 2000

    def __init__(self, options: StepOptions | None = None) -> None:
        self.options = options or StepOptions()
        self.scales_loss = self.options.scales_loss  # (asked every step: the options are frozen)
        self.scale = self.INITIAL_SCALE if self.scales_loss else 1.0
        self.growth_tracker = 0  # finite steps since the scale last changed
        self.mixed = _DTYPES.get(self.options.precision) is not None  # whether the forward runs in autocast
        #: The last step's whole gradient's L2 norm before clipping (a 0-d tensor; None unless it clipped).
        self.last_norm: torch.Tensor | None = None

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """The context the forward pass and the loss run in."""
        dtype = _DTYPES.get(self.options.precision)
        return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)

    def apply(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> bool:
        """Unscale (float16), clip, step; False when an overflow skipped the step."""
        self.last_norm = None
        if self.scales_loss and not self._unscale([p.grad for p in params if p.grad is not None]):
            return False
        if self.options.gradient_clip_norm is not None:
            self.last_norm = torch.nn.utils.clip_grad_norm_(params, self.options.gradient_clip_norm)
        optimizer.step()
        return True

    def _unscale(self, grads: list[torch.Tensor]) -> bool:
        """Divide the reduced gradient by the scale and update it; False on an inf or NaN."""
        if not grads:
            return True
        found_inf = torch.zeros(1, device=grads[0].device)
        inv_scale = torch.full((1,), 1.0 / self.scale, device=grads[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        if found_inf.item():
            self.scale, self.growth_tracker = self.scale * 0.5, 0
            return False
        self.growth_tracker += 1
        if self.growth_tracker == self.GROWTH_INTERVAL:
            self.scale, self.growth_tracker = self.scale * 2.0, 0
        return True

    # -- travelling in the optimizer state ------------------------------------------------------
    def pack(self, optimizer_state: dict[str, Any]) -> dict[str, Any]:
        """``optimizer_state`` with the loss scale added (float16 only)."""
        if not self.options.scales_loss:
            return optimizer_state
        return {**optimizer_state, SCALER_KEY: {"scale": self.scale, "growth_tracker": self.growth_tracker}}

    def unpack(self, optimizer_state: dict[str, Any]) -> dict[str, Any]:
        """Load the loss scale from ``optimizer_state`` (a state without one starts afresh); the rest."""
        saved = optimizer_state.get(SCALER_KEY)
        if self.options.scales_loss:
            self.scale = float(saved["scale"]) if saved else self.INITIAL_SCALE
            self.growth_tracker = int(saved["growth_tracker"]) if saved else 0
        return {k: v for k, v in optimizer_state.items() if k != SCALER_KEY}
