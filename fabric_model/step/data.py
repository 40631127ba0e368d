"""Data: dataset checks, and a loader that prefetches upcoming micro-batches on threads."""

from __future__ import annotations

import collections
import functools
import operator
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from .sample_seeds import SampleSeeds, SeededReads

Collate = Callable[[Sequence[Any]], Any]
#: Reads a whole micro-batch at once, given its indices (a framework's gather, see ``FrameworkAdapter.reader``).
Reader = Callable[[np.ndarray], Any]


def is_map_dataset(obj: Any) -> bool:
    """A map-style dataset: sized and indexable by integer position."""
    return hasattr(obj, "__len__") and hasattr(obj, "__getitem__")


def is_sample_list(dataset: Any) -> bool:
    """A plain list or tuple of samples (not a subclass: it may override ``__getitem__``)."""
    return type(dataset) in (list, tuple)


def fetch(dataset: Any, indices: np.ndarray, collate: Collate) -> Any:
    """Read ``indices`` from ``dataset`` and collate them into one batch.

    A dataset with ``__getitems__`` (torch's batched-read protocol, as its ``DataLoader``
    uses it) is asked once for all of them, a list or tuple in one C call; any other item by item."""
    if is_sample_list(dataset):
        return collate(
            list(operator.itemgetter(*indices.tolist())(dataset)) if len(indices) > 1 else [dataset[int(indices[0])]]
        )
    getitems = getattr(dataset, "__getitems__", None)
    if callable(getitems):
        return collate(getitems([int(i) for i in indices]))
    return collate([dataset[int(i)] for i in indices])


def reads_at_once(dataset: Any, reader: Reader | None) -> bool:
    """Whether a micro-batch of ``dataset`` is one read (a gather, ``__getitems__``, a list's
    items taken at once), not one per sample: such reads stay on the training thread by default."""
    return reader is not None or is_sample_list(dataset) or callable(getattr(dataset, "__getitems__", None))


def loader_threads(requested: int | None, at_once: bool, cores: int) -> int:
    """How many threads read ahead: the user's number, else a share of this worker's cores.

    The default counts the readers in the worker's thread budget: on 2 cores every reader
    thread takes time from the compute threads, and a micro-batch read in one gather costs
    less than handing it over from another thread, so such a dataset gets none. A list's
    samples are in memory already: its collate, under the interpreter's lock on any thread,
    is all there is to read, and on a reader thread it ran slower (benchmarks/README.md,
    "Real models, one engine beside their plain loops"). Item by item, reading overlaps
    compute: one thread per two cores, up to 4."""
    if requested is not None:
        return requested
    return 0 if at_once else max(1, min(4, cores // 2))


class Loader(Protocol):
    """What a worker reads its micro-batches through: :class:`PrefetchLoader` (the training thread,
    reader threads) or a framework's reader processes (``FrameworkAdapter.process_loader``)."""

    def iterate(self, schedule: Iterable[tuple[Hashable, np.ndarray]]) -> Iterator[tuple[Hashable, np.ndarray, Any]]:
        """``(key, indices, batch)`` for each schedule entry, in order."""
        ...

    def close(self) -> None: ...


class PrefetchLoader:
    """Yields collated batches for a schedule of ``(key, indices)``, reading ahead on threads.

    ``threads`` threads keep up to ``2 * threads`` upcoming batches in flight, so reading and
    collating overlap with compute. With ``threads=0`` batches are read on the caller's
    thread. The loader never reads a batch the schedule does not name, so what a worker
    reads is exactly what its plan assigns it.

    With ``seeded`` every read sets its samples' seeds (step/sample_seeds.py; ``epoch_of`` gives
    a key's epoch): the first read is made on the caller's thread, and so is every later one
    when that read drew from a generator the caller's thread uses too.
    """

    def __init__(
        self,
        dataset: Any,
        collate: Collate,
        threads: int,
        reader: Reader | None = None,
        seeded: SeededReads | None = None,
        epoch_of: Callable[[Hashable], int] | None = None,
    ) -> None:
        self._dataset = dataset
        self._collate = collate
        self._reader = reader
        self._seeded = seeded
        self._epoch_of = epoch_of
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None

    def _on_caller(self) -> bool:
        return self._threads == 0 or (self._seeded is not None and self._seeded.on_caller is not False)

    def iterate(self, schedule: Iterable[tuple[Hashable, np.ndarray]]) -> Iterator[tuple[Hashable, np.ndarray, Any]]:
        """``(key, indices, batch)`` for each schedule entry, in order."""
        entries = iter(schedule)
        if self._threads == 0:  # every read on this thread: nothing to decide per entry
            reader = self._reader if self._seeded is None else None  # a gather, called without _read
            for key, indices in entries:
                yield key, indices, reader(indices) if reader is not None else self._read(key, indices)
            return
        while self._on_caller():
            entry = next(entries, None)
            if entry is None:
                return
            key, indices = entry
            yield key, indices, self._read(key, indices)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="fabric-data")
        pool = self._pool
        pending: collections.deque[tuple[Hashable, np.ndarray, Future[Any]]] = collections.deque()
        depth = 2 * self._threads
        try:
            while True:
                while len(pending) < depth:
                    entry = next(entries, None)
                    if entry is None:
                        break
                    key, indices = entry
                    pending.append((key, indices, pool.submit(self._read, key, indices)))
                if not pending:
                    return
                key, indices, future = pending.popleft()
                yield key, indices, future.result()
        finally:
            for _, _, future in pending:
                future.cancel()

    def _read(self, key: Hashable, indices: np.ndarray) -> Any:
        if self._seeded is not None:
            assert self._epoch_of is not None
            return self._seeded.read(self._epoch_of(key), indices)
        return self._reader(indices) if self._reader is not None else fetch(self._dataset, indices, self._collate)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def is_batch_level(dataset: Any) -> bool:
    """A Keras ``PyDataset`` / ``Sequence``: each item is already a whole batch ``(x, y)``.

    Recognised by class, without importing Keras where the user does not use it."""
    for cls in type(dataset).__mro__:
        if cls.__name__ in {"PyDataset", "Sequence"} and (cls.__module__ or "").startswith(
            ("keras", "tensorflow", "tf_keras")
        ):
            return True
    return False


def first_of(samples: Sequence[Any]) -> Any:
    """The collate of a batch-level dataset: a micro-batch is one of its items, as it is."""
    return samples[0]


def own_shuffle(dataset: Any) -> bool:
    """A Keras image ``Iterator`` (``ImageDataGenerator().flow(..., shuffle=True)``): a batch-level
    dataset whose batches are drawn from its own shuffled ``index_array``."""
    return (
        is_batch_level(dataset)
        and bool(getattr(dataset, "shuffle", False))
        and callable(getattr(dataset, "_get_batches_of_transformed_samples", None))
        and isinstance(getattr(dataset, "n", None), int)
        and isinstance(getattr(dataset, "batch_size", None), int)
    )


class EpochShuffledBatches:
    """A Keras image ``Iterator`` that shuffles as the plan does: the same batches on every worker.

    Such an iterator shuffles its samples with NumPy's global generator, differently in each
    worker process, so the plan's batch ``i`` would hold different samples on different workers
    and exactly-once would break. Here item ``epoch * len + i`` is batch ``i`` of epoch
    ``epoch``: samples ``order[i*b:(i+1)*b]`` of an order drawn from ``(seed, epoch)`` only, read
    through the iterator's own ``_get_batches_of_transformed_samples`` (augmentation included).
    With ``seeds``, each sample is transformed on its own after its seeds are set (step/sample_seeds.py),
    so its flips and shifts do not depend on the batch it is in. It keeps no state between
    calls, so prefetching threads and joining workers agree; each sample is in exactly one batch
    per epoch, and the plan uses each batch exactly once.
    """

    def __init__(self, inner: Any, seed: int, seeds: SampleSeeds | None = None) -> None:
        self.inner = inner
        self.seed = seed
        self.seeds = seeds
        self.items = (inner.n + inner.batch_size - 1) // inner.batch_size

    def __len__(self) -> int:
        return self.items

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's sample order (a stream of its own: the plan's batch order uses ``(seed, epoch)``)."""
        return _epoch_order(self.seed, epoch, self.inner.n)

    def __getitem__(self, item: int) -> Any:
        epoch, i = divmod(int(item), self.items)
        b = self.inner.batch_size
        samples = self.order(epoch)[i * b : (i + 1) * b]
        if self.seeds is None:
            return self.inner._get_batches_of_transformed_samples(samples)
        parts = []
        for k in range(len(samples)):  # the reads' lock is held (SeededReads): the generators are this thread's
            self.seeds.seed(epoch, int(samples[k]), contended=False)
            parts.append(self.inner._get_batches_of_transformed_samples(samples[k : k + 1]))
        return _joined(parts)


def _joined(parts: list[Any]) -> Any:
    """One batch from one-sample batches of the same structure (arrays, tuples or lists of them, None)."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, (tuple, list)):
        return type(first)(_joined([part[k] for part in parts]) for k in range(len(first)))
    return np.concatenate(parts, axis=0)


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """Drawn once per epoch, not once per batch (every batch of an epoch reads it)."""
    order = np.random.default_rng([seed, epoch, 1]).permutation(n)
    order.flags.writeable = False  # shared by every caller
    return order
