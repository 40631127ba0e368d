"""What ``train()`` returns (the trained weights are in the user's model object itself)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any, SupportsIndex, overload


class History(list[dict[str, float]]):
    """The per-epoch training records, a list, that also answers as Keras' ``History`` does.

    As a list (unchanged from earlier versions): one dict per epoch, ``{"epoch": e, "loss": ...,
    <metric>: ...}``, ``e`` 0-based; indexing by int, iteration, ``len``, ``==`` with a list and
    ``json.dump`` work as on a list.

    As Keras' ``History``: ``history["loss"]`` (a str key) is that key's list of per-epoch
    values, ``history.history`` the dict of all such lists (the training keys, then ``val_<key>``
    per validation key), ``history.epoch`` the list of epoch numbers. Each list is aligned with
    ``history.epoch``: an epoch without a validation (``validation_freq`` > 1) has NaN in the
    ``val_*`` lists, where Keras would leave its entry out (so ``pandas.DataFrame(h.history)``
    works and plots skip the gaps). A run without validation has no ``val_*`` keys, as in Keras.
    ``"loss" in history`` asks the list (of dicts): ask ``"loss" in history.history``.

    Args:
        train: per epoch, ``{"epoch": e, **the epoch's sample-weighted averages}``.
        test: per validation, ``{"epoch": e, **its metrics}`` (``TrainResult.test_history``).
    """

    def __init__(self, train: Iterable[dict[str, float]] = (), test: Iterable[dict[str, float]] = ()) -> None:
        super().__init__(train)
        self._test = list(test)

    @property
    def epoch(self) -> list[int]:
        """The epoch numbers, 0-based, as Keras' ``History.epoch``."""
        return [int(record["epoch"]) for record in self]

    @property
    def history(self) -> dict[str, list[float]]:
        """Keras' ``History.history``: per key, its per-epoch values (NaN where an epoch lacks it)."""
        by_epoch = {int(t["epoch"]): t for t in self._test}
        rows = [
            {**{k: v for k, v in record.items() if k != "epoch"}, **_validation(by_epoch.get(int(record["epoch"])))}
            for record in self
        ]
        keys = list(dict.fromkeys(k for row in rows for k in row))  # first-seen order: loss, metrics, val_*
        return {k: [row.get(k, math.nan) for row in rows] for k in keys}

    @overload
    def __getitem__(self, key: SupportsIndex) -> dict[str, float]: ...
    @overload
    def __getitem__(self, key: slice) -> list[dict[str, float]]: ...
    @overload
    def __getitem__(self, key: str) -> list[float]: ...
    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            values = self.history.get(key)
            if values is None:
                raise KeyError(f"{key!r}: the history holds {sorted(self.history)}")
            return values
        return super().__getitem__(key)

    def __reduce__(self) -> tuple[Any, ...]:
        return History, (list(self), self._test)


def _validation(record: dict[str, float] | None) -> dict[str, float]:
    return {} if record is None else {f"val_{k}": v for k, v in record.items() if k != "epoch"}


@dataclasses.dataclass
class TrainResult:
    """What ``train()`` returns; the trained weights are in the user's model object itself.

    Attributes:
        run_dir: the run directory (logs, worker logs, metrics).
        history: per epoch, the sample-weighted training averages (``loss`` and metrics), a list
            of dicts that also answers Keras-style: ``history["loss"]``, ``history["val_loss"]``,
            ``history.history``, ``history.epoch`` (see :class:`History`).
        test_history: per validation, the test metrics.
        seed: the seed the run used (pass it back as ``seed=`` to repeat the run).
        replica_digests: per worker, a SHA-256 of its final weights and optimizer state.
        onnx_max_diff: with ``save_to_onnx``, the largest absolute difference between
            onnxruntime on ``model/model.onnx`` and the framework's own output on real batches
            (None when no file was written).
    """

    run_dir: Path
    history: History
    test_history: list[dict[str, float]]
    seed: int
    replica_digests: dict[int, str]
    onnx_max_diff: float | None = None
