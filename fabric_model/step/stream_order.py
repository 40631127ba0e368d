"""Where each sample of a sharded dataset goes in an epoch (docs/architecture.md, "Sharded data").

Pure functions of ``(seed, epoch)``, the shards' lengths, the number of streams and the
shuffle window, never of the workers, so every worker, the driver and a test's reference
loop compute the same order, and a step can be re-divided among any number of workers:

- the epoch's shards are read in an order drawn from ``(seed, epoch)``: their samples,
  concatenated in that order, are the epoch's *sequence*, ``0 .. N-1``;
- the sequence is cut into ``streams`` contiguous *segments* of ``N // streams`` samples,
  the first ``N % streams`` one more, so segment lengths never grow with the stream index;
- stream ``j`` feeds micro-batch ``j`` of every step: step ``s`` takes its samples
  ``s*b .. s*b+b-1`` (fewer, or none, at the epoch's last step);
- with a shuffle window ``W > 1``, a segment is read in windows of ``W`` samples, and each
  window's samples are taken in an order drawn from ``(seed, epoch, stream, window)``.

A stream's position at a step is therefore ``s * b``: it needs no state of its own, and a
checkpoint or a worker taking a stream over recovers it from the unit alone.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

# Distinct draws from the run's seed: the shard order and the windows' orders never reuse the
# map-style permutation's stream ([seed, epoch]).
_SHARDS, _WINDOW = 2, 3


def segment(total: int, streams: int, j: int) -> tuple[int, int]:
    """Segment ``j``'s ``[start, end)`` in the epoch's sequence (as :func:`segment_bounds`)."""
    q, r = divmod(total, streams)
    start = j * q + min(j, r)
    return start, start + q + (j < r)


def segment_bounds(total: int, streams: int) -> np.ndarray:
    """``streams + 1`` offsets: segment ``j`` of the epoch's sequence is ``[b[j], b[j+1])``."""
    q, r = divmod(total, streams)
    lengths = np.full(streams, q, dtype=np.int64)
    lengths[:r] += 1
    return np.concatenate([[0], np.cumsum(lengths)])


def shard_order(seed: int, epoch: int, num_shards: int, shuffle: bool) -> np.ndarray:
    """The shards in the order the epoch reads them."""
    if not shuffle:
        return np.arange(num_shards)
    return np.random.default_rng([seed, epoch, _SHARDS]).permutation(num_shards)


@functools.lru_cache(maxsize=64)
def window_order(seed: int, epoch: int, stream: int, window: int, size: int) -> np.ndarray:
    """The order in which a window of ``size`` samples of stream ``stream`` is taken (drawn once
    per window: each of its micro-batches asks)."""
    drawn = np.random.default_rng([seed, epoch, _WINDOW, stream, window]).permutation(size)
    drawn.flags.writeable = False  # shared by every caller
    return drawn


def epoch_layout(seed: int, epoch: int, lengths: tuple[int, ...], shuffle: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(order, starts)``: the shards in reading order, and where each starts in the sequence
    (``starts[k]`` for ``order[k]``, ``starts[-1] == N``). Readers keep it per epoch."""
    order = shard_order(seed, epoch, len(lengths), shuffle)
    starts = np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64)[order])])
    order.flags.writeable = False
    starts.flags.writeable = False
    return order, starts


def locate(starts: np.ndarray, position: int) -> tuple[int, int]:
    """``(k, offset)``: sequence position ``position`` is sample ``offset`` of the ``k``-th shard read."""
    k = int(np.searchsorted(starts, position, side="right")) - 1
    return k, position - int(starts[k])


def stream_positions(
    seed: int, epoch: int, stream: int, segment: tuple[int, int], first: int, count: int, window: int
) -> np.ndarray:
    """Sequence positions of samples ``first .. first+count-1`` of ``stream`` in ``epoch``.

    ``segment`` is the stream's ``[start, end)`` in the sequence. Without a window (``window <= 1``)
    they are consecutive; with one, each comes from its window's drawn order."""
    start, end = segment
    if window <= 1 or count == 0:
        return np.arange(start + first, start + first + count, dtype=np.int64)
    length = end - start
    out = np.empty(count, dtype=np.int64)
    done = 0
    while done < count:  # window by window (a micro-batch spans at most two when count <= window)
        at = first + done
        w, into = divmod(at, window)
        lo = w * window
        n = min(count - done, window - into)
        drawn = window_order(seed, epoch, stream, w, min(window, length - lo))
        out[done : done + n] = start + lo + drawn[into : into + n]
        done += n
    return out


@functools.lru_cache(maxsize=16)
def steps_per_epoch(total: int, streams: int, per_micro_batch: int) -> int:
    """Steps until the longest stream runs dry (at least one: an empty epoch still has a step)."""
    longest = -(-total // streams)
    return max(1, -(-longest // per_micro_batch))


def micro_batch_sizes(total: int, streams: int, per_micro_batch: int, step: int) -> Sequence[int]:
    """Samples of each stream at ``step``: ``per_micro_batch`` until a stream runs dry, then its rest,
    then none; never growing with the stream index, so the non-empty ones come first."""
    q, r = divmod(total, streams)
    return [max(0, min(per_micro_batch, q + (j < r) - step * per_micro_batch)) for j in range(streams)]
