"""Keeping the best checkpoints by a monitored metric, next to the newest ones
(``user_callback=[BestCheckpoints(...)]``, as Keras' ``ModelCheckpoint``; docs/architecture.md,
"Training features").

A checkpoint taken after epoch ``e`` holds the weights that epoch ``e``'s validation measured,
so its score is epoch ``e``'s ``logs`` value (``loss``, a metric, or ``val_`` and one of them),
which the driver has from its history. The driver keeps the newest ``keep_checkpoints`` and
the ``keep`` best scored ones; a checkpoint whose epoch's score is not known yet (its
validation runs after it is taken) is kept until it is. ``checkpoints/best.json`` lists the best.
A checkpoint inside an epoch (``train(checkpoint_steps=...)``, a preemption's) holds other
weights than any epoch's metrics measured: it is never scored nor waited for, and stays only as
one of the newest ``keep_checkpoints`` (state/writer.py, ``CheckpointBook._prune``).

A leaf module: no torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..callbacks import Callback
from ..run.rundir import atomic_write

#: The file naming the best checkpoints, in the run's ``checkpoints/``.
BEST_FILE = "best.json"


class BestCheckpoints(Callback):
    """Keep, besides the newest ``keep_checkpoints``, the ``keep`` checkpoints that scored best by
    ``monitor``. Given in ``user_callback``; the driver does the keeping (it has no worker hooks).
    Only checkpoints at an epoch's end are scored; those inside an epoch (``checkpoint_steps``)
    are ignored here and kept only as the newest ``keep_checkpoints``.

    Args:
        monitor: a key of an epoch's logs: ``"loss"``, a metric's name, or ``"val_"`` and one of them.
        mode: ``"min"``, ``"max"``, or ``"auto"`` (``"max"`` for names with "acc" or "auc", else ``"min"``).
        keep: how many of the best to keep (at least 1).
    """

    def __init__(self, monitor: str = "val_loss", mode: str = "auto", keep: int = 1) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise TypeError(f"Expected `monitor` to be a metric name such as 'val_loss'. Received: {monitor!r}")
        if mode not in ("min", "max", "auto"):
            raise ValueError(f"Expected `mode` to be 'min', 'max' or 'auto'. Received: mode={mode!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"Expected `keep` to be an int >= 1. Received: keep={keep!r}")
        self.monitor, self.mode, self.keep = monitor, mode, keep

    def __repr__(self) -> str:
        return f"BestCheckpoints(monitor={self.monitor!r}, mode={self.mode!r}, keep={self.keep})"

    @property
    def maximize(self) -> bool:
        if self.mode == "auto":
            return "acc" in self.monitor or "auc" in self.monitor
        return self.mode == "max"

    def best_units(self, scores: Mapping[int, float]) -> list[int]:
        """The units of the ``keep`` best scored checkpoints, best first (ties: the older first)."""
        finite = [(value, unit) for unit, value in scores.items() if not math.isnan(value)]
        ranked = sorted(finite, key=lambda vu: (-vu[0] if self.maximize else vu[0], vu[1]))
        return [unit for _, unit in ranked[: self.keep]]

    def protected(self, units: list[int], scores: Mapping[int, float]) -> set[int]:
        """Of the checkpoints ``units``, those pruning must spare: the best, and the ones newer than
        every scored one (their score may still come)."""
        newest_scored = max(scores, default=-1)
        return set(self.best_units(scores)) | {u for u in units if u > newest_scored and u not in scores}

    def write_record(self, directory: Path, scores: Mapping[int, float], names: Mapping[int, str]) -> None:
        """``best.json``: the best checkpoints on disk, best first, with their epoch's value."""
        best = [{"path": names[u], "unit": u, "value": scores[u]} for u in self.best_units(scores) if u in names]
        record = {"monitor": self.monitor, "mode": "max" if self.maximize else "min", "best": best}
        data = json.dumps(record, indent=1).encode()
        atomic_write(directory / BEST_FILE, lambda f: f.write(data))


def check_monitor(argument: str, monitor: str, stat_names: list[str], has_test: bool) -> None:
    """Raise in the caller when ``monitor`` names nothing an epoch's logs will hold."""
    names = list(stat_names) + ([f"val_{n}" for n in stat_names] if has_test else [])
    if monitor not in names:
        hint = " (val_ metrics need a test dataset from datasets_function)" if monitor.startswith("val_") else ""
        raise ValueError(
            f"Expected the monitor of `{argument}` to be one of {names}{hint}. Received: monitor={monitor!r}"
        )


def epoch_logs(train_history: list[dict[str, Any]], test_history: list[dict[str, Any]], epoch: int) -> dict[str, float]:
    """Epoch ``epoch``'s logs as the driver's history has them: training averages, ``val_`` metrics."""
    logs = {k: v for h in train_history if h["epoch"] == epoch for k, v in h.items() if k != "epoch"}
    logs.update({f"val_{k}": v for h in test_history if h["epoch"] == epoch for k, v in h.items() if k != "epoch"})
    return logs


def best_of(callbacks: list[Any]) -> BestCheckpoints | None:
    """The ``BestCheckpoints`` among ``user_callback`` (at most one), or None."""
    found = [c for c in callbacks if isinstance(c, BestCheckpoints)]
    if len(found) > 1:
        raise ValueError(f"Expected at most one BestCheckpoints in `user_callback`. Received: {found}")
    return found[0] if found else None


def check_monitors(callbacks: list[Any], stat_names: list[str], has_test: bool) -> None:
    """The ``monitor`` of each callback that has one (``EarlyStopping``, ``BestCheckpoints``, a
    ``ReduceLROnPlateau``), in the caller: it must name something an epoch's logs hold."""
    for callback in callbacks:
        if isinstance(getattr(callback, "monitor", None), str):
            argument = getattr(callback, "argument", f"user_callback {type(callback).__name__}")
            check_monitor(argument, callback.monitor, stat_names, has_test)
