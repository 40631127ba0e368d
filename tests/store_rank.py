"""A worker process that forms process groups over the driver's store, as a worker does.

``python -m tests.store_rank HOST PORT WORKER_ID``, the job's secret (hex) in
``FABRIC_MODEL_SECRET``. For each line ``GENERATION RANK WORLD_SIZE`` on stdin it joins that
generation's gloo group over one store connection, all-reduces a tensor to which it
contributes ``rank + 1``, and prints one JSON line: the sum or the collective's error, and
the seconds it took.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch

from fabric_model.transport.collective import Collective, CollectiveError
from fabric_model.transport.store.client import RemoteStore


def main(host: str, port: str, worker_id: str) -> None:
    secret = bytes.fromhex(os.environ["FABRIC_MODEL_SECRET"])
    store = RemoteStore((host, int(port)), secret, int(worker_id), timedelta(seconds=20))
    collective = Collective(store, "gloo", timedelta(seconds=20))
    for line in sys.stdin:
        generation, rank, world_size = map(int, line.split())
        started = time.monotonic()
        result: dict[str, object]
        try:
            collective.configure(generation, rank, world_size)
            tensor = torch.full((4,), float(rank + 1))
            collective.all_reduce_sum(tensor)
            result = {"sum": tensor.tolist()}
        except CollectiveError as exc:
            result = {"error": str(exc)}
        result["seconds"] = time.monotonic() - started
        print(json.dumps(result), flush=True)
    collective.shutdown()
    store.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
