"""Step time with ``deterministic=True`` against the default mode (CPU), 1 and 2 workers.

Models: an MLP 256 -> 512 -> 512 -> 10 and a small CNN (two 3x3 convolutions and BatchNorm on
1x28x28), batch 64 per worker, SGD with momentum, synthetic data. Each run trains ``--steps``
steps; a step's time is the gap between the driver's commit timestamps in ``metrics.jsonl``
after ``--warmup`` steps, and a run's figure is its median step. The runs of a round are
interleaved (model, workers, off then on), ``--rounds`` rounds; printed: the median [range]
over rounds of each configuration's step time and of the per-round ratio on/off.

Threads are matched, so that the figure is the cost of the exact reduction alone: both modes
get ``cores // workers`` intra-op threads (deterministic mode through
``FABRIC_MODEL_DETERMINISTIC_THREADS``; its default, 1 thread, is slower on a multi-core host
with one worker).

``--micro-batches M`` gives every step M micro-batches of 64 whatever the worker count, to
measure the other sums: up to 2 a step the float32 allreduce is already the ordered sum, 3-4
the terms are gathered and added in order, more take the fixed-point sum
(docs/architecture.md, "Deterministic mode").

    PYTHONPATH=. python3 benchmarks/bench_deterministic.py                # about 4 minutes on 2 cores
    PYTHONPATH=. python3 benchmarks/bench_deterministic.py --rounds 1   # a smoke run
    PYTHONPATH=. python3 benchmarks/bench_deterministic.py --models mlp --micro-batches 4
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import commits
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from fabric_model import FabricModel
from fabric_model.orchestrator.run_setup import DETERMINISTIC_THREADS_ENV
from fabric_model.setup.config import threads_per_worker

BATCH = 64


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def make_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 7 * 7, 10),
    )


MODELS = {"mlp": (make_mlp, (256,)), "cnn": (make_cnn, (1, 28, 28))}


def datasets(shape: tuple[int, ...], n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, *shape, generator=g), torch.randint(0, 10, (n,), generator=g))


def run(model_name: str, workers: int, deterministic: bool, steps: int, warmup: int, micro_batches: int = 0) -> float:
    """The median step time (s) of one run; ``micro_batches`` a step (0: one per worker)."""
    make, shape = MODELS[model_name]
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step_batch = BATCH * (micro_batches or workers)
    data = datasets(shape, steps * step_batch)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-det-"))
    os.environ[DETERMINISTIC_THREADS_ENV] = str(threads_per_worker(workers))
    try:
        fm = FabricModel(model, lambda: (data, None), F.cross_entropy, opt, driver_logger_callback=_Quiet())
        fm.train(
            1,
            BATCH,
            workers,
            effective_batch_size=step_batch,
            checkpoint_freq=0,
            seed=1,
            run_dir=run_dir,
            deterministic=deterministic,
            verbose=0,
        )
        times = commits.train_stamps(run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return commits.median_step(times, warmup)  # a lone worker's reports come in frames


class _Quiet:
    def log_train_metrics(self, metrics, iteration, epoch, workers) -> None:  # noqa: ANN001
        pass


def _fmt(values: list[float], scale: float = 1.0, unit: str = "") -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):.3g}{unit} [{min(v):.3g}-{max(v):.3g}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=0,
        help="micro-batches of 64 a step (default: one per worker); up to 2 the allreduce is the ordered sum, "
        "3-4 the terms are gathered, more takes the fixed-point sum",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    configs = [(m, w) for m in args.models for w in args.workers]
    times: dict[tuple[str, int, bool], list[float]] = {(m, w, d): [] for m, w in configs for d in (False, True)}
    for r in range(args.rounds):
        for m, w in configs:
            for d in (False, True):
                times[(m, w, d)].append(run(m, w, d, args.steps, args.warmup, args.micro_batches))
                print(f"  {m} workers={w} deterministic={d}: {times[(m, w, d)][-1] * 1e3:.3g} ms", flush=True)
        print(f"round {r + 1}/{args.rounds} done (load average {os.getloadavg()[0]:.1f})", flush=True)
    per_worker = f"batch {BATCH} per worker"
    step = f"{args.micro_batches} micro-batches of {BATCH} a step" if args.micro_batches else per_worker
    print(f"\nCPU, {os.cpu_count()} cores; {step}; median step time [range] over rounds")
    print(f"{'model':5} {'workers':>7} {'off (ms)':>22} {'deterministic (ms)':>22} {'ratio on/off':>24}")
    for m, w in configs:
        off, on = times[(m, w, False)], times[(m, w, True)]
        ratios = [b / a for a, b in zip(off, on)]
        print(f"{m:5} {w:>7} {_fmt(off, 1e3):>22} {_fmt(on, 1e3):>22} {_fmt(ratios):>24}")


if __name__ == "__main__":
    main()
