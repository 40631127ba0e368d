"""Forming a generation's process group over the driver's store vs over torch's TCPStore.

    python benchmarks/bench_store.py                 # tcp, ours, tcp, ours
    python benchmarks/bench_store.py remote          # ours only

Three spawned ranks form one gloo group per generation, 15 generations, over either store,
then all-reduce 100k floats 50 times. Prints the median time to form a group (the slowest
rank's) and the median allreduce. The store is touched only when a group forms, so the
allreduce column shows that it costs the steps nothing. Not a test.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SECRET = b"b" * 32
RANKS, GENERATIONS, REPEATS = 3, 15, 50


def rank(kind: str, address: tuple[str, int], r: int, conn: Any) -> None:
    import torch
    import torch.distributed as dist

    from fabric_model.transport.collective import Collective

    store: Any
    if kind == "remote":
        from fabric_model.transport.store.client import RemoteStore

        store = RemoteStore(address, SECRET, r, timedelta(seconds=30))
    else:
        store = dist.TCPStore(address[0], address[1], is_master=False, timeout=timedelta(seconds=30))
    collective = Collective(store, "gloo", timedelta(seconds=30))
    tensor = torch.zeros(100_000)
    while (generation := conn.recv()) is not None:
        t0 = time.perf_counter()
        collective.configure(generation, r, RANKS)
        formed = time.perf_counter() - t0
        collective.all_reduce_sum(tensor)  # the first one sets up the pairs
        t1 = time.perf_counter()
        for _ in range(REPEATS):
            collective.all_reduce_sum(tensor)
        conn.send((formed, (time.perf_counter() - t1) / REPEATS))
    collective.shutdown()


def bench(kind: str) -> None:
    import torch.distributed as dist

    service = server = tcp = None
    if kind == "remote":
        from fabric_model.transport.control import ControlServer
        from fabric_model.transport.store.server import StoreService

        service = StoreService()
        server = ControlServer(SECRET, store=service)
        address = server.address
    else:
        tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        address = ("127.0.0.1", tcp.port)
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(RANKS)]
    procs = [ctx.Process(target=rank, args=(kind, address, r, pipes[r][1])) for r in range(RANKS)]
    for proc in procs:
        proc.start()
    forms, steps = [], []
    for generation in range(GENERATIONS):
        if service is not None:
            service.admit(generation, range(RANKS))
        for end, _ in pipes:
            end.send(generation)
        results = [end.recv() for end, _ in pipes]
        forms.append(max(f for f, _ in results))
        steps.append(statistics.mean(s for _, s in results))
    for end, _ in pipes:
        end.send(None)
    for proc in procs:
        proc.join()
    if server is not None:
        server.close()
    del tcp
    forms = forms[1:]  # the first includes connecting
    name = "ours" if kind == "remote" else "TCPStore"
    print(
        f"{name:8s} group formation: median {statistics.median(forms) * 1e3:.1f} ms "
        f"[{min(forms) * 1e3:.1f}-{max(forms) * 1e3:.1f}]; allreduce of 100k floats: "
        f"median {statistics.median(steps) * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    for kind in sys.argv[1:] or ["tcp", "remote", "tcp", "remote"]:
        bench(kind)
