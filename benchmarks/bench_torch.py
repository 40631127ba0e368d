"""Steady-state training throughput of FabricModel against plain PyTorch baselines (CPU).

One run of this script measures, on the same model, synthetic data, per-worker batch size
and SGD optimizer:

  (a) FabricModel with 1 engine   vs  a plain single-process training loop;
  (b) FabricModel with 2 engines  vs  a hand-written DistributedDataParallel job on gloo
      with 2 processes (each rank takes its shard of a global batch of 2 * batch_size).

Start-up (process spawn, imports, process-group set-up) is excluded everywhere: the first
``--warmup`` steps of every run are not timed. FabricModel's step times come from the
driver's commit timestamps in ``<run_dir>/logs/metrics.jsonl``; the baselines stamp the end
of each of their steps (DDP: on rank 0). Two figures are printed per run: the mean
throughput over the timed steps, and the throughput of the median step (global batch /
median step time), which the occasional step slowed down by other load does not move.

Threads are matched: FabricModel gives each CPU worker ``os.cpu_count() // workers`` torch
threads, so the plain loop gets ``os.cpu_count()`` and each DDP rank ``os.cpu_count() // 2``.
FabricModel runs with its defaults (no loader thread for this ``TensorDataset``, read in one
gather; ``--dataloader-threads`` changes it); the baselines use a ``torch.utils.data.DataLoader``
with ``num_workers=0``, as a plain script would.

The four runs of a round are interleaved (plain, FM-1, DDP, FM-2); with ``--repeats`` > 1
each figure is the best of the rounds, which damps noise from other load on the machine
(the load average is printed for that reason: on 2 cores, a 2-thread run is easily disturbed).

    PYTHONPATH=. python3 benchmarks/bench_torch.py             # default, about 2.5 minutes on 2 cores
    PYTHONPATH=. python3 benchmarks/bench_torch.py --quick     # a short smoke run
    PYTHONPATH=. python3 benchmarks/bench_torch.py --steps 400 --repeats 3
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import commits
import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

NUM_SAMPLES = 16384  # a multiple of 2 * batch_size for the batch sizes used here: no short steps
FEATURES, HIDDEN, CLASSES = 512, 1024, 10


# -- the workload -------------------------------------------------------------------------
def make_model(seed: int = 0) -> nn.Module:
    """An MLP of about 1.6 M parameters: a step at batch 128 is tens of ms of matmuls on CPU."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def get_datasets():
    """Synthetic, deterministic classification data (labels from a random linear teacher)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(NUM_SAMPLES, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(1)
    return TensorDataset(x, y), None


def epochs_for(total_steps: int, global_batch: int) -> int:
    return math.ceil(total_steps * global_batch / NUM_SAMPLES)


# -- baseline 1: a plain single-process loop ----------------------------------------------
def train_loop(model, optimizer, loader, total_steps: int, sampler=None) -> list[float]:
    """The textbook loop; returns the time at the end of every step."""
    model.train()
    times: list[float] = []
    epoch = 0
    while len(times) < total_steps:
        if sampler is not None:
            sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            loss.item()  # what a loop that logs its loss does (FabricModel reports it every step)
            times.append(time.perf_counter())
            if len(times) == total_steps:
                break
        epoch += 1
    return times


def steady_rates(times: list[float], warmup: int, global_batch: int) -> tuple[float, float]:
    """(mean, median-step) samples/s over the steps after the first ``warmup``.

    mean: timed steps * global batch / time they took. median-step: global batch / median
    step time, which a few steps slowed down by other load on the machine do not move.
    """
    timed = times[warmup - 1 :]
    intervals = [b - a for a, b in zip(timed, timed[1:])]
    return len(intervals) * global_batch / (timed[-1] - timed[0]), global_batch / statistics.median(intervals)


def bench_plain(batch_size: int, total_steps: int, warmup: int) -> tuple[float, float]:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 1))  # as FabricModel's single CPU worker
    model = make_model()
    train_set, _ = get_datasets()
    loader = DataLoader(train_set, batch_size=batch_size, shuffle=True, num_workers=0)
    times = train_loop(model, make_optimizer(model), loader, total_steps)
    return steady_rates(times, warmup, batch_size)


# -- baseline 2: DistributedDataParallel on gloo ------------------------------------------
def _ddp_rank(rank: int, world: int, port: int, batch_size: int, total_steps: int, warmup: int, results) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data.distributed import DistributedSampler

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as FabricModel's CPU workers
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = DistributedDataParallel(make_model())
        optimizer = make_optimizer(model)
        train_set, _ = get_datasets()
        sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=0)
        loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler, num_workers=0)
        times = train_loop(model, optimizer, loader, total_steps, sampler)
        if rank == 0:  # every step ends with an allreduce, so rank 0's clock speaks for the job
            results.put(steady_rates(times, warmup, batch_size * world))
    finally:
        dist.destroy_process_group()


def bench_ddp(batch_size: int, total_steps: int, warmup: int, world: int = 2) -> tuple[float, float]:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # FabricModel's launcher does the same
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_ddp_rank, args=(world, port, batch_size, total_steps, warmup, results), nprocs=world, join=True)
    return results.get()


# -- FabricModel ----------------------------------------------------------------------------
class Quiet:
    """A driver logger that prints nothing (replaces the progress bar)."""

    def on_train_begin(self) -> None:
        pass


def bench_fabric(
    batch_size: int, engines: int, warmup: int, epochs: int, run_dir: Path, dataloader_threads: int | None = None
) -> tuple[float, float]:
    from fabric_model import FabricModel

    model = make_model()
    fm = FabricModel(model, get_datasets, F.cross_entropy, make_optimizer(model), driver_logger_callback=Quiet())
    extra = {} if dataloader_threads is None else {"num_dataloader_threads": dataloader_threads}
    result = fm.train(epochs, batch_size, engines, run_dir=run_dir, seed=0, verbose=0, **extra)
    # One line per committed step, stamped by the driver when the step's reports arrive (a lone
    # worker's in frames of ~0.1 s: benchmarks/commits.py).
    times, global_batch = commits.train_stamps(result.run_dir), batch_size * engines
    return global_batch / commits.mean_step(times, warmup - 1), global_batch / commits.median_step(times, warmup - 1)


# -- the report -----------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=128, help="per-worker batch (default 128)")
    parser.add_argument("--steps", type=int, default=192, help="timed steps per run, at least (default 192)")
    parser.add_argument("--warmup", type=int, default=32, help="untimed steps at the start of each run (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the four runs; the best is reported")
    parser.add_argument("--quick", action="store_true", help="a short smoke run: --steps 64 --warmup 8 --repeats 1")
    parser.add_argument(
        "--dataloader-threads",
        type=int,
        default=None,
        help="FabricModel's num_dataloader_threads (default: FabricModel's own default)",
    )
    parser.add_argument("--keep-runs", action="store_true", help="keep FabricModel's run directories")
    args = parser.parse_args()
    # The driver logs each worker generation at WARNING level; keep the report readable.
    logging.getLogger("fabric_model").setLevel(logging.ERROR)
    if args.quick:
        args.steps, args.warmup, args.repeats = 64, 8, 1
    if NUM_SAMPLES % (2 * args.batch_size):
        parser.error(f"--batch-size must divide {NUM_SAMPLES // 2}")
    if args.warmup < 1 or args.steps < 2 or args.repeats < 1:
        parser.error("--warmup must be >= 1, --steps >= 2 and --repeats >= 1")
    # FabricModel trains whole epochs, so runs are rounded up to whole epochs; the baselines
    # take the same number of steps.
    epochs = {e: epochs_for(args.warmup + args.steps, args.batch_size * e) for e in (1, 2)}
    totals = {e: epochs[e] * NUM_SAMPLES // (args.batch_size * e) for e in (1, 2)}

    cores = os.cpu_count() or 1
    n_params = sum(p.numel() for p in make_model().parameters())
    print(f"torch {torch.__version__}, {cores} CPU cores, load average {os.getloadavg()[0]:.2f} (1 min)")
    print(
        f"model: MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES} ({n_params / 1e6:.2f} M params), SGD, "
        f"{NUM_SAMPLES} synthetic samples, per-worker batch {args.batch_size}"
    )
    print(
        f"timed steps per run: 1 worker {totals[1] - args.warmup}, 2 workers {totals[2] - args.warmup} "
        f"(after {args.warmup} warm-up steps); {args.repeats} round(s); FabricModel num_dataloader_threads="
        f"{'default' if args.dataloader_threads is None else args.dataloader_threads}",
        flush=True,
    )

    root = Path(tempfile.mkdtemp(prefix="bench_torch_"))
    runs: dict[str, list[tuple[float, float]]] = {"plain": [], "fm1": [], "ddp": [], "fm2": []}
    try:
        for r in range(args.repeats):
            bs, warmup, dl = args.batch_size, args.warmup, args.dataloader_threads
            runs["plain"].append(bench_plain(bs, totals[1], warmup))
            runs["fm1"].append(bench_fabric(bs, 1, warmup, epochs[1], root / f"fm1-{r}", dl))
            runs["ddp"].append(bench_ddp(bs, totals[2], warmup))
            runs["fm2"].append(bench_fabric(bs, 2, warmup, epochs[2], root / f"fm2-{r}", dl))
            print(
                f"round {r + 1} (mean samples/s): " + ", ".join(f"{k} {v[-1][0]:,.0f}" for k, v in runs.items()),
                flush=True,
            )
    finally:
        if args.keep_runs:
            print(f"FabricModel run directories kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

    # The best round of each run: other load on the machine only ever slows a run down.
    mean = {k: max(m for m, _ in v) for k, v in runs.items()}
    median = {k: max(m for _, m in v) for k, v in runs.items()}
    rows = [
        ("plain PyTorch loop", 1, "plain"),
        ("FabricModel, 1 engine", 1, "fm1"),
        ("DDP gloo, 2 processes", 2, "ddp"),
        ("FabricModel, 2 engines", 2, "fm2"),
    ]
    print(
        f"\n{'run':<24}{'workers':>8}{'threads/worker':>16}{'global batch':>14}"
        f"{'samples/s (mean)':>18}{'(median step)':>15}"
    )
    for name, workers, key in rows:
        print(
            f"{name:<24}{workers:>8}{max(1, cores // workers):>16}{args.batch_size * workers:>14}"
            f"{mean[key]:>18,.0f}{median[key]:>15,.0f}"
        )
    print("\nratios (mean samples/s; median-step in brackets):")
    for label, ours, base, target in (
        ("(a) FabricModel 1 engine / plain loop", "fm1", "plain", 0.95),
        ("(b) FabricModel 2 engines / DDP      ", "fm2", "ddp", 1.0),
    ):
        ratio = mean[ours] / mean[base]
        print(
            f"{label}: {ratio:.3f}x  [{median[ours] / median[base]:.3f}x]  "
            f"target >= {target:.2f}x: {'met' if ratio >= target else 'MISSED'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
