"""IBM's default ``edtcallback``: ``EDTLoggerCallback`` writes train and test metrics through EMetrics and ELog.

Used as ``FabricModel(..., driver_logger=EDTLoggerCallback())``. It has IBM's older logger
signature, so ``acc`` arrives in percent and is recorded as a fraction.
"""

from __future__ import annotations

from typing import Any

from callbacks import LoggerCallback
from elog import ELog
from emetrics import EMetrics

__all__ = ["EDTLoggerCallback"]


def _fraction(acc: Any) -> Any:
    # None or NaN: the run has no accuracy (metrics=[], or an fn_test returning the loss alone).
    return acc / 100.0 if acc is not None and acc == acc else None


class EDTLoggerCallback(LoggerCallback):
    """Records each step's loss and accuracy (``train``) and each validation's (``test``)."""

    def __init__(self) -> None:
        self.gs = 0

    def log_train_metrics(self, loss: Any, acc: Any, completed_batch: int, worker: int = 0) -> None:
        acc = _fraction(acc)
        self.gs += 1
        values = {"loss": loss} if acc is None else {"loss": loss, "accuracy": acc}
        with EMetrics.open() as em:
            em.record(EMetrics.TRAIN_GROUP, completed_batch, values)
        with ELog.open() as log:
            log.recordTrain("Train", completed_batch, self.gs, loss, acc, worker)

    def log_test_metrics(self, loss: Any, acc: Any, completed_batch: int, worker: int = 0) -> None:
        acc = _fraction(acc)
        values = {"loss": loss} if acc is None else {"loss": loss, "accuracy": acc}
        with EMetrics.open() as em:
            em.record(EMetrics.TEST_GROUP, completed_batch, values)
        with ELog.open() as log:
            log.recordTest("Test", loss, acc, worker)
