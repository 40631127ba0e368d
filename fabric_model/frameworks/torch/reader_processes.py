"""Reading micro-batches in processes, as ``DataLoader(num_workers=N)`` does, every sample seeded.

A Python-bound dataset (PIL decoding, transforms) read on threads gets about one core: the
interpreter lock. ``train(num_dataloader_processes=N)`` reads a torch worker's micro-batches in
``N`` processes forked from it, through torch's own ``DataLoader`` machinery (its shared-memory
hand-over of tensors, its order, its detection of a reader that died). What they read is what
the schedule names, in its order, nothing else (exactly once, as with threads); each read is
seeded as on the training thread (step/sample_seeds.py), and a process has generators of its
own, so torch's global one is seeded there too and the bits are those of any other reading.

The processes are started for each generation's schedule and end with it; each dies with the
worker that forked it (``PR_SET_PDEATHSIG``), so a killed worker leaves none behind
(docs/architecture.md, "Reading data").
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from ...step.sample_seeds import SeededReads

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> Callable[[int], None]:
    def init(worker_id: int) -> None:
        try:  # Linux: SIGKILL when the forking thread's process ends (a killed worker)
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # another system: DataLoader's own watchdog (5 s)
            pass
        if os.getppid() != parent:  # the worker died before the line above
            os._exit(0)

    return init


class _Keyed(torch.utils.data.Dataset):
    """What the reader processes index: lists of ``(epoch, sample)``, read as one seeded micro-batch."""

    def __init__(self, reads: SeededReads, length: int) -> None:
        self.reads, self.length = reads, length

    def __len__(self) -> int:
        return self.length

    def __getitems__(self, keys: list[tuple[int, int]]) -> Any:
        return self.reads.read(keys[0][0], np.array([i for _, i in keys]), isolated=True)


def _as_is(batch: Any) -> Any:
    return batch


class ProcessLoader:
    """The loader's face (``iterate``, ``close``) over reader processes (module docstring)."""

    def __init__(self, dataset: Any, reads: SeededReads, processes: int, epoch_of: Callable[[Hashable], int]) -> None:
        self._keyed = _Keyed(reads, len(dataset))
        self._processes = processes
        self._epoch_of = epoch_of
        self._iterator: Any = None

    def iterate(self, schedule: Iterable[tuple[Hashable, np.ndarray]]) -> Iterator[tuple[Hashable, np.ndarray, Any]]:
        """``(key, indices, batch)`` for each schedule entry, in order."""
        named: collections.deque[tuple[Hashable, np.ndarray]] = collections.deque()
        epoch_of = self._epoch_of

        def keys() -> Iterator[list[tuple[int, int]]]:
            for key, indices in schedule:  # consumed on this thread, as DataLoader hands out work
                named.append((key, indices))
                epoch = epoch_of(key)
                yield [(epoch, int(i)) for i in indices]

        loader = DataLoader(
            self._keyed,
            batch_sampler=keys(),  # any iterable of index lists
            num_workers=self._processes,
            collate_fn=_as_is,
            multiprocessing_context="fork",
            worker_init_fn=_die_with_parent(os.getpid()),
            prefetch_factor=2,
        )
        self._iterator = iter(loader)
        try:
            for batch in self._iterator:
                key, indices = named.popleft()
                yield key, indices, batch
        finally:
            self.close()

    def close(self) -> None:
        iterator, self._iterator = self._iterator, None
        if iterator is not None:
            iterator._shutdown_workers()  # now, not when collected: the generation is over
