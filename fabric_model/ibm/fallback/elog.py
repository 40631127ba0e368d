"""IBM's ``elog`` module (shipped with its samples): plain-text training lines in ``$LOG_DIR/elog.txt``.

Same public shape as IBM's ``ELog``: ``ELog.open(subId=None)`` (a context manager),
``recordText(text)``, ``recordTrain(title, iteration, global_steps, loss, accuracy, worker)``,
``recordTest(title, loss, accuracy, worker)``, ``close()``. With a ``subId`` the file is
``$LOG_DIR/<subId>/elog.txt``.
"""

from __future__ import annotations

import os
import time
from typing import IO, Any

from fabric_model.ibm.paths import log_folder

__all__ = ["ELog"]


def _number(value: Any) -> float:
    return round(float(value), 5) if value is not None else float("nan")


class ELog:
    """A text log writer; IBM's samples use it beside ``EMetrics``."""

    def __init__(self, subId: str | None, f: IO[str] | None) -> None:  # noqa: N803 (IBM's name)
        self.subId = subId
        self.f = f

    @staticmethod
    def open(subId: str | None = None) -> ELog:  # noqa: N803 (IBM's name)
        folder = log_folder()
        if subId is not None:
            folder = os.path.join(folder, subId)
        os.makedirs(folder, exist_ok=True)
        return ELog(subId, open(os.path.join(folder, "elog.txt"), "a", encoding="utf-8"))

    def recordText(self, text: str) -> None:  # noqa: N802 (IBM's name)
        if self.f is not None:
            self.f.write(time.strftime("[%Y-%m-%d %H:%M:%S]") + " " + text + "\n")
            self.f.flush()

    def recordTrain(  # noqa: N802 (IBM's name)
        self, title: str, iteration: int, global_steps: int, loss: Any, accuracy: Any, worker: int
    ) -> None:
        stamp = int(round(time.time() * 1000))
        self.recordText(
            f"{title},\tTimestamp: {stamp},\tGlobal steps: {global_steps},\tIteration: {iteration},"
            f"\tLoss: {_number(loss)},\tAccuracy: {_number(accuracy)}"
        )

    def recordTest(self, title: str, loss: Any, accuracy: Any, worker: int) -> None:  # noqa: N802 (IBM's name)
        stamp = int(round(time.time() * 1000))
        self.recordText(f"{title},\tTimestamp: {stamp},\tLoss: {_number(loss)},\tAccuracy: {_number(accuracy)}")

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None

    def __enter__(self) -> ELog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
