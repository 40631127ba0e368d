"""Scripts written for IBM Watson Machine Learning Accelerator's ``FabricModel``.

Keyword aliases, and loggers with IBM's older signature
``log_train_metrics(loss, acc, completed_batch, worker=0)``, detected once when given.
"""

from __future__ import annotations

import inspect
from typing import Any

#: IBM's keyword -> this package's.
CONSTRUCTOR_ALIASES = {
    "driver_logger": "driver_logger_callback",
    "worker_logger": "worker_logger_callback",
    "enable_onnx": "save_to_onnx",
}

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


def _is_old_style(method: Any) -> bool:
    try:
        names = list(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        return False
    return bool(names) and names[0] == "loss"


class OldStyleLogger:
    """Presents a logger with IBM's signature as one with this package's.

    ``log_train_metrics(loss, acc, completed_batch, worker=0)`` receives the loss, the first
    metric (or None), the iteration, and the live worker count on the driver or the rank in a
    worker; ``log_test_metrics(loss, acc, completed_batch, ...)`` likewise.
    """

    def __init__(self, inner: Any, in_worker: bool) -> None:
        self.inner = inner
        self.in_worker = in_worker

    def on_train_begin(self) -> None:
        if callable(getattr(self.inner, "on_train_begin", None)):
            self.inner.on_train_begin()

    def on_train_end(self) -> None:
        if callable(getattr(self.inner, "on_train_end", None)):
            self.inner.on_train_end()

    def log_train_metrics(self, metrics: dict[str, float], iteration: int, epoch: int, workers: int) -> None:
        method = getattr(self.inner, "log_train_metrics", None)
        if callable(method):
            method(metrics.get("loss"), _first_metric(metrics), iteration, self._worker(workers))

    def log_test_metrics(self, metrics: dict[str, float], iteration: int, epoch: int) -> None:
        method = getattr(self.inner, "log_test_metrics", None)
        if callable(method):
            method(metrics.get("loss"), _first_metric(metrics), iteration, self._worker(0))

    def _worker(self, workers: int) -> int:
        if self.in_worker:
            from .context import worker_context

            ctx = worker_context()
            return ctx.rank if ctx is not None else 0
        return workers


def _first_metric(metrics: dict[str, float]) -> Any:
    return next((v for k, v in metrics.items() if k != "loss"), None)


def adapt_logger(logger: Any, in_worker: bool) -> Any:
    """The logger itself, or a wrapper if its methods have IBM's older signature."""
    if logger is None:
        return None
    if any(_is_old_style(getattr(logger, h, None)) for h in ("log_train_metrics", "log_test_metrics")):
        return OldStyleLogger(logger, in_worker)
    return logger
