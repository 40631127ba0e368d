"""The control plane with many workers, by simulation (docs/architecture.md, "Scale").

    python benchmarks/bench_scale.py                          # N = 64, 256, 1024, 3 rounds
    python benchmarks/bench_scale.py --workers 64 256 1024 4096 --rounds 3

N simulated workers (fabric_model/testing/simulated.py: real sockets, the real handshake and
messages, no model) against the real driver in a process of its own. For each N it measures:

- form: all N say Ready at once, to the generation they all entered;
- crash: one member's connection closes, to the next generation entered by the rest;
- join storm: N/4 connect at once, to the generation that takes them (after the vote's step);
- preemption: a quarter of the members leave after the next step, to the generation of the rest;
- per committed step, while every member steps 10 times a second (50 steps): the driver's CPU
  time (heartbeats included, one a second a worker, as real workers send them) and the latency
  from rank 0's report to the step's record (median of the steps);
- the driver's memory (RSS) at the end;

and prints each figure per N (the median of the rounds, N interleaved within each), and its
growth exponent between successive N (1: linear).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fabric_model.testing.simulated import Simulation  # noqa: E402

STEPS, RATE = 50, 10.0


def measure(workers: int, processes: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        sim = Simulation(Path(tmp) / "run", max_workers=workers + workers // 4 + 1, processes=processes)
        try:
            figures = {"form s": sim.form(workers)}
            for _ in range(3):
                sim.step()
            figures["crash s"] = sim.crash()
            for _ in range(3):
                sim.step()
            figures["join storm s"] = sim.join_storm(workers // 4)
            for _ in range(3):
                sim.step()
            figures["preemption s"] = sim.preempt(workers // 4)
            time.sleep(1.0)
            driver = psutil.Process(sim.driver.pid)
            committed = len(sim.committed())
            cpu = sum(driver.cpu_times()[:2])
            sent = []
            for _ in range(STEPS):
                began = time.monotonic()
                sent.append(sim.step())
                time.sleep(max(0.0, 1 / RATE - (time.monotonic() - began)))
            cpu = sum(driver.cpu_times()[:2]) - cpu
            deadline = time.monotonic() + 60
            while len(records := sim.committed()) < committed + STEPS and time.monotonic() < deadline:
                time.sleep(0.05)
            latencies = sorted(r["time"] - s for r, s in zip(records[-STEPS:], sent))
            figures["driver CPU ms/step"] = 1000 * cpu / STEPS
            figures["commit latency ms"] = 1000 * latencies[len(latencies) // 2]
            figures["driver MiB"] = driver.memory_info().rss / 2**20
            return figures
        finally:
            sim.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--processes", type=int, default=4, help="processes the simulated workers are spread over")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    runs: dict[int, list[dict[str, float]]] = {n: [] for n in args.workers}
    for _ in range(args.rounds):
        for n in args.workers:
            runs[n].append(measure(n, args.processes))
    names = list(runs[args.workers[0]][0])
    results = {n: {name: statistics.median(r[name] for r in runs[n]) for name in names} for n in runs}
    print(
        f"load {load:.2f} before, {os.getloadavg()[0]:.2f} after (the simulation's own threads count); "
        f"{STEPS} steps at {RATE:.0f}/s; medians of {args.rounds} rounds"
    )
    print(f"{'':22}" + "".join(f"{f'N={n}':>12}" for n in results))
    for name in names:
        row = "".join(f"{results[n][name]:12.3f}" for n in results)
        ns = list(results)
        growth = [
            math.log(max(results[b][name], 1e-9) / max(results[a][name], 1e-9)) / math.log(b / a)
            for a, b in zip(ns, ns[1:])
        ]
        print(f"{name:22}{row}   growth {' '.join(f'{g:.2f}' for g in growth)}")


if __name__ == "__main__":
    main()
