"""Forming the collective group as it grows (docs/architecture.md, "Scale", "The collective group").

    python benchmarks/bench_gloo_group.py                      # P = 2, 4, 8, 16, 32
    python benchmarks/bench_gloo_group.py --ranks 2 4 8 16 32 48 --rounds 3

P real worker processes, one thread each, on this host. Each makes the product's
:class:`~fabric_model.transport.collective.Collective` over a TCP store and, at one signal,
forms generation 0's gloo group (``configure``), then runs the first allreduce of a small
tensor (a tiny model's gradients, 1,024 floats). For each P it prints, as medians over the
rounds: the slowest rank's time to form the group, to the end of the first allreduce, and the
sockets each rank holds afterwards, with the growth exponent between successive P (1: linear).

gloo connects every pair of ranks (a full mesh): a rank opens P - 1 connections, the group
P(P - 1)/2, each through the store. On 2 cores the processes also share the CPU: the figures
include that, as a host's many workers would.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _sockets() -> int:
    """Sockets this process holds."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass  # the listing's own descriptor, closed since
    return count


def _rank(host: str, port: int, rank: int, world: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    import torch
    import torch.distributed as dist

    from fabric_model.transport.collective import Collective

    torch.set_num_threads(1)
    store = dist.TCPStore(host, port, world + 1, False, timeout=timedelta(seconds=300))
    collective = Collective(store, "gloo", timedelta(seconds=300))
    store.add("ready", 1)
    store.wait(["go"])
    began = time.monotonic()
    collective.configure(0, rank, world)
    formed = time.monotonic() - began
    collective.all_reduce_sum(torch.ones(1024))
    reduced = time.monotonic() - began
    out.put((formed, reduced, _sockets()))
    store.add("done", 1)
    store.wait(["end"])
    collective.shutdown()


def measure(world: int) -> tuple[float, float, int]:
    import torch.distributed as dist

    context = mp.get_context("spawn")
    server = dist.TCPStore("127.0.0.1", 0, world + 1, True, timeout=timedelta(seconds=300), wait_for_workers=False)
    out = context.Queue()
    ranks = [context.Process(target=_rank, args=("127.0.0.1", server.port, r, world, out)) for r in range(world)]
    for process in ranks:
        process.start()
    try:
        while server.add("ready", 0) < world:
            time.sleep(0.05)
        server.set("go", "1")
        results = [out.get(timeout=120 + 10 * world) for _ in range(world)]
        while server.add("done", 0) < world:
            time.sleep(0.05)
        server.set("end", "1")
    finally:
        for process in ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
                process.join()
    return max(r[0] for r in results), max(r[1] for r in results), max(r[2] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    runs: dict[int, list[tuple[float, float, int]]] = {p: [] for p in args.ranks}
    for _ in range(args.rounds):  # interleaved: each round measures every P
        for world in args.ranks:
            runs[world].append(measure(world))
    figures = {
        "group formed s": {p: statistics.median(r[0] for r in runs[p]) for p in runs},
        "first allreduce done s": {p: statistics.median(r[1] for r in runs[p]) for p in runs},
        "sockets a rank": {p: float(max(r[2] for r in runs[p])) for p in runs},
    }
    print(f"load {load:.2f} before, {os.getloadavg()[0]:.2f} after; {os.cpu_count()} cores; medians of {args.rounds}")
    print(f"{'':24}" + "".join(f"{f'P={p}':>10}" for p in runs))
    ps = list(runs)
    for name, values in figures.items():
        growth = [math.log(values[b] / values[a]) / math.log(b / a) for a, b in zip(ps, ps[1:])]
        row = "".join(f"{values[p]:10.3f}" for p in ps)
        print(f"{name:24}{row}   growth {' '.join(f'{g:.2f}' for g in growth)}")


if __name__ == "__main__":
    main()
