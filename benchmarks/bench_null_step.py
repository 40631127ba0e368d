"""The framework's fixed cost: a step with (almost) no math, FabricModel on 1 engine against the plain loop.

A one-parameter model (``Linear(1, 1, bias=False)``, MSE, SGD) makes a step's math a few
microseconds, so what a step costs beyond the plain loop is what the framework adds: the
data read, seeding, the buffers' bookkeeping, the stat sums, the report, snapshots (at their
defaults: every 100 steps, or 1% of the time). Both sides read the loss every step. Per
micro-batch: the same with 4 micro-batches a step (``effective_batch_size``) against a plain
loop that accumulates 4; the per-micro-batch cost is the difference of the two overheads / 3.

FabricModel's step time is its throughput over the timed span (the driver's commit stamps in
``logs/metrics.jsonl``, from the end of a frame of reports after ``--warmup`` steps:
benchmarks/commits.py), start-up excluded; the plain loop stamps its steps the same way.
Rounds interleave the runs; figures are medians [min-max] over rounds.
Target (issue 45): at most 60 us a step on 2 cores.

    PYTHONPATH=. python3 benchmarks/bench_null_step.py                 # 5 rounds, 20,000 steps each
    PYTHONPATH=. python3 benchmarks/bench_null_step.py --rounds 3 --steps 5000
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import commits
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

BATCH = 8


def data(steps: int, micro: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * micro * BATCH, 1, generator=g)
    return TensorDataset(x, 3.0 * x)


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1, bias=False)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def span(stamps: list[float], warmup: int) -> float:
    """Seconds a step over the stamps after the first ``warmup``."""
    timed = stamps[warmup:]
    return (timed[-1] - timed[0]) / (len(timed) - 1)


def plain(steps: int, micro: int, warmup: int) -> float:
    """The loop a user writes: a shuffled order, ``micro`` micro-batches accumulated a step, the loss read."""
    torch.set_num_threads(os.cpu_count() or 1)  # a lone CPU worker takes every core
    model, optimizer = model_and_optimizer()
    dataset = data(steps + warmup, micro)
    x, y = dataset.tensors
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
    stamps = []
    for step in range(steps + warmup):
        optimizer.zero_grad()
        total = 0.0
        for j in range(micro):
            idx = order[(step * micro + j) * BATCH : (step * micro + j + 1) * BATCH]
            loss = F.mse_loss(model(x[idx]), y[idx]) / micro
            loss.backward()
            total += loss.item()
        optimizer.step()
        stamps.append(time.perf_counter())
    return span(stamps, warmup)


class Quiet:
    def on_train_begin(self) -> None:
        pass


def fabric(steps: int, micro: int, warmup: int, run_dir: Path) -> float:
    from fabric_model import FabricModel

    model, optimizer = model_and_optimizer()
    dataset = data(steps + warmup, micro)
    fm = FabricModel(model, lambda: (dataset, None), F.mse_loss, optimizer, metrics=[], driver_logger_callback=Quiet())
    result = fm.train(
        1, BATCH, 1, effective_batch_size=BATCH * micro, run_dir=run_dir, seed=0, verbose=0, checkpoint_freq=0
    )
    return commits.mean_step(commits.train_stamps(result.run_dir), warmup)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20_000, help="timed steps a run")
    parser.add_argument("--warmup", type=int, default=200)
    args = parser.parse_args(argv)
    logging.getLogger("fabric_model").setLevel(logging.ERROR)
    print(
        f"torch {torch.__version__}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, "
        f"{args.steps} timed steps a run, {args.rounds} rounds"
    )
    rows: dict[str, list[float]] = {k: [] for k in ("plain1", "fabric1", "plain4", "fabric4")}
    scratch = Path(tempfile.mkdtemp(prefix="bench-null-"))
    try:
        for r in range(args.rounds):
            rows["plain1"].append(plain(args.steps, 1, args.warmup))
            rows["fabric1"].append(fabric(args.steps, 1, args.warmup, scratch / f"a{r}"))
            rows["plain4"].append(plain(args.steps, 4, args.warmup))
            rows["fabric4"].append(fabric(args.steps, 4, args.warmup, scratch / f"b{r}"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    step = [f - p for f, p in zip(rows["fabric1"], rows["plain1"])]
    four = [f - p for f, p in zip(rows["fabric4"], rows["plain4"])]
    micro = [(b - a) / 3 for a, b in zip(step, four)]

    def us(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e6:7.1f} [{min(values) * 1e6:.1f}-{max(values) * 1e6:.1f}]"

    print(f"{'':<44}{'us, median [min-max]':>26}")
    print(f"{'plain loop, a step (1 micro-batch)':<44}{us(rows['plain1']):>26}")
    print(f"{'fabric_model, a step (1 micro-batch)':<44}{us(rows['fabric1']):>26}")
    print(f"{'  the framework a step (the difference)':<44}{us(step):>26}")
    print(f"{'plain loop, a step of 4 micro-batches':<44}{us(rows['plain4']):>26}")
    print(f"{'fabric_model, a step of 4 micro-batches':<44}{us(rows['fabric4']):>26}")
    print(f"{'  the framework a micro-batch beyond the 1st':<44}{us(micro):>26}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
