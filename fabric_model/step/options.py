"""``FabricModel(precision=, gradient_clip_norm=)``: how each step's gradient is made and applied.

A leaf module (no framework import): the caller checks the options here, before any worker
starts; :mod:`.frameworks.torch_precision` carries them out in the worker.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

#: Lightning's spellings: float32 throughout, bfloat16 autocast, float16 autocast with a loss scale.
PRECISIONS = ("32", "bf16-mixed", "16-mixed")
#: A Keras optimizer's own clipping attributes (it clips in ``apply``).
KERAS_CLIPPING = ("clipnorm", "global_clipnorm", "clipvalue")


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Attributes:
    precision: one of :data:`PRECISIONS`; weights, optimizer state and the reduced gradient stay
        float32 in every case, only the forward pass and the loss run in reduced precision.
    gradient_clip_norm: clip the step's whole reduced gradient to this global L2 norm (None: off).
    """

    precision: str = "32"
    gradient_clip_norm: float | None = None

    @property
    def scales_loss(self) -> bool:
        """float16's narrow range needs a loss scale (bfloat16 has float32's range)."""
        return self.precision == "16-mixed"


def check_step_options(
    precision: Any, gradient_clip_norm: Any, framework: str, custom_step: bool, optimizer: Any = None
) -> StepOptions:
    """Check both options in the caller; errors name the argument, what was received and what is accepted."""
    if isinstance(precision, int) and not isinstance(precision, bool) and precision in (16, 32):
        precision = "32" if precision == 32 else "16-mixed"  # Lightning's old integer spelling
    if precision not in PRECISIONS:
        raise ValueError(
            f"Expected `precision` to be one of {', '.join(map(repr, PRECISIONS))}. Received: {precision!r}."
        )
    if precision != "32" and framework != "torch":
        raise ValueError(
            f"Expected `precision` to be '32' for a {framework} model. Received: precision={precision!r}. "
            "HINT: a Keras model takes its precision from its layers' dtype policy: call "
            "keras.mixed_precision.set_dtype_policy('mixed_bfloat16') before building the model, precision='32'."
        )
    if precision == "16-mixed" and custom_step:
        raise ValueError(
            "Expected `precision` to be '32' or 'bf16-mixed' with `fn_step_train`. Received: precision='16-mixed'. "
            "HINT: float16 needs its loss scaled before backward, which a custom step does itself; use 'bf16-mixed'."
        )
    if gradient_clip_norm is not None:
        number = isinstance(gradient_clip_norm, (int, float)) and not isinstance(gradient_clip_norm, bool)
        if not number or not math.isfinite(gradient_clip_norm) or gradient_clip_norm <= 0:
            raise ValueError(
                "Expected `gradient_clip_norm` to be None or a positive finite number (the largest global L2 norm "
                f"of the step's gradient). Received: {gradient_clip_norm!r}."
            )
        gradient_clip_norm = float(gradient_clip_norm)
        own = [f"{k}={getattr(optimizer, k)}" for k in KERAS_CLIPPING if getattr(optimizer, k, None) is not None]
        if own:
            raise ValueError(
                f"Expected one way of clipping. Received: gradient_clip_norm={gradient_clip_norm} and an optimizer "
                f"with {', '.join(own)}. HINT: keep one; both apply to the step's reduced gradient."
            )
    return StepOptions(precision, gradient_clip_norm)
