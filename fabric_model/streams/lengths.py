"""Each shard's number of samples, counted once in the caller before any worker starts.

The plan needs them (step/stream_order.py): the epoch's sequence is cut into equal streams, so
every step but the last holds the full global batch, as with map-style data. Where the user
gave ``lengths`` nothing is read. Shards are counted on a few threads (reading is mostly
waiting on files); a shard that fails fails the run naming it, or, with
``skip_unreadable=True``, is left out (length 0) and recorded.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from .sharded import ShardedDataset, ShardReadError

log = logging.getLogger(__name__)

#: Threads that count shards at once.
COUNT_THREADS = 8


@dataclasses.dataclass(frozen=True)
class ShardCount:
    """What counting found: lengths (0 for a skipped shard), the shards skipped and why, the time taken."""

    lengths: tuple[int, ...]
    skipped: tuple[tuple[str, str], ...] = ()
    seconds: float = 0.0
    counted: bool = False


def count_shards(dataset: ShardedDataset, again: bool = True) -> ShardCount:
    """The dataset's lengths: the user's, or counted by reading every shard once (unless
    ``again`` is False and this object was counted before: ``evaluate()`` called twice)."""
    if dataset.lengths is not None:
        return ShardCount(tuple(dataset.lengths))
    if not again and isinstance(dataset.count, ShardCount):
        return dataclasses.replace(dataset.count, seconds=0.0, counted=False)
    started = time.monotonic()

    def count(index: int) -> int | ShardReadError:
        try:
            return sum(1 for _ in dataset.open(index))
        except ShardReadError as exc:
            return exc
        except Exception as exc:  # raised while iterating, after the shard opened
            return ShardReadError(f"Reading {dataset.name(index)} failed: {type(exc).__name__}: {exc}")

    indices = range(len(dataset.shards))
    with ThreadPoolExecutor(min(COUNT_THREADS, len(dataset.shards)), thread_name_prefix="fabric-count") as pool:
        results = list(pool.map(count, indices))
    lengths: list[int] = []
    skipped: list[tuple[str, str]] = []
    for index, result in zip(indices, results):
        if isinstance(result, ShardReadError):
            if not dataset.skip_unreadable:
                raise ShardReadError(
                    f"{result} HINT: fix or remove the shard, or pass ShardedDataset(..., skip_unreadable=True) "
                    "to train without it."
                ) from result.__cause__
            skipped.append((dataset.name(index), str(result)))
            lengths.append(0)
        else:
            lengths.append(result)
    seconds = time.monotonic() - started
    log.info("counted %d samples in %d shards in %.2f s", sum(lengths), len(lengths), seconds)
    dataset.count = ShardCount(tuple(lengths), tuple(skipped), seconds, counted=True)
    return dataset.count
