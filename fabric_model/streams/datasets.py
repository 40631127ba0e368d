"""Where sharded datasets enter a run: counted in the caller, read as streams in the workers."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

from ..step.stream_order import segment_bounds
from .lengths import ShardCount, count_shards
from .reader import StreamedDataset
from .sharded import ShardedDataset, as_sharded

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CallerData:
    """The datasets as the caller checks and plans them.

    ``train`` and ``test`` are the user's map-style datasets, or a sharded one's samples in
    the shards' own order (the first-batch check reads the first two); the counts say how
    long each sharded dataset is."""

    train: Any
    test: Any
    train_count: ShardCount | None = None
    test_count: ShardCount | None = None
    train_source: ShardedDataset | None = None

    @property
    def sharded_data(self) -> bool:
        return self.train_count is not None

    def record(self) -> dict[str, Any] | None:
        """What ``run.json`` says of the sharded data: shards, samples, the time counting took, what was skipped."""
        out: dict[str, Any] = {}
        for role, count in (("train", self.train_count), ("test", self.test_count)):
            if count is not None:
                out[role] = {
                    "shards": len(count.lengths),
                    "samples": sum(count.lengths),
                    "counted_seconds": round(count.seconds, 3) if count.counted else None,
                    "skipped": [{"shard": name, "error": error} for name, error in count.skipped],
                }
        return out or None


def in_caller(train: Any, test: Any) -> CallerData:
    """Count the sharded datasets' lengths (each shard read once, unless the user gave them)."""
    train_source, test_source = as_sharded(train), as_sharded(test) if test is not None else None
    if train_source is None and test_source is None:
        return CallerData(train, test)
    train_count = test_count = None
    if train_source is not None:
        train_count = _counted(train_source, "train")
        train = StreamedDataset(train_source, train_count.lengths, 0, shuffle=False)
    if test_source is not None:
        test_count = _counted(test_source, "test")
        test = StreamedDataset(test_source, test_count.lengths, 0, shuffle=False)
    return CallerData(train, test, train_count, test_count, train_source)


def in_order(dataset: Any, role: str = "evaluated") -> Any:
    """A sharded dataset as a map-style one over its samples in the shards' order (``evaluate``,
    ``predict``); any other dataset as it is."""
    source = as_sharded(dataset)
    if source is None:
        return dataset
    return StreamedDataset(source, _counted(source, role, again=False).lengths, 0, shuffle=False)


def _counted(source: ShardedDataset, role: str, again: bool = True) -> ShardCount:
    count = count_shards(source, again)
    for name, error in count.skipped:
        warnings.warn(f"The {role} dataset's {name} was skipped: {error}", stacklevel=4)
    if count.counted:
        samples, shards = sum(count.lengths), len(count.lengths)
        log.info("%s data: %d samples in %d shards, counted in %.2f s", role, samples, shards, count.seconds)
    return count


def in_worker(train: Any, test: Any, plan: Any, test_lengths: tuple[int, ...]) -> tuple[Any, Any]:
    """The datasets a worker's loop reads: sharded ones as streams, with the lengths the caller counted."""
    if plan.sharded_data:
        source = as_sharded(train)
        if source is None:
            raise TypeError(
                f"Expected `datasets_function` to return the sharded train dataset it returned in the caller. "
                f"Received: {type(train).__name__} in this worker."
            )
        bounds = segment_bounds(plan.num_samples, plan.micro_batches)
        train = StreamedDataset(source, plan.shard_lengths, plan.seed, plan.shuffle_shards, bounds, plan.shuffle_window)
    if test_lengths and test is not None:
        source = as_sharded(test)
        if source is not None:
            # Each worker evaluates its own stretch of the sequence (step/plan.eval_segment_batches).
            test = StreamedDataset(source, test_lengths, plan.seed, shuffle=False)
    return train, test
