"""Seeds per sample (step/sample_seeds.py), in-process: a sample's augmentation is a function of
``(seed, epoch, index)``, whatever was read before it, on whichever thread, in whichever batch."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from fabric_model.frameworks.torch.generators import read_generators
from fabric_model.step.data import PrefetchLoader
from fabric_model.step.sample_seeds import (
    VALIDATION,
    SampleSeeds,
    SeededReads,
    generator_seed,
    global_generators,
    numpy_generators_of,
    sample_seed,
)


class Draws:
    """Each sample: draws from every kind of generator a dataset may use."""

    def __init__(self, n: int = 40, torch_global: bool = True) -> None:
        self.n = n
        self.torch_global = torch_global
        self.gen = torch.Generator().manual_seed(123)  # the dataset's own generators
        self.rng = np.random.default_rng(7)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        values = [
            float(i),
            np.random.rand(),
            random.random(),
            float(torch.rand(1, generator=self.gen)),
            float(self.rng.random()),
        ]
        if self.torch_global:
            values.append(float(torch.rand(1)))
        return torch.tensor(values, dtype=torch.float64)


def collate_with_noise(samples):
    """A collator that draws too (as a masking collator does)."""
    return torch.cat([default_collate(samples), torch.full((1, len(samples[0])), np.random.rand())])


def collate_drawing_from_torch(samples):
    return torch.cat([default_collate(samples), torch.rand(1, len(samples[0]), dtype=torch.float64)])


def reads_for(dataset, seed: int = 3, collate=collate_with_noise) -> SeededReads:
    seeds = SampleSeeds(seed, [*global_generators(), *numpy_generators_of(dataset), *read_generators(dataset)])
    return SeededReads(seeds, dataset.__getitem__, None, collate)


def test_a_sample_reads_the_same_whatever_was_read_before_and_in_which_batch():
    data = Draws()
    first = reads_for(data).read(0, np.array([5, 9, 2]))
    other = reads_for(Draws())
    other.read(0, np.array([1, 2, 3, 4]))  # other reads first: generators advanced
    torch.rand(10), np.random.rand(10), random.random()
    again = other.read(0, np.array([2, 5]))
    assert torch.equal(again[1], first[0]) and torch.equal(again[0], first[2])
    alone = other.read(0, np.array([9]))
    assert torch.equal(alone[0], first[1])


def test_every_generator_is_seeded_and_each_draws_its_own_numbers():
    row = reads_for(Draws()).read(0, np.array([4]))[0]
    draws = row[1:].tolist()
    assert len(set(draws)) == len(draws), "two generators drew the same number"
    # The numbers are the documented function of (seed, epoch, index, generator name).
    base = sample_seed(3, 0, 4)
    np.random.seed(generator_seed(base, "numpy") & 0xFFFFFFFF)
    assert draws[0] == np.random.rand()
    torch.manual_seed(generator_seed(base, "torch"))
    assert draws[-1] == float(torch.rand(1))


def test_epochs_and_validation_read_a_sample_differently_and_validation_always_alike():
    reads = reads_for(Draws())
    e0, e1 = reads.read(0, np.array([4])), reads.read(1, np.array([4]))
    v1, v2 = reads.read(VALIDATION, np.array([4])), reads.read(VALIDATION, np.array([4]))
    assert not torch.equal(e0, e1) and not torch.equal(e0, v1)
    assert torch.equal(v1, v2)


def test_a_dataset_that_draws_from_torchs_global_generator_is_read_on_the_training_thread():
    drawing, numpy_only = reads_for(Draws()), reads_for(Draws(torch_global=False))
    assert drawing.on_caller is None and numpy_only.on_caller is None
    drawing.read(0, np.array([0, 1]))
    numpy_only.read(0, np.array([0, 1]))
    assert drawing.on_caller is True
    assert numpy_only.on_caller is False
    collating = reads_for(Draws(torch_global=False), collate=collate_drawing_from_torch)
    collating.read(0, np.array([0, 1]))
    assert collating.on_caller is True


def test_readers_on_threads_read_the_bits_of_the_training_thread():
    schedule = [((0, s, 0), np.arange(s * 4, s * 4 + 4) % 40) for s in range(12)]
    inline = PrefetchLoader(
        None, collate_with_noise, 0, seeded=reads_for(Draws(torch_global=False)), epoch_of=lambda k: k[0]
    )
    threaded_reads = reads_for(Draws(torch_global=False))
    threaded = PrefetchLoader(None, collate_with_noise, 3, seeded=threaded_reads, epoch_of=lambda k: k[0])
    try:
        one = [b for _, _, b in inline.iterate(schedule)]
        other = [b for _, _, b in threaded.iterate(schedule)]
    finally:
        threaded.close()
    assert threaded_reads.on_caller is False  # the first read said so: the rest went to threads
    assert all(torch.equal(a, b) for a, b in zip(one, other))


def test_a_read_on_the_training_thread_leaves_the_models_generator_to_its_own_seed():
    """The step seeds torch's generator for the micro-batch after reading it: a read in between
    leaves no trace in the model's draws."""
    reads = reads_for(Draws())
    torch.manual_seed(11)
    expected = torch.rand(3)
    reads.read(0, np.array([1, 2]))
    torch.manual_seed(11)
    assert torch.equal(torch.rand(3), expected)


def test_reader_processes_are_checked_and_refused_for_keras_before_any_worker_starts(tmp_path):
    from fabric_model import FabricModel
    from fabric_model.frameworks import framework_named

    model = torch.nn.Linear(4, 2)
    data = [(torch.randn(4), 0) for _ in range(8)]
    fm = FabricModel(
        model, lambda: (data, None), torch.nn.functional.cross_entropy, torch.optim.SGD(model.parameters())
    )
    with pytest.raises(ValueError, match=r"num_dataloader_processes.*Received: num_dataloader_processes=-1"):
        fm.train(1, 4, 1, run_dir=tmp_path / "run", num_dataloader_processes=-1)
    with pytest.raises(ValueError, match=r"for a keras model: reading in processes is for torch models"):
        framework_named("keras").check_reader_processes(2)
    framework_named("torch").check_reader_processes(2)  # torch reads in processes
