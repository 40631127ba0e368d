"""What seeding every sample costs a worker's reading (step/sample_seeds.py), in one process.

    PYTHONPATH=. python benchmarks/bench_reading.py            # 5 interleaved rounds
    PYTHONPATH=. python benchmarks/bench_reading.py --rounds 3 --samples 4096

A Python-bound dataset (each sample: a 3x32x32 image cropped, flipped and jittered with torch
operations drawn from torch's global generator, as torchvision's transforms draw) is read in
micro-batches of 64 by the worker's loader (``step/data.PrefetchLoader``), while the caller's
thread spends as long on each micro-batch as a step would (``--compute`` ms of a matrix product,
which releases the interpreter lock as a model's operators do). Rows:

- ``DataLoader, 0 workers``: torch's loader on the training thread, the plain loop's baseline;
- ``DataLoader, 2 workers``: in 2 processes (reading beside the step);
- ``threads, unseeded``: the loader's reader threads without seeds (what a worker did before
  sample seeds; the augmentation then escapes them);
- ``seeded, training thread``: the same dataset seeded per sample, read on the training thread,
  where a dataset that draws from torch's generator is read;
- ``seeded, threads (NumPy draws)``: the same transforms drawing from NumPy's generator instead,
  which reader threads may seed: read on 2 threads under the reads' lock;
- ``seeded, 2 processes``: the torch-drawing dataset seeded per sample in 2 reader processes
  (``train(num_dataloader_processes=2)``: frameworks/torch/reader_processes.py).

Samples per second over the run (compute included), median of the rounds, and each row's
ratio to ``DataLoader, 0 workers`` of the same round; the process's CPU seconds per 1,000
samples (the readers' processes included for DataLoader's workers).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, default_collate

from fabric_model.frameworks.torch.generators import read_generators
from fabric_model.frameworks.torch.reader_processes import ProcessLoader
from fabric_model.step.data import PrefetchLoader, fetch
from fabric_model.step.sample_seeds import SampleSeeds, SeededReads, global_generators, numpy_generators_of

BATCH = 64


class Augmenting(torch.utils.data.Dataset):
    def __init__(self, n: int, numpy_draws: bool = False) -> None:
        self.images = torch.rand(n, 3, 36, 36, generator=torch.Generator().manual_seed(0))
        self.numpy_draws = numpy_draws

    def __len__(self) -> int:
        return len(self.images)

    def _uniform(self) -> float:
        return float(np.random.rand()) if self.numpy_draws else float(torch.rand(1))

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        img = self.images[i]
        top, left = int(self._uniform() * 5), int(self._uniform() * 5)
        img = img[:, top : top + 32, left : left + 32]
        if self._uniform() < 0.5:
            img = img.flip(-1)
        img = (img * (0.8 + 0.4 * self._uniform())).clamp(0, 1)
        return img, i % 10


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def consume(batches: Any, compute_ms: float) -> int:
    a = torch.rand(256, 256)
    n = 0
    for inputs, _ in batches:
        n += len(inputs)
        until = time.perf_counter() + compute_ms / 1000
        while time.perf_counter() < until:
            a = a @ a.T / 256
    return n


def schedule(n: int) -> list[tuple[tuple[int, int, int], np.ndarray]]:
    order = np.random.default_rng(0).permutation(n)
    return [((0, s, 0), order[s * BATCH : (s + 1) * BATCH]) for s in range(n // BATCH)]


def seeded(dataset: Augmenting) -> SeededReads:
    seeds = SampleSeeds(1, [*global_generators(), *numpy_generators_of(dataset), *read_generators(dataset)])
    return SeededReads(seeds, dataset.__getitem__, None, default_collate)


def rows(n: int, compute_ms: float) -> dict[str, Callable[[], int]]:
    torch_data, numpy_data = Augmenting(n), Augmenting(n, numpy_draws=True)
    entries = schedule(n)
    batches = [list(map(int, idx)) for _, idx in entries]

    def loader(threads: int, reads: SeededReads | None, data: Augmenting) -> int:
        prefetch = PrefetchLoader(data, default_collate, threads, None, reads, lambda key: key[0])
        try:
            return consume((batch for _, _, batch in prefetch.iterate(entries)), compute_ms)
        finally:
            prefetch.close()

    def processes(count: int) -> int:
        loader = ProcessLoader(torch_data, seeded(torch_data), count, lambda key: key[0])
        try:
            return consume((batch for _, _, batch in loader.iterate(entries)), compute_ms)
        finally:
            loader.close()

    def data_loader(workers: int) -> int:
        return consume(DataLoader(torch_data, batch_sampler=batches, num_workers=workers), compute_ms)

    assert fetch(torch_data, np.arange(2), default_collate)[0].shape == (2, 3, 32, 32)
    return {
        "DataLoader, 0 workers": lambda: data_loader(0),
        "DataLoader, 2 workers": lambda: data_loader(2),
        "threads, unseeded": lambda: loader(2, None, torch_data),
        "seeded, training thread": lambda: loader(2, seeded(torch_data), torch_data),
        "seeded, threads (NumPy draws)": lambda: loader(2, seeded(numpy_data), numpy_data),
        "seeded, 2 processes": lambda: processes(2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--compute", type=float, default=4.0, help="ms of compute per micro-batch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    table = rows(args.samples, args.compute)
    rates: dict[str, list[float]] = {name: [] for name in table}
    cpu: dict[str, list[float]] = {name: [] for name in table}
    for _ in range(args.rounds):
        for name, run in table.items():
            started, used = time.perf_counter(), cpu_seconds()
            samples = run()
            rates[name].append(samples / (time.perf_counter() - started))
            cpu[name].append((cpu_seconds() - used) / samples * 1000)
    base = rates["DataLoader, 0 workers"]
    print(f"{args.samples} samples, micro-batches of {BATCH}, {args.compute} ms of compute each, {args.rounds} rounds")
    print(f"{'row':32} {'samples/s':>10} {'ratio':>6} {'CPU s / 1k samples':>19}")
    for name in table:
        ratio = statistics.median(r / b for r, b in zip(rates[name], base))
        print(f"{name:32} {statistics.median(rates[name]):10.0f} {ratio:6.2f} {statistics.median(cpu[name]):19.2f}")


if __name__ == "__main__":
    main()
