"""Seeds set before every sample is read, so a dataset's augmentation is a function of the sample.

A dataset that flips an image when ``torch.rand(1) < 0.5`` draws from a process-wide generator.
Left alone, the draw would depend on what that generator did before: how many samples this
worker read, which worker it is, whether a step was redone after a kill. Here, before each
sample is read, every generator a read may draw from is seeded from ``(seed, epoch, index)``
(:func:`sample_seed`), and before the micro-batch is collated (a collator that masks tokens
draws too) from its first sample's. A sample then gets the same augmentation on any worker, for
any worker count, however often it is read (docs/architecture.md, "Reading data").

Which generators (:class:`Generator`): NumPy's and Python's global ones, any NumPy generator
the dataset holds as an attribute, and what the framework adds (torch's global generator, and
``torch.Generator`` objects the dataset holds: frameworks/torch/generators.py).

Where reading may happen: a generator the training thread also draws from (torch's, for
dropout) is *contended*: a reader thread seeding it would change the model's draws and the model
the reader's. Such a dataset is read on the training thread. Whether a dataset draws from one
is seen on its first read (:class:`SeededReads`); every other read is serialised by one lock
among the reader threads, which alone use the uncontended generators.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .plan import generator_seed, mix64

#: The ``epoch`` of a validation read: every validation reads a sample the same way.
VALIDATION = -1


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The 64-bit seed of sample ``index`` read in ``epoch`` (:data:`VALIDATION` for validation).

    A reference loop reproduces a sample's augmentation by seeding each generator with
    ``generator_seed(sample_seed(...), name)`` (names in :func:`global_generators`)."""
    z = mix64(seed * 0x9E3779B97F4A7C15 + 0x5851F42D4C957F2D)
    z = mix64(z ^ ((epoch + 2) * 0xD6E8FEB86659FD93))
    return mix64(z ^ (index * 0xA0761D6478BD642F))


@dataclasses.dataclass(frozen=True)
class Generator:
    """One random generator a read may draw from."""

    name: str
    seed: Callable[[int], object]
    #: A snapshot that changes when the generator draws (compared with ``==``); needed only
    #: for a contended generator.
    state: Callable[[], Any] | None = None
    #: Whether the training thread draws from it too (see the module docstring).
    contended: bool = False


def _numpy_state() -> Any:
    state: Any = np.random.get_state()
    return (state[1].tobytes(), *state[2:])


def global_generators() -> list[Generator]:
    """NumPy's and Python's process-wide generators (``np.random.*``, ``random.*``)."""
    return [
        Generator("numpy", lambda s: np.random.seed(s & 0xFFFFFFFF), _numpy_state),
        Generator("random", random.seed, random.getstate),
    ]


def _reseed_numpy(rng: Any) -> Callable[[int], None]:
    if isinstance(rng, np.random.RandomState):
        return lambda s: rng.seed(s & 0xFFFFFFFF)
    bits = type(rng.bit_generator)

    def reseed(s: int) -> None:
        rng.bit_generator.state = bits(s).state

    return reseed


def held_by(dataset: Any, kinds: tuple[type, ...]) -> Iterator[tuple[str, Any]]:
    """``(path, value)`` for each instance of ``kinds`` the dataset holds: as an attribute, in a
    list, tuple or dict attribute, or as an attribute of an attribute (a transform's); each once."""
    seen: set[int] = set()

    def visit(value: Any, path: str, depth: int) -> Iterator[tuple[str, Any]]:
        if isinstance(value, kinds):
            if id(value) not in seen:
                seen.add(id(value))
                yield path, value
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                yield from visit(item, f"{path}.{i}", depth)
        elif isinstance(value, dict):
            for key, item in value.items():
                yield from visit(item, f"{path}.{key}", depth)
        elif depth > 0 and hasattr(value, "__dict__") and not isinstance(value, type):
            for key, item in vars(value).items():
                yield from visit(item, f"{path}.{key}" if path else key, depth - 1)

    yield from visit(dataset, "", 2)


def numpy_generators_of(dataset: Any) -> list[Generator]:
    """NumPy generators the dataset holds (``self.rng = np.random.default_rng(0)``)."""
    return [
        Generator(f"dataset.{path}", _reseed_numpy(rng))
        for path, rng in held_by(dataset, (np.random.Generator, np.random.RandomState))
    ]


class SampleSeeds:
    """Seeds a set of generators for one read: a sample, or a micro-batch's collate."""

    def __init__(self, seed: int, generators: Sequence[Generator]) -> None:
        self.seed_value = seed
        self.generators = list(generators)
        self.uncontended = [g for g in self.generators if not g.contended]
        self.contended = [g for g in self.generators if g.contended]

    def seed(self, epoch: int, index: int, contended: bool) -> None:
        """Seed for sample ``index`` of ``epoch``: the contended generators too where ``contended``
        (on the training thread only)."""
        base = sample_seed(self.seed_value, epoch, index)
        for generator in self.generators if contended else self.uncontended:
            generator.seed(generator_seed(base, generator.name))

    def contended_state(self) -> list[Any]:
        return [g.state() for g in self.contended if g.state is not None]


def collate_index(first: int) -> int:
    """The index whose seed a micro-batch's collate (or read in one go) gets: its first sample's,
    in a stream of its own (negative indices are no sample's)."""
    return -2 - first


class SeededReads:
    """Reads one dataset's micro-batches with :class:`SampleSeeds`, and says where they may run.

    ``each`` reads one sample, ``at_once`` a whole micro-batch (a gather, ``__getitems__``, a
    batch-level item); ``collate`` joins samples. :meth:`read` seeds before each. ``on_caller``
    is None until the first read, which the loader makes on the training thread, shows whether
    the dataset draws from a contended generator; True then means every read stays on the
    training thread (and seeds the contended generators), False that readers may take them.
    """

    def __init__(
        self,
        seeds: SampleSeeds,
        each: Callable[[int], Any] | None,
        at_once: Callable[[np.ndarray], Any] | None,
        collate: Callable[[Sequence[Any]], Any],
    ) -> None:
        self.seeds = seeds
        self._each = each
        self._at_once = at_once
        self._collate = collate
        self._lock = threading.Lock()
        self.on_caller: bool | None = None if seeds.contended else False

    def read(self, epoch: int, indices: np.ndarray, isolated: bool = False) -> Any:
        """The micro-batch ``indices`` of ``epoch``, each part read after its seeds are set;
        ``isolated``: in a process of its own (a reader process), where no generator is contended."""
        if isolated:
            return self._read(epoch, indices, contended=True, drew=None)
        with self._lock:  # reader threads share the uncontended generators: one read at a time
            if self.on_caller is None:
                drew: list[bool] = []
                batch = self._read(epoch, indices, contended=True, drew=drew)
                self.on_caller = any(drew)
                return batch
            return self._read(epoch, indices, contended=self.on_caller, drew=None)

    def _read(self, epoch: int, indices: np.ndarray, contended: bool, drew: list[bool] | None) -> Any:
        def seeded(index: int, read: Callable[[], Any]) -> Any:
            self.seeds.seed(epoch, index, contended)
            if drew is None:
                return read()
            before = self.seeds.contended_state()  # as seeded: a draw changes it
            value = read()
            drew.append(self.seeds.contended_state() != before)
            return value

        first = collate_index(int(indices[0]))
        if self._at_once is not None:
            at_once = self._at_once
            return seeded(first, lambda: at_once(indices))
        each = self._each
        assert each is not None
        samples = [seeded(int(i), functools.partial(each, int(i))) for i in indices]
        return seeded(first, lambda: self._collate(samples))
