"""What unrelated Python between steps costs the model's own operations: the plain loop, with and without it.

The tied LM of ``bench_models.py`` (a step of small operations, whose time is torch's dispatch)
in its plain loop, each step preceded by nothing or by ``json.dumps`` of ``--dicts`` dicts drawn
from 3,000 (Python that touches scattered objects, as a framework's bookkeeping does). The
Python's own time is stamped apart; what the step took beyond it is the model's part, and the
difference of the model's parts is what that Python cost the operations after it (caches and
branch predictors the model's next operations find cold). Rounds alternate the two loops;
figures are medians over rounds. benchmarks/README.md, "A small step's intra-op threads".

    PYTHONPATH=. python3 benchmarks/bench_python_between.py                      # 8 rounds, 12 dicts
    PYTHONPATH=. python3 benchmarks/bench_python_between.py --dicts 4 --threads 1
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

import torch
from torch.utils.data import DataLoader

OBJECTS = [{"a": i, "b": [i, str(i)], "c": {"x": float(i)}} for i in range(3000)]


def unrelated_python(dicts: int) -> int:
    return sum(len(json.dumps(o)) for o in random.sample(OBJECTS, dicts))


def run(dicts: int, steps: int, warmup: int) -> tuple[float, float]:
    """The step's and the unrelated Python's microseconds, per step after ``warmup``."""
    from tests.models import test_torch_patterns as patterns

    model, optimizer = patterns.tied_lm()
    loader = DataLoader(patterns.next_token_data(3200), batch_size=16, shuffle=True)
    model.train()
    done, python, began = 0, 0.0, 0.0
    while done < steps + warmup:
        batch: Any
        for batch in loader:
            if done == warmup:
                began, python = time.perf_counter(), 0.0
            if dicts:
                started = time.perf_counter()
                unrelated_python(dicts)
                python += time.perf_counter() - started
            optimizer.zero_grad()
            loss = patterns.lm_loss(model(batch[0]), batch[1])
            loss.backward()
            optimizer.step()
            loss.item()
            done += 1
            if done == steps + warmup:
                break
    return (time.perf_counter() - began) / steps * 1e6, python / steps * 1e6


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--dicts", type=int, default=12, help="dicts dumped before each step")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    runs: dict[int, list[tuple[float, float]]] = {0: [], args.dicts: []}
    for r in range(args.rounds):
        for dicts in (0, args.dicts) if r % 2 == 0 else (args.dicts, 0):
            runs[dicts].append(run(dicts, args.steps, args.warmup))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
        f"{args.rounds} rounds of {args.steps} steps"
    )
    model_part: dict[int, float] = {}
    for dicts, rows in runs.items():
        step = statistics.median(s for s, _ in rows)
        python = statistics.median(p for _, p in rows)
        model_part[dicts] = statistics.median(s - p for s, p in rows)
        print(
            f"{dicts:>3} dicts a step: step {step:7.1f} us, the unrelated Python {python:6.1f} us, "
            f"the model's part {model_part[dicts]:7.1f} us"
        )
    print(f"the model's part slower by {model_part[args.dicts] - model_part[0]:.1f} us with the Python before it")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
