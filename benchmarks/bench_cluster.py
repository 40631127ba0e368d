"""Local processes vs a Ray cluster: start-up, recovery after a node loss, and a join's pause.

    python benchmarks/bench_cluster.py            # needs `pip install -e ".[ray]"`
    python benchmarks/bench_cluster.py --rounds 3

Each round runs the same small MLP job twice, 2 workers, one after the other:

- **local**: `cluster=None`; worker 1 is SIGKILLed at step ``--loss-step``, and its slot is
  refilled by the driver's own replacement (the local way of "a device comes back");
- **ray**: `cluster="ray"` on a `ray.cluster_utils.Cluster` (a head with no CPU and two
  1-CPU nodes, all on this host): the node of one worker is removed at step ``--loss-step``
  (its raylet and every process on it die, as when a machine goes), and a new 1-CPU node is
  added right after; the outstanding actor request is placed there and the newcomer joins.

From each run's ``logs/metrics.jsonl`` it prints: ``train()`` to the first committed step,
the loss (kill or node removal) to the next committed step, and the join's pause on the
running workers (the gap between committed steps around the join, less the median step).
Medians [min-max] over rounds. Not a test: the figures go in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fabric_model import FabricModel  # noqa: E402
from fabric_model.testing import FaultInjector, Kill, fired_at  # noqa: E402


class Synthetic:
    """Random features and labels, made in each worker (nothing captured, nothing downloaded)."""

    def __init__(self, n: int = 4096, features: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, features, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def datasets() -> tuple[Synthetic, None]:
    return Synthetic(), None


class AtStep:
    """A driver logger that runs ``action`` once, when ``iteration`` reaches ``step``."""

    def __init__(self, step: int, action: Callable[[], None]) -> None:
        self.step, self.action = step, action
        self.fired_at: float | None = None

    def log_train_metrics(self, metrics: Any, iteration: int, epoch: int, workers: int) -> None:
        if self.fired_at is None and iteration >= self.step:
            self.fired_at = time.time()
            self.action()


def summarize(run_dir: Path, t_start: float, lost_at: float | None) -> dict[str, Any]:
    lines = [json.loads(x) for x in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if r["type"] == "train"]
    gens = [r for r in lines if r["type"] == "generation"]
    times = [r["time"] for r in steps]
    gaps = [b - a for a, b in zip(times, times[1:])]
    median = statistics.median(gaps)
    out: dict[str, Any] = {"first_step": times[0] - t_start, "median_step": median}
    out["sizes"] = [g["workers"] for g in gens]
    if lost_at is not None:  # the first step committed by a generation formed after the loss
        before = [r["generation"] for r in steps if r["time"] <= lost_at]
        after = [r["time"] for r in steps if r["generation"] > (before[-1] if before else -1) and r["time"] > lost_at]
        if after:
            out["recovery"] = after[0] - lost_at
    joins = [g for g in gens if "join" in g.get("reason", "")]
    if joins:
        join = joins[-1]
        before = [t for t in times if t <= join["time"]]
        after = [t for t in times if t > join["time"]]
        if before and after:
            out["join_pause"] = after[0] - before[-1] - median
    return out


def run_local(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    marker = tmp / "marks"
    marker.mkdir()
    # The workers pace their steps, so that a replacement (seconds to start) lands while they train.
    injector = FaultInjector([Kill(1, args.loss_step, when="after_step")], marker, step_delay=args.pace)
    fm = FabricModel(model, datasets, F.cross_entropy, opt, worker_logger_callback=injector)
    run_dir = tmp / "local"
    t_start = time.time()
    fm.train(args.epochs, 32, 2, seed=0, run_dir=run_dir, checkpoint_freq=0, num_dataloader_threads=0, verbose=0)
    return summarize(run_dir, t_start, fired_at(marker, 0))


def run_ray(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    os.environ["RAY_ADDRESS"] = cluster.address
    try:
        victim = nodes[1]

        def lose_a_node() -> None:
            cluster.remove_node(victim, allow_graceful=False)
            cluster.add_node(num_cpus=1)

        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        trigger = AtStep(args.loss_step, lose_a_node)
        pace = FaultInjector([], tmp, step_delay=args.pace)  # no fault: only the workers' pace
        fm = FabricModel(
            model, datasets, F.cross_entropy, opt, worker_logger_callback=pace, driver_logger_callback=trigger
        )
        run_dir = tmp / "ray"
        t_start = time.time()
        fm.train(
            args.epochs,
            32,
            2,
            seed=0,
            run_dir=run_dir,
            checkpoint_freq=0,
            num_dataloader_threads=0,
            cluster="ray",
            verbose=0,
        )
        return summarize(run_dir, t_start, trigger.fired_at)
    finally:
        os.environ.pop("RAY_ADDRESS", None)
        import ray

        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


def fmt(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{statistics.median(values):6.2f} s [{min(values):.2f}-{max(values):.2f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--loss-step", type=int, default=10)
    parser.add_argument("--pace", type=float, default=0.05, help="seconds each worker waits after a step")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on 127.0.0.1
    results: dict[str, list[dict[str, Any]]] = {"local": [], "ray": []}
    for _ in range(args.rounds):
        for name, fn in (("local", run_local), ("ray", run_ray)):
            with tempfile.TemporaryDirectory() as tmp:
                results[name].append(fn(args, Path(tmp)))
    print(f"{args.rounds} round(s), 2 workers, MLP 64-256-10, batch 32 per worker, steps paced {args.pace} s")
    print(f"{'':44s} {'local processes':>24s} {'Ray (cluster_utils)':>24s}")
    rows = [
        ("train() -> first committed step", "first_step"),
        ("loss (kill / node removed) -> next commit", "recovery"),
        ("join pause (gap - median step)", "join_pause"),
        ("median step", "median_step"),
    ]
    for name in ("local", "ray"):
        print(f"{name}: generation sizes per round {[r['sizes'] for r in results[name]]}")
    for label, key in rows:
        cells = [fmt([r[key] for r in results[n] if key in r]) for n in ("local", "ray")]
        print(f"{label:44s} {cells[0]:>24s} {cells[1]:>24s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
