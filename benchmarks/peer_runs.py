"""One timed training run for ``bench_peers.py``, in a fresh process (so start-up counts).

    python benchmarks/peer_runs.py KIND WORKLOAD STEPS OUT_JSON

KIND: plain | lightning | fabric1 | ddp | fabric2, or faults (see ``run_faults``); plain_acc
and fabric1_acc also compute an accuracy each step (FabricModel's default, ``metrics=None``;
the others read the loss alone, FabricModel with ``metrics=[]``). Every run
trains WORKLOAD (mlp | cnn) for STEPS steps of 64 samples per process on synthetic data, and writes to OUT_JSON the
wall-clock time (``time.time()``) at the end of each step (rank 0's, for two processes) and
``first``, when its first step was committed (FabricModel: the driver's record of it). The
caller stamps the process start, so start-up includes interpreter, imports, data and group.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

BATCH = 64


def make_model(workload: str) -> nn.Module:
    torch.manual_seed(0)
    if workload == "mlp":
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def dataset(workload: str, samples: int) -> TensorDataset:
    """Synthetic, deterministic: the same in every process."""
    g = torch.Generator().manual_seed(1)
    shape = (256,) if workload == "mlp" else (3, 32, 32)
    return TensorDataset(torch.randn(samples, *shape, generator=g), torch.randint(0, 10, (samples,), generator=g))


def cores() -> int:
    return len(os.sched_getaffinity(0))


def train_loop(model, optimizer, loader, backward=None, accuracy: bool = False) -> list[float]:
    """The textbook loop; the loss is read each step, as FabricModel reports it every step (and
    with ``accuracy``, the batch's accuracy too, as a tutorial's loop shows it)."""
    times = []
    for x, y in loader:
        optimizer.zero_grad()
        output = model(x)
        loss = F.cross_entropy(output, y)
        backward(loss) if backward is not None else loss.backward()
        optimizer.step()
        loss.item()
        if accuracy:
            (output.argmax(1) == y).float().mean().item()
        times.append(time.time())
    return times


def run_plain(workload: str, steps: int, accuracy: bool = False) -> dict:
    torch.set_num_threads(cores())
    model = make_model(workload)
    loader = DataLoader(dataset(workload, steps * BATCH), batch_size=BATCH, shuffle=True)
    times = train_loop(model, make_optimizer(model), loader, accuracy=accuracy)
    return {"times": times, "first": times[0]}


def run_lightning(workload: str, steps: int) -> dict:
    from lightning.fabric import Fabric

    torch.set_num_threads(cores())
    fabric = Fabric(accelerator="cpu", devices=1)
    model = make_model(workload)
    model, optimizer = fabric.setup(model, make_optimizer(model))
    loader = fabric.setup_dataloaders(DataLoader(dataset(workload, steps * BATCH), batch_size=BATCH, shuffle=True))
    times = train_loop(model, optimizer, loader, backward=fabric.backward)
    return {"times": times, "first": times[0]}


def _ddp_rank(rank: int, workload: str, steps: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data.distributed import DistributedSampler

    torch.set_num_threads(max(1, cores() // 2))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = DistributedDataParallel(make_model(workload))
        data = dataset(workload, steps * BATCH * 2)
        sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=0)
        times = train_loop(model, make_optimizer(model), DataLoader(data, batch_size=BATCH, sampler=sampler))
        if rank == 0:  # every step ends in an allreduce: rank 0's clock speaks for the job
            Path(out).write_text(json.dumps({"times": times, "first": times[0]}))
    finally:
        dist.destroy_process_group()


def run_ddp(workload: str, steps: int, out: str) -> None:
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_rank, args=(workload, steps, port, out), nprocs=2, join=True)


def step_clock(path: str):
    """A FabricModel callback: rank 0 stamps the end of each step, written when training ends."""
    from fabric_model import Callback
    from fabric_model.context import worker_context

    class StepClock(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_batch_end(self, step: int) -> None:
            self.times.append(time.time())

        def on_train_end(self) -> None:
            context = worker_context()
            if context is not None and context.rank == 0:
                Path(path).write_text(json.dumps(self.times))

    return StepClock()


class Quiet:
    def on_train_begin(self) -> None:
        pass


def run_fabric(workload: str, steps: int, engines: int, accuracy: bool = False) -> dict:
    import logging

    from fabric_model import FabricModel

    logging.getLogger("fabric_model").setLevel(logging.ERROR)
    model = make_model(workload)
    samples = steps * BATCH * engines
    with tempfile.TemporaryDirectory() as tmp:
        times = os.path.join(tmp, "times.json")
        clock = step_clock(times)
        fm = FabricModel(
            model, lambda: (dataset(workload, samples), None), F.cross_entropy, make_optimizer(model),
            metrics=None if accuracy else [], driver_logger_callback=Quiet(), user_callback=[clock],
        )  # fmt: skip
        fm.train(1, BATCH, engines, run_dir=os.path.join(tmp, "run"), seed=0)
        log = Path(tmp, "run", "logs", "metrics.jsonl").read_text().splitlines()
        first = min(r["time"] for r in map(json.loads, log) if r["type"] == "train")
        return {"times": json.loads(Path(times).read_text()), "first": first}


def run_faults(steps: int) -> dict:
    """3 FabricModel workers on the MLP, one SIGKILLed inside a step, beside an undisturbed run.

    The steps are paced (20 ms) so that the replacement worker, started after the driver's
    backoff, joins while training still runs."""
    import logging

    from fabric_model import FabricModel
    from fabric_model.testing import FaultInjector, Kill, fired_at

    logging.getLogger("fabric_model").setLevel(logging.ERROR)
    os.environ["FABRIC_MODEL_CPU_WORKERS"] = "3"  # three workers on a 2-core machine too
    samples, kill_step = steps * BATCH * 3, 20
    final, log = {}, []
    for disturbed in (False, True):
        model = make_model("mlp")
        with tempfile.TemporaryDirectory() as tmp:
            injector = FaultInjector([Kill(1, kill_step)] if disturbed else [], tmp, step_delay=0.02)
            fm = FabricModel(
                model, lambda: (dataset("mlp", samples), None), F.cross_entropy, make_optimizer(model),
                worker_logger_callback=injector, driver_logger_callback=Quiet(),
            )  # fmt: skip
            fm.train(2, BATCH, 3, run_dir=os.path.join(tmp, "run"), seed=0)
            final[disturbed] = {k: v.clone() for k, v in model.state_dict().items()}
            if disturbed:
                killed = fired_at(tmp, 0)
                log = [json.loads(x) for x in Path(tmp, "run", "logs", "metrics.jsonl").read_text().splitlines()]
    diff = max(float((final[True][k] - final[False][k]).abs().max()) for k in final[True])
    steps_done: dict[tuple[int, int], dict] = {}
    for record in log:  # the later record of a step wins, as in the README
        if record["type"] == "train":
            steps_done[(record["epoch"], record["step"])] = record
    # Reports of steps before the kill may be committed after it (workers send them in
    # batches): count from the steps of the generations formed after the kill.
    first = min(r["generation"] for r in log if r["type"] == "generation" and r["time"] > killed)
    after = [r for r in log if r["type"] == "train" and r["generation"] >= first]
    counts = [sorted(j for mbs in r["micro_batches"].values() for j in mbs) for r in steps_done.values()]
    return {
        "kill_to_next": after[0]["time"] - killed,
        "kill_to_replacement": next((r["time"] - killed for r in after if r["workers"] == 3), None),
        "lost": sum(len(set(range(3)) - set(c)) for c in counts) * BATCH,
        "doubled": sum(len(c) - len(set(c)) for c in counts) * BATCH,
        "batch_kept": all(len(c) == 3 for c in counts) and len(steps_done) == 2 * steps,
        "weights_max_diff": diff,
    }


def main(argv: list[str]) -> int:
    kind, workload, steps, out = argv[0], argv[1], int(argv[2]), argv[3]
    if kind == "ddp":
        run_ddp(workload, steps, out)
        return 0
    runs = {
        "plain": lambda: run_plain(workload, steps),
        "plain_acc": lambda: run_plain(workload, steps, accuracy=True),
        "fabric1_acc": lambda: run_fabric(workload, steps, 1, accuracy=True),
        "lightning": lambda: run_lightning(workload, steps),
        "fabric1": lambda: run_fabric(workload, steps, 1),
        "fabric2": lambda: run_fabric(workload, steps, 2),
        "faults": lambda: run_faults(steps),
        "torchft": lambda: __import__("torchft_faults").faults(steps),
    }
    Path(out).write_text(json.dumps(runs[kind]()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
