"""Scripts written for IBM Watson Machine Learning Accelerator's ``FabricModel``: keyword handling.

IBM's keyword names (``driver_logger``, ``worker_logger``, ``enable_onnx``) are taken with
:func:`pick`; loggers with IBM's older signature are adapted by :mod:`fabric_model.run.hooks`.
"""

from __future__ import annotations

from typing import Any

#: ``train()`` keywords IBM scripts pass that have no effect here, and why.
IGNORED_TRAIN_KEYWORDS = {
    "worker_memory": "memory is not capped here: workers use what the host and device have",
    "driver_memory": "memory is not capped here: the driver is the caller's own process",
}


def pick(name: str, value: Any, alias: str, alias_value: Any) -> Any:
    """``value``, or the value given under IBM's ``alias``; both at once is an error."""
    if alias_value is None:
        return value
    if value is not None:
        raise TypeError(f"Got both `{alias}` and `{name}`; they are the same argument. Pass only `{name}`.")
    return alias_value


__all__ = ["IGNORED_TRAIN_KEYWORDS", "pick"]
