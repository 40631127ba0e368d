"""The training plan: which samples make each step and micro-batch, and who computes them.

Everything here is a pure function of ``(seed, epoch, step, micro-batch)`` and the dataset
length, so every worker, the driver and a test's reference loop compute the same plan
independently, and a step can be re-divided among any number of live workers (docs/architecture.md, "The step").
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import stream_order as streams


def epoch_permutation(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    """The order in which epoch ``epoch`` visits the ``num_samples`` training samples."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def micro_batch_seed(seed: int, epoch: int, step: int, micro_batch: int) -> int:
    """The RNG seed set before micro-batch ``micro_batch`` of ``step`` runs its forward pass.

    Randomness inside the model (dropout) then depends on the micro-batch, never on which
    worker computed it (docs/architecture.md, "Invariants", 3). A reference loop reproduces a run by calling
    ``torch.manual_seed(micro_batch_seed(...))`` before each micro-batch.
    """
    state = np.random.SeedSequence([seed, epoch, step, micro_batch]).generate_state(2, np.uint32)
    # 63 bits: valid for torch.manual_seed and for tf.random.set_seed.
    return int((int(state[0]) << 31) ^ int(state[1])) & ((1 << 63) - 1)


_MASK64 = (1 << 64) - 1


def mix64(z: int) -> int:
    """splitmix64's finaliser: every input bit reaches every output bit; cheap enough for every
    micro-batch and every sample read."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def generator_seed(seed: int, name: str) -> int:
    """The seed of the generator called ``name`` before the micro-batch or sample read whose seed
    is ``seed``: each generator its own stream (the name mixed in, so two generators, or one and
    the global, do not draw the same numbers). 63 bits.

    A model's own ``torch.Generator`` is named by its attribute path (``"noise"``,
    ``"blocks.0.gen"``) and seeded before each micro-batch (:func:`micro_batch_seed`), so it
    gives, like torch's global generator, the same draws for a micro-batch whichever worker runs
    it: a reference loop calls ``model.noise.manual_seed(generator_seed(micro_batch_seed(...),
    "noise"))``. A dataset's generators are seeded per sample (step/sample_seeds.py).
    """
    return mix64(seed ^ (zlib.crc32(name.encode()) * 0x9E3779B97F4A7C15)) & ((1 << 63) - 1)


# numpy's SeedSequence (numpy/random/bit_generator.pyx), its pool of 4 words and its constants:
# micro_batch_seeds computes what micro_batch_seed does for a whole block of steps at once.
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R, _XSHIFT, _MASK = 0xCA01F9DD, 0x4973F715, 16, 0xFFFFFFFF


def micro_batch_seeds(seed: int, epoch: int, steps: np.ndarray, micro_batches: int) -> np.ndarray:
    """``micro_batch_seed(seed, epoch, step, j)`` for every ``step`` in ``steps`` and ``j`` below
    ``micro_batches``, as an int64 array ``[len(steps), micro_batches]``: the same values, in
    vectorised uint32 arithmetic (a few microseconds a step less than one SeedSequence each;
    tests/test_units.py checks them against it). Words of 32 bits or more fall back to it."""
    steps = np.asarray(steps, dtype=np.int64)
    if not (
        0 <= seed <= _MASK and 0 <= epoch <= _MASK and (steps.size == 0 or 0 <= steps.min() <= steps.max() <= _MASK)
    ):
        return np.array(
            [[micro_batch_seed(seed, epoch, int(s), j) for j in range(micro_batches)] for s in steps], dtype=np.int64
        ).reshape(len(steps), micro_batches)
    shape = (len(steps), micro_batches)
    words = [
        np.full(shape, seed, np.uint32),
        np.full(shape, epoch, np.uint32),
        np.broadcast_to(steps.astype(np.uint32)[:, None], shape),
        np.broadcast_to(np.arange(micro_batches, dtype=np.uint32)[None, :], shape),
    ]
    constant = _INIT_A

    def hashmix(value: np.ndarray) -> np.ndarray:
        nonlocal constant
        value = value ^ np.uint32(constant)
        constant = (constant * _MULT_A) & _MASK
        value = value * np.uint32(constant)
        return value ^ (value >> np.uint32(_XSHIFT))

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        result: np.ndarray = np.uint32(_MIX_MULT_L) * x - np.uint32(_MIX_MULT_R) * y
        return result ^ (result >> np.uint32(_XSHIFT))

    pool = [hashmix(word) for word in words]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    state, constant = [], _INIT_B
    for word in pool[:2]:  # generate_state(2): the pool's first two words, hashed again
        value = word ^ np.uint32(constant)
        constant = (constant * _MULT_B) & _MASK
        value = value * np.uint32(constant)
        state.append((value ^ (value >> np.uint32(_XSHIFT))).astype(np.int64))
    return ((state[0] << 31) ^ state[1]) & ((1 << 63) - 1)


def assigned_micro_batches(num_micro_batches: int, rank: int, world_size: int) -> range:
    """The micro-batches of a step that worker ``rank`` of ``world_size`` computes (round-robin)."""
    return range(rank, num_micro_batches, world_size)


@functools.lru_cache(maxsize=8)
def plan_shares(num_micro_batches: int, world_size: int) -> Mapping[int, tuple[int, ...]]:
    """Every rank's micro-batches of a step of ``num_micro_batches``, the same object for the same
    arguments: the driver records them every step, and a generation's steps (but an epoch's short
    last) share them, so building them once a generation keeps the record O(1) a step
    (docs/architecture.md, "Scale")."""
    return types.MappingProxyType(
        {rank: tuple(assigned_micro_batches(num_micro_batches, rank, world_size)) for rank in range(world_size)}
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    """The step layout of a run.

    Attributes:
        num_samples: training samples per epoch.
        items_per_micro_batch: dataset items per micro-batch (the last micro-batch of an epoch may
            be short): ``train()``'s ``batch_size`` samples, or 1 item of a dataset that yields
            whole batches.
        micro_batches: micro-batches per full step.
        seed: the run's seed.
        shard_lengths: for a sharded dataset (streams/), each shard's samples: micro-batch ``j``
            of every step then reads stream ``j`` (step/stream_order.py); empty for map-style data.
        shuffle_shards: a sharded dataset's shards are read in an order drawn per epoch.
        shuffle_window: a sharded dataset's streams are read in windows of this many samples,
            each taken in a drawn order (1: in the shards' own order).
    """

    num_samples: int
    items_per_micro_batch: int
    micro_batches: int
    seed: int
    shard_lengths: tuple[int, ...] = ()
    shuffle_shards: bool = True
    shuffle_window: int = 1

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Plan:
        """The plan a checkpoint or ``run.json`` holds. Those written before the field had its
        name call ``items_per_micro_batch`` ``batch_size``, and still resume."""
        fields = dict(record)
        if "batch_size" in fields:
            fields["items_per_micro_batch"] = fields.pop("batch_size")
        return cls(**fields)

    def __post_init__(self) -> None:
        # run.json holds the lengths as a JSON list: the plan read back must equal the one written.
        object.__setattr__(self, "shard_lengths", tuple(int(n) for n in self.shard_lengths))

    # Cached: the step path asks a dozen times a step (the plan never changes; the cache is
    # no field, so equality, asdict and replace are the fields' alone).
    @functools.cached_property
    def sharded_data(self) -> bool:
        """Whether the training data is read as streams of shards (step/stream_order.py)."""
        return bool(self.shard_lengths)

    @functools.cached_property
    def global_batch(self) -> int:
        return self.items_per_micro_batch * self.micro_batches

    @functools.cached_property
    def steps_per_epoch(self) -> int:
        if self.sharded_data:
            return streams.steps_per_epoch(self.num_samples, self.micro_batches, self.items_per_micro_batch)
        return math.ceil(self.num_samples / self.global_batch)

    def step_samples(self, epoch: int, step: int) -> int:
        """How many samples step ``step`` holds (the last step of an epoch may be short)."""
        if self.sharded_data:
            return sum(self._stream_sizes(step))
        start = step * self.global_batch
        return max(0, min(self.global_batch, self.num_samples - start))

    def num_micro_batches(self, epoch: int, step: int) -> int:
        if self.sharded_data:  # the streams not yet dry: they come first
            return sum(1 for n in self._stream_sizes(step) if n > 0)
        return math.ceil(self.step_samples(epoch, step) / self.items_per_micro_batch)

    def _stream_sizes(self, step: int) -> Sequence[int]:
        """A sharded dataset's samples of each stream at ``step``."""
        return streams.micro_batch_sizes(self.num_samples, self.micro_batches, self.items_per_micro_batch, step)

    def micro_batch_indices(
        self, epoch: int, step: int, micro_batch: int, permutation: np.ndarray | None = None
    ) -> np.ndarray:
        """Dataset indices of micro-batch ``micro_batch`` of ``step`` in ``epoch``; for a sharded
        dataset, positions in the epoch's sequence of samples (step/stream_order.py)."""
        if self.sharded_data:
            segment = streams.segment(self.num_samples, self.micro_batches, micro_batch)
            first = step * self.items_per_micro_batch
            count = max(0, min(self.items_per_micro_batch, segment[1] - segment[0] - first))
            return streams.stream_positions(self.seed, epoch, micro_batch, segment, first, count, self.shuffle_window)
        perm = permutation if permutation is not None else epoch_permutation(self.seed, epoch, self.num_samples)
        start = step * self.global_batch + micro_batch * self.items_per_micro_batch
        end = min(start + self.items_per_micro_batch, (step + 1) * self.global_batch, self.num_samples)
        return perm[start:end]


def eval_batches(num_samples: int, items: int, rank: int, world_size: int) -> list[np.ndarray]:
    """The test-set batches (in order, unshuffled) that worker ``rank`` evaluates."""
    starts = range(rank * items, num_samples, world_size * items)
    return [np.arange(s, min(s + items, num_samples)) for s in starts]


def eval_segment_batches(num_samples: int, items: int, rank: int, world_size: int) -> list[np.ndarray]:
    """A sharded test set's batches for worker ``rank``: its own contiguous stretch of the
    sequence, so each worker reads its shards front to back (streams/reader.py) instead of
    every worker reading every shard to take every ``world_size``-th batch."""
    bounds = streams.segment_bounds(num_samples, world_size)
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    return [np.arange(s, min(s + items, hi)) for s in range(lo, hi, items)]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The run as a sequence of *units*: each epoch's steps, then its validation slot.

    A worker's position is the index of the next unit to run; a generation change resumes
    every worker at the same unit. Unit ``u`` is step ``u % (S + 1)`` of epoch ``u // (S + 1)``
    when that is below ``S`` (steps per epoch), else the epoch's validation slot, which is a
    no-op unless validation is due after that epoch.
    """

    plan: Plan
    epochs: int
    validation_freq: int
    has_test: bool

    @functools.cached_property
    def units_per_epoch(self) -> int:
        return self.plan.steps_per_epoch + 1

    @functools.cached_property
    def total_units(self) -> int:
        return self.epochs * self.units_per_epoch

    def locate(self, unit: int) -> tuple[int, int | None]:
        """``(epoch, step)`` of a training unit, or ``(epoch, None)`` for a validation slot."""
        epoch, k = divmod(unit, self.units_per_epoch)
        return epoch, (k if k < self.plan.steps_per_epoch else None)

    def unit(self, epoch: int, step: int) -> int:
        return epoch * self.units_per_epoch + step

    def steps_before(self, unit: int) -> int:
        """How many training steps come before ``unit`` (validation slots are not steps): the
        run's iteration count at that position."""
        epoch, k = divmod(unit, self.units_per_epoch)
        return epoch * self.plan.steps_per_epoch + min(k, self.plan.steps_per_epoch)

    def validation_due(self, epoch: int) -> bool:
        return self.has_test and (epoch + 1) % self.validation_freq == 0


class MicroBatchSeeds:
    """:func:`micro_batch_seed` for the steps a worker runs, a block of steps at a time
    (:func:`micro_batch_seeds`): a lookup a micro-batch instead of a SeedSequence."""

    BLOCK = 1024

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._key: tuple[int, int] | None = None
        self._table = np.zeros((0, 0), dtype=np.int64)

    def __call__(self, epoch: int, step: int, micro_batch: int) -> int:
        block = step // self.BLOCK
        if self._key != (epoch, block):
            first = block * self.BLOCK
            steps = np.arange(first, min(first + self.BLOCK, self.plan.steps_per_epoch))
            self._table = micro_batch_seeds(self.plan.seed, epoch, steps, self.plan.micro_batches)
            self._key = (epoch, block)
        return int(self._table[step % self.BLOCK, micro_batch])
