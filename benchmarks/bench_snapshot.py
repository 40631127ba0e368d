"""What an in-memory snapshot of the state costs (docs/architecture.md, "Elasticity", "Saved state").

    python benchmarks/bench_snapshot.py            # the 8.4M-parameter MLP of bench_elastic.py, and a small one
    python benchmarks/bench_snapshot.py --repeat 3

For each model (SGD with momentum, after one step, so the optimizer state is full), it
measures the three parts of one snapshot as rank 0 takes it:

- copy: the device copy of the model and optimizer state at the step boundary, the only part
  the training loop waits for (``worker/snapshots.py``, ``StateUploader.upload``);
- serialize: ``torch.save`` of the copy to bytes, on the background thread;
- send: the bytes in 4 MiB ``StateChunk`` messages over a real authenticated control channel
  to a ``ControlServer`` in another process (the driver), until it holds the last chunk;

and the training step time with and without a snapshot sent from a background thread during
every step (what sharing the CPU with the upload costs the step).
"""

from __future__ import annotations

import argparse
import multiprocessing
import secrets
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fabric_model.state.checkpoint import encode_state, state_record  # noqa: E402
from fabric_model.state.uploader import CHUNK_BYTES, HostCopies  # noqa: E402
from fabric_model.step.plan import Plan, Schedule  # noqa: E402
from fabric_model.transport import protocol as p  # noqa: E402
from fabric_model.transport.control import ControlServer, connect  # noqa: E402


def models() -> dict[str, tuple[nn.Module, int]]:
    big = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024), nn.ReLU(), nn.Linear(1024, 10))
    small = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 3))
    return {"bench_elastic MLP": (big, 1024), "small MLP": (small, 12)}


def one_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    started = time.perf_counter()
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    return time.perf_counter() - started


def copy_state(model: nn.Module, opt: torch.optim.Optimizer, schedule: Schedule) -> dict:
    """What the step loop does (StateUploader.upload): copy the tensors."""
    copies = HostCopies()
    model_state, optimizer_state = copies.of(model.state_dict()), copies.of(opt.state_dict())
    copies.queued()
    copies.wait()
    return state_record(schedule, 5, "torch", 32, model_state, optimizer_state)


def snapshot_parts(model: nn.Module, opt: torch.optim.Optimizer, schedule: Schedule, server, channel) -> dict:
    started = time.perf_counter()
    record = copy_state(model, opt, schedule)
    copied = time.perf_counter()
    return {"copy": copied - started, **send(record, server, channel)}


def send(record: dict, server, channel) -> dict:
    """What the background thread does: serialize, send in chunks; until the driver has it all."""
    copied = time.perf_counter()
    data = encode_state(record)
    serialized = time.perf_counter()
    view = memoryview(data)
    count = max(1, -(-len(view) // CHUNK_BYTES))
    for i in range(count):
        channel.send(
            p.StateChunk(0, 5, "snapshot", i, bytes(view[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES]), i == count - 1)
        )
    server.get(timeout=60)  # the driver's side has the last chunk
    sent = time.perf_counter()
    return {"serialize": serialized - copied, "send": sent - serialized, "bytes": len(data)}


def driver_side(secret: bytes, out) -> None:
    """A driver's control server in its own process: says when each upload's last chunk arrived."""
    server = ControlServer(secret)
    out.put(server.address)
    while True:
        _, message = server.events.get()
        if isinstance(message, p.StateChunk) and message.last:
            out.put("done")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one worker's share of a small host
    secret = secrets.token_bytes(32)
    context = multiprocessing.get_context("spawn")
    server = context.Queue()
    driver = context.Process(target=driver_side, args=(secret, server), daemon=True)
    driver.start()
    channel = connect(server.get(timeout=60), secret)
    channel.send(p.Hello(0, 0, "bench"))
    schedule = Schedule(Plan(1000, 32, 1, 0), 1, 1, False)
    try:
        for name, (model, features) in models().items():
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            x, y = torch.randn(32, features), torch.randint(0, 3, (32,))
            one_step(model, opt, x, y)  # the momentum buffers exist
            params = sum(t.numel() for t in model.parameters())
            runs = [snapshot_parts(model, opt, schedule, server, channel) for _ in range(args.repeat)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            plain = statistics.median(one_step(model, opt, x, y) for _ in range(20))
            during = []
            for _ in range(args.repeat):
                record = copy_state(model, opt, schedule)
                thread = threading.Thread(target=send, args=(record, server, channel))
                thread.start()
                while True:  # at least one step beside the send, however soon it ends
                    during.append(one_step(model, opt, x, y))
                    if not thread.is_alive():
                        break
                thread.join()
            print(
                f"{name}: {params:,} parameters, snapshot {med['bytes'] / 2**20:.1f} MiB: "
                f"copy (the step loop's pause) {med['copy'] * 1e3:.2f} ms, "
                f"serialize {med['serialize'] * 1e3:.1f} ms and send {med['send'] * 1e3:.1f} ms on the thread; "
                f"step {plain * 1e3:.1f} ms alone, {statistics.median(during) * 1e3:.1f} ms while a snapshot is sent"
            )
    finally:
        channel.close()
        driver.terminate()
        driver.join()


if __name__ == "__main__":
    main()
