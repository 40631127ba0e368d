"""``ShardedDataset``: data read shard by shard, front to back (docs/data.md).

A shard is anything ``read_shard`` can read: a path, a URL, a row range. The training plan
never asks for a sample by index; it asks for a stretch of a shard from an offset on
(streams/reader.py), so shards in formats that cannot seek (tar, gzip, a network stream) work
as they are. A Hugging Face ``datasets.IterableDataset`` is one (its ``n_shards``), recognised
without importing ``datasets``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

#: A stream's default shuffle window: samples held per stream, read in a drawn order.
DEFAULT_SHUFFLE_WINDOW = 256


class ShardReadError(RuntimeError):
    """A shard could not be read, or held another number of samples than when it was counted."""


class ShardedDataset:
    """Samples in shards, each read front to back by ``read_shard(shard)``.

    Args:
        shards: the shards, in a list or tuple (paths, URLs, anything ``read_shard`` takes).
        read_shard: ``read_shard(shard)`` returns an iterable of the shard's samples. If it takes
            a second argument named ``start``, it is called as ``read_shard(shard, start=k)`` to
            begin at sample ``k`` (a format that can seek skips there at once); otherwise the
            first ``k`` samples are read and dropped.
        lengths: each shard's number of samples, if known. Otherwise the caller counts them
            once, before any worker starts, by reading every shard (``train()`` says how long it
            took); ``evaluate()`` and ``predict()`` count a dataset once, then keep its count.
        shuffle: read each epoch's shards in an order drawn from ``(seed, epoch)``, and each
            stream in windows of ``shuffle_window`` samples taken in a drawn order. ``False``: the
            shards' own order, front to back.
        shuffle_window: samples per window (held in memory per stream a worker reads).
        skip_unreadable: a shard that fails to read while being counted is left out of the
            run and named in a warning and in ``run.json`` instead of failing it.
    """

    def __init__(
        self,
        shards: Sequence[Any],
        read_shard: Callable[..., Iterable[Any]],
        *,
        lengths: Sequence[int] | None = None,
        shuffle: bool = True,
        shuffle_window: int = DEFAULT_SHUFFLE_WINDOW,
        skip_unreadable: bool = False,
    ) -> None:
        if isinstance(shards, (str, bytes)) or not isinstance(shards, Sequence):
            raise TypeError(
                "Expected `shards` to be a list or tuple of shards (paths, URLs, anything read_shard takes). "
                f"Received: {type(shards).__name__}. "
                "HINT: ShardedDataset(sorted(glob.glob('data/*.jsonl')), read_jsonl)."
            )
        if len(shards) == 0:
            raise ValueError("Expected `shards` to hold at least one shard. Received: an empty sequence.")
        if not callable(read_shard):
            raise TypeError(
                "Expected `read_shard` to be a function: read_shard(shard) returns an iterable of samples. "
                f"Received: {type(read_shard).__name__}."
            )
        if lengths is not None:
            if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence) or len(lengths) != len(shards):
                raise ValueError(
                    f"Expected `lengths` to be None or a list of {len(shards)} sample counts, one per shard. "
                    f"Received: {_short(lengths)}."
                )
            bad = [n for n in lengths if isinstance(n, bool) or not isinstance(n, int) or n < 0]
            if bad:
                raise ValueError(
                    f"Expected every item of `lengths` to be an int >= 0. Received: {_short(bad)} among them."
                )
        if isinstance(shuffle_window, bool) or not isinstance(shuffle_window, int) or shuffle_window < 1:
            raise ValueError(
                "Expected `shuffle_window` to be an int >= 1 (1: no shuffling inside a stream). "
                f"Received: shuffle_window={shuffle_window!r}."
            )
        self.shards = list(shards)
        self.read_shard = read_shard
        self.lengths = None if lengths is None else [int(n) for n in lengths]
        self.shuffle = bool(shuffle)
        self.shuffle_window = shuffle_window if shuffle else 1
        self.skip_unreadable = bool(skip_unreadable)
        self._seeks = _takes_start(read_shard)
        # The caller's count of the shards' lengths (streams/lengths.py), kept for this object's
        # later evaluate() and predict() calls; train() counts afresh.
        self.count: Any = None

    def __repr__(self) -> str:
        return f"ShardedDataset({len(self.shards)} shards, read_shard={getattr(self.read_shard, '__name__', '?')})"

    def name(self, index: int) -> str:
        """How errors and records name shard ``index``."""
        return f"shard {index} ({_short(self.shards[index])})"

    def open(self, index: int, start: int = 0) -> Iterator[Any]:
        """The samples of shard ``index`` from sample ``start`` on; an error names the shard."""
        shard = self.shards[index]
        try:
            if self._seeks:
                return iter(self.read_shard(shard, start=start))
            samples = iter(self.read_shard(shard))
            for _ in range(start):
                next(samples)
            return samples
        except StopIteration:
            raise ShardReadError(f"{self.name(index)} ended before sample {start}") from None
        except Exception as exc:
            raise ShardReadError(f"Reading {self.name(index)} failed: {type(exc).__name__}: {exc}") from exc


def _takes_start(read_shard: Callable[..., Any]) -> bool:
    try:
        return "start" in inspect.signature(read_shard).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def _short(obj: Any, limit: int = 80) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def is_hugging_face_iterable(obj: Any) -> bool:
    """A ``datasets.IterableDataset`` (recognised by class: ``datasets`` stays optional)."""
    return any(
        cls.__name__ == "IterableDataset" and (cls.__module__ or "").startswith("datasets") for cls in type(obj).__mro__
    )


class _HuggingFaceShard:
    """``read_shard`` of a ``datasets.IterableDataset``: its shard ``index``, alone."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __call__(self, index: int) -> Iterable[Any]:
        return self.dataset.shard(num_shards=self.dataset.n_shards, index=index, contiguous=True)


def as_sharded(obj: Any) -> ShardedDataset | None:
    """``obj`` as a :class:`ShardedDataset` if it is one or a Hugging Face iterable dataset, else None."""
    if isinstance(obj, ShardedDataset):
        return obj
    if is_hugging_face_iterable(obj):
        n = int(obj.n_shards)
        return ShardedDataset(list(range(n)), _HuggingFaceShard(obj), shuffle=True)
    return None


def unsharded_hint(obj: Any) -> str | None:
    """For an iterable without shards (a generator, a torch ``IterableDataset``), how to wrap it."""
    if not hasattr(obj, "__iter__") or isinstance(obj, (str, bytes)):
        return None
    return (
        f"HINT: a {type(obj).__name__} is read front to back with no shards, so it cannot be divided among workers "
        "exactly once per epoch. Split the data into shards (files) and pass "
        "fabric_model.ShardedDataset(shards, read_shard), where read_shard(shard) yields one shard's samples "
        "(docs/data.md), or a map-style dataset (a list, a torch Dataset with __len__ and __getitem__)."
    )
