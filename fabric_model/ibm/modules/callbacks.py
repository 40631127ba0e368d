"""IBM's ``callbacks`` module: ``Callback`` for user callbacks, ``LoggerCallback`` for loggers."""

from __future__ import annotations

from typing import Any

from fabric_model import Callback

__all__ = ["Callback", "LoggerCallback"]


class LoggerCallback:
    """Base class of IBM loggers (``driver_logger=``, ``worker_logger=``); every hook is a no-op.

    Subclasses override ``log_train_metrics`` and ``log_test_metrics`` in any signature IBM
    used (``(loss, acc, completed_batch, worker=0)``, ``(metrics, completed_batch, epoch,
    worker=0)``) or fabric_model's ``(metrics, iteration, epoch, workers)``. The no-ops here
    take any arguments, so which signature a logger has is read from the subclass's own
    methods only (fabric_model detects IBM's older one by its first parameter, ``loss``).
    """

    def log_train_metrics(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_test_metrics(self, *args: Any, **kwargs: Any) -> None:
        pass
