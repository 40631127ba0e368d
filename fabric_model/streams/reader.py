"""Reading a sharded dataset as the plan asks: stretches of the epoch's sequence, front to back.

:class:`StreamedDataset` looks like a map-style dataset to the loop (``__len__``,
``__getitems__``), so the plan, the loader and the ledger are those of map-style data; item
``epoch * N + position`` is sample ``position`` of epoch ``epoch``'s sequence (step/stream_order.py).
Behind it, each stream a worker reads has a :class:`Cursor`: an open shard and how far into
it. A worker reading its streams step after step only moves forward, so each sample is read
once. A worker that takes a stream over (another worker count, a rollback, a resume) opens
the shard where the stream stands and skips to the offset there: at most one shard's samples
read and dropped, none where ``read_shard`` takes ``start``. With a shuffle window, the
windows a stream is taking samples from are held in memory (at most two per stream).
"""

from __future__ import annotations

import itertools
import operator
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..step import stream_order as order
from .sharded import ShardedDataset, ShardReadError

_END = object()


def _take(samples: list[Any], offsets: np.ndarray) -> list[Any]:
    """``[samples[i] for i in offsets]``, in one C call."""
    if len(offsets) == 1:
        return [samples[int(offsets[0])]]
    return list(operator.itemgetter(*offsets.tolist())(samples))


class Cursor:
    """Reads one stretch of the sequence after another, front to back, from the open shard."""

    def __init__(self, dataset: ShardedDataset, lengths: Sequence[int]) -> None:
        self.dataset, self.lengths = dataset, lengths
        self.epoch = -1
        self.position = -1  # the sequence position the open shard yields next
        self.samples: Iterator[Any] | None = None
        self.k = -1  # the open shard's place in the epoch's order
        self.left = 0  # samples left in it
        self.skipped = 0  # samples read and dropped to reach a position (a test reads it)

    def read(self, epoch: int, starts: np.ndarray, shard_ids: np.ndarray, first: int, count: int) -> list[Any]:
        """Samples ``first .. first+count-1`` of the epoch's sequence (``starts``, ``shard_ids``: its layout)."""
        if epoch != self.epoch or not 0 <= self.position <= first or self._beyond_shard(starts, first):
            self._open_at(epoch, starts, shard_ids, first)
        else:
            self._drop(first - self.position)
        out: list[Any] = []
        while len(out) < count:
            if self.left == 0:
                self._open_at(epoch, starts, shard_ids, self.position)
                continue
            assert self.samples is not None
            n = min(count - len(out), self.left)
            got = list(itertools.islice(self.samples, n))  # in C: no Python step per sample
            if len(got) < n:
                self._short(shard_ids)
            out += got
            self.left -= n
            self.position += n
        return out

    def _beyond_shard(self, starts: np.ndarray, position: int) -> bool:
        return self.k < 0 or position >= int(starts[self.k + 1])

    def _open_at(self, epoch: int, starts: np.ndarray, shard_ids: np.ndarray, position: int) -> None:
        if self.left == 0:
            self._finish_shard(shard_ids)
        self.close()
        # The last shard starting at or before the position: empty shards (skipped ones too) hold none.
        k, offset = order.locate(starts, position)
        index = int(shard_ids[k])
        self.samples = self.dataset.open(index, offset)
        self.epoch, self.k, self.position = epoch, k, position
        self.left = self.lengths[index] - offset
        if not self.dataset._seeks:
            self.skipped += offset

    def _drop(self, n: int) -> None:
        assert self.samples is not None
        if sum(1 for _ in itertools.islice(self.samples, n)) < n:
            raise ShardReadError(self._count_message(self.k, fewer=True))
        self.position += n
        self.left -= n
        self.skipped += n

    def _finish_shard(self, shard_ids: np.ndarray) -> None:
        """A shard that has more samples than counted would lose them silently: say so."""
        if self.samples is not None and self.k >= 0 and next(self.samples, _END) is not _END:
            raise ShardReadError(self._count_message(self.k, fewer=False, shard_ids=shard_ids))

    def _short(self, shard_ids: np.ndarray) -> None:
        raise ShardReadError(self._count_message(self.k, fewer=True, shard_ids=shard_ids))

    def _count_message(self, k: int, fewer: bool, shard_ids: np.ndarray | None = None) -> str:
        index = int(shard_ids[k]) if shard_ids is not None else k
        return (
            f"{self.dataset.name(index)} yielded {'fewer' if fewer else 'more'} samples than the "
            f"{self.lengths[index]} it had when the run was planned. HINT: shards must not change while a run "
            "trains on them (and across a resume): copy the data, or start a new run."
        )

    def close(self) -> None:
        close = getattr(self.samples, "close", None)
        if callable(close):
            close()
        self.samples, self.k, self.left = None, -1, 0


class StreamedDataset:
    """A sharded dataset addressed as ``epoch * N + position`` (module docstring).

    Args:
        dataset: the shards and how to read them.
        lengths: each shard's samples, as the plan has them.
        seed: the run's seed (the shard order of each epoch).
        shuffle: whether the epoch's shards are read in a drawn order.
        segments: the sequence positions where each stream starts (and the last one ends):
            each stream gets its own cursor. A validation set has one segment per worker.
        window: the shuffle window (1: none); windows start at their stream's start.
    """

    def __init__(
        self,
        dataset: ShardedDataset,
        lengths: Sequence[int],
        seed: int,
        shuffle: bool,
        segments: np.ndarray | None = None,
        window: int = 1,
    ) -> None:
        if len(lengths) != len(dataset.shards):
            raise ValueError(
                f"Expected the sharded dataset from `datasets_function` to hold the {len(lengths)} shards it held in "
                f"the caller. Received: {len(dataset.shards)} shards in this worker. HINT: list the shards in a "
                "fixed order (sorted(glob.glob(...))) that every host sees alike."
            )
        self.dataset, self.lengths = dataset, tuple(int(n) for n in lengths)
        self.total = sum(self.lengths)
        self.seed, self.shuffle, self.window = seed, shuffle, window
        self.segments = np.asarray(segments if segments is not None else [0, self.total], dtype=np.int64)
        self._cursors: dict[int, Cursor] = {}
        # By epoch: not re-drawn, nor the lengths hashed, at every read.
        self._layouts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._windows: OrderedDict[tuple[int, int, int], list[Any]] = OrderedDict()
        self._lock = threading.Lock()  # a loader thread of the previous generation may still be reading

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, item: int) -> Any:
        return self.__getitems__([item])[0]

    def __getitems__(self, items: Sequence[int]) -> list[Any]:
        """The samples at ``items`` (one epoch, one stream: a micro-batch), in that order."""
        positions = np.asarray(items, dtype=np.int64)
        if positions.size == 0:
            return []
        epoch = int(positions[0]) // self.total
        positions = positions - epoch * self.total
        stream = int(np.searchsorted(self.segments, positions[0], side="right")) - 1
        with self._lock:
            if self.window <= 1:
                lo = int(positions.min())
                got = self._read(epoch, stream, lo, int(positions.max()) + 1 - lo)
                return _take(got, positions - lo)
            # A micro-batch takes from at most two windows: each window's samples in one take.
            start = int(self.segments[stream])
            windows = (positions - start) // self.window
            if windows[0] == windows[-1] and (windows == windows[0]).all():  # the common case: one window
                w = int(windows[0])
                return _take(self._window(epoch, stream, w), positions - start - w * self.window)
            out: list[Any] = [None] * len(positions)
            for w in np.unique(windows):
                mask = windows == w
                taken = _take(self._window(epoch, stream, int(w)), positions[mask] - start - w * self.window)
                for i, sample in zip(np.flatnonzero(mask).tolist(), taken):
                    out[i] = sample
            return out

    def _read(self, epoch: int, stream: int, first: int, count: int) -> list[Any]:
        layout = self._layouts.get(epoch)
        if layout is None:
            if len(self._layouts) >= 4:
                self._layouts.pop(min(self._layouts))
            layout = self._layouts[epoch] = order.epoch_layout(self.seed, epoch, self.lengths, self.shuffle)
        shard_ids, starts = layout
        cursor = self._cursors.get(stream)
        if cursor is None:
            cursor = self._cursors[stream] = Cursor(self.dataset, self.lengths)
        return cursor.read(epoch, starts, shard_ids, first, count)

    def _window(self, epoch: int, stream: int, w: int) -> list[Any]:
        """Window ``w`` of ``stream``'s segment, in the sequence's order (held: two per stream)."""
        key = (epoch, stream, w)
        samples = self._windows.get(key)
        if samples is None:
            start, end = int(self.segments[stream]), int(self.segments[stream + 1])
            lo = start + w * self.window
            samples = self._windows[key] = self._read(epoch, stream, lo, min(self.window, end - lo))
            # Keep the two newest windows of each stream: a micro-batch spans at most two.
            mine = [k for k in self._windows if k[1] == stream]
            for old in mine[:-2]:
                del self._windows[old]
        return samples

    @property
    def skipped(self) -> int:
        """Samples read and dropped so far to reach a stream's position."""
        return sum(c.skipped for c in self._cursors.values())

    def close(self) -> None:
        for cursor in self._cursors.values():
            cursor.close()
        self._cursors.clear()
        self._windows.clear()
