"""What elasticity costs: recovery after a worker dies, and the pause a join imposes.

    python benchmarks/bench_elastic.py            # ~10M-parameter MLP, 3 CPU workers
    python benchmarks/bench_elastic.py --quick    # a smaller model, for a smoke run

One run of FabricModel with 3 workers: worker 1 is SIGKILLed inside a step (just before
its allreduce), and later a new worker is started by hand and joins. From the run's
``logs/metrics.jsonl`` it prints:

- recovery: from the kill to the next committed step (the interrupted step redone by the
  survivors), and the part of it spent forming the new generation;
- join pause: the longest gap between committed steps around the join, minus the median
  step time of the run (what the running workers lost while the newcomer pulled state);
- restart-the-world: what torchrun-style recovery pays instead, measured in the same run
  as the time from ``train()`` to the first committed step (fresh processes, imports, data,
  process group), before counting the steps lost since the last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fabric_model import FabricModel  # noqa: E402
from fabric_model.testing import FaultInjector, Kill, WorkerStarter, fired_at  # noqa: E402


def make_model(width: int, features: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(features, width), nn.ReLU(), nn.Linear(width, features), nn.ReLU(), nn.Linear(features, 10)
    )


class Synthetic:
    """Random features and labels, made in each worker (nothing captured, nothing downloaded)."""

    def __init__(self, n: int, features: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, features, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Quiet:
    def log_train_metrics(self, *args):
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--kill-step", type=int, default=6)
    parser.add_argument("--join-step", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--keep", help="keep the run directory here (default: a temporary one)")
    args = parser.parse_args()
    width, features, samples = (512, 256, 2048) if args.quick else (4096, 1024, 3072)
    batch = 32
    model = make_model(width, features)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(args.keep) if args.keep else Path(tmp) / "run"
        # --quick steps take milliseconds: pace them so the joining worker (seconds to start) lands.
        injector = FaultInjector([Kill(1, args.kill_step)], tmp, step_delay=0.1 if args.quick else 0.0)
        starter = WorkerStarter(run_dir, [args.join_step], inner=Quiet())
        fm = FabricModel(
            model,
            lambda: (Synthetic(samples, features), None),
            F.cross_entropy,
            opt,
            worker_logger_callback=injector,
            driver_logger_callback=starter,
        )
        import os

        os.environ["EDT_REPLACE_WORKERS"] = "0"  # the join below is the only one
        t_start = time.time()
        try:
            fm.train(args.epochs, batch, 3, seed=0, run_dir=run_dir, num_dataloader_threads=2, verbose=0)
        finally:
            starter.close()
        killed = fired_at(tmp, 0)
        lines = [json.loads(x) for x in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if r["type"] == "train"]
    gens = [r for r in lines if r["type"] == "generation"]
    assert killed is not None and len(gens) >= 3, f"expected a kill and a join, saw generations {gens}"
    times = [r["time"] for r in steps]
    gaps = [b - a for a, b in zip(times, times[1:])]
    median = statistics.median(gaps)
    redone = next(r for r in steps if r["epoch"] == 0 and r["step"] == args.kill_step)
    lost_gen = gens[1]
    join_gen = gens[2]
    after_join = [r for r in steps if r["generation"] == join_gen["generation"]]
    before_join = [r for r in steps if r["time"] <= join_gen["time"]]
    join_gap = after_join[0]["time"] - before_join[-1]["time"] if after_join and before_join else float("nan")
    first_commit = times[0] - t_start
    print(
        f"model: {params / 1e6:.1f}M parameters, global batch {3 * batch}, 3 CPU workers, "
        f"median step {median * 1e3:.0f} ms"
    )
    print(f"recovery after a kill (kill -> next committed step): {redone['time'] - killed:6.2f} s")
    print(f"  of which forming the new generation:              {lost_gen['time'] - killed:6.2f} s")
    print(f"join pause on the running workers (gap - median step): {join_gap - median:6.2f} s")
    print(
        f"restart-the-world (train() -> first committed step):  {first_commit:6.2f} s "
        f"(+ the steps since the last checkpoint)"
    )
    print(f"ratio restart / recovery: {first_commit / (redone['time'] - killed):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
