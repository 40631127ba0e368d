"""IBM's ``emetrics`` module: evaluation metrics as JSON lines in ``$LOG_DIR/evaluation-metrics.txt``.

Each ``record(group, iteration, values)`` appends one line::

    {"meta": {"training_id": $TRAINING_ID, "time": <ms since epoch>, "rindex": <n>[, "subid": subId]},
     "grouplabel": group,
     "etimes": {"iteration": {"type": 2, "value": iteration},
                "time_stamp": {"type": 0, "value": "<ISO time>"}},
     "values": {name: {"type": 2 (number) | 3 (text), "value": str(value)}}}

With a ``subId``, the test records are also written, as one JSON list, to
``$RESULT_DIR/val_dict_list.json`` on ``close()``.
"""

from __future__ import annotations

import datetime
import json
import numbers
import os
import threading
import time
from typing import IO, Any

from fabric_model.ibm.paths import log_folder
from fabric_model.settings.registry import RESULT_DIR, TRAINING_ID

__all__ = ["EMetrics"]

_FILE_NAME = "evaluation-metrics.txt"
# rindex counts the records this process wrote to each file: IBM's loggers open a new EMetrics
# for every record, so a per-object counter would always say 0.
_counts: dict[str, int] = {}
_lock = threading.Lock()


def _encode(value: Any) -> dict[str, Any]:
    item = getattr(value, "item", None)
    if callable(item) and not isinstance(value, (str, bytes)):
        try:
            value = item()  # a 0-d tensor or NumPy scalar
        except (TypeError, ValueError, RuntimeError):
            pass
    kind = 2 if isinstance(value, numbers.Number) else 3
    return {"type": kind, "value": str(value)}


class EMetrics:
    """A metrics writer; use ``with EMetrics.open(subId) as em: em.record(...)``."""

    TEST_GROUP = "test"
    TRAIN_GROUP = "train"

    def __init__(self, subId: str | None, f: IO[str] | None) -> None:  # noqa: N803 (IBM's name)
        self.subId = subId
        self.f = f
        self.test_history: list[dict[str, Any]] = []

    @staticmethod
    def open(subId: str | None = None) -> EMetrics:  # noqa: N803 (IBM's name)
        """A writer appending to ``$LOG_DIR/evaluation-metrics.txt`` (the folder is made)."""
        folder = log_folder()
        os.makedirs(folder, exist_ok=True)
        return EMetrics(subId, open(os.path.join(folder, _FILE_NAME), "a", encoding="utf-8"))

    def record(self, group: str, iteration: int, values: dict[str, Any]) -> None:
        """Append one record of ``values`` for ``group`` (``TRAIN_GROUP``/``TEST_GROUP``) at ``iteration``."""
        if group == self.TEST_GROUP and self.subId:
            self.test_history.append(dict(values))
        if self.f is None:
            return
        with _lock:
            key = os.path.abspath(self.f.name)
            rindex = _counts.get(key, 0)
            _counts[key] = rindex + 1
        meta: dict[str, Any] = {"training_id": TRAINING_ID.get(), "time": int(time.time() * 1000)}
        meta["rindex"] = rindex
        if self.subId:
            meta["subid"] = self.subId
        line = {
            "meta": meta,
            "grouplabel": group,
            "etimes": {
                "iteration": {"type": 2, "value": iteration},
                "time_stamp": {"type": 0, "value": datetime.datetime.now().isoformat()},
            },
            "values": {str(name): _encode(value) for name, value in values.items()},
        }
        # One write per line, flushed, so lines from the driver and workers do not interleave.
        self.f.write(json.dumps(line) + "\n")
        self.f.flush()

    def close(self) -> None:
        """Close the file; with a ``subId``, write the test records to ``$RESULT_DIR/val_dict_list.json``."""
        if self.f is not None:
            self.f.close()
            self.f = None
        if self.subId:
            folder = RESULT_DIR.get() or "."
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "val_dict_list.json"), "w", encoding="utf-8") as out:
                json.dump(self.test_history, out, default=str)

    def __enter__(self) -> EMetrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
