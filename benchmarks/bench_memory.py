"""Per-worker memory: FabricModel's workers against hand-written DDP workers on the same model.

    PYTHONPATH=. python benchmarks/bench_memory.py               # MLP 256->512->512->10, 3 rounds
    PYTHONPATH=. python benchmarks/bench_memory.py --wide        # the 8.4M-parameter MLP of bench_elastic
    PYTHONPATH=. python benchmarks/bench_memory.py --cnn         # bench_peers' small CNN (8 MiB activations)
    PYTHONPATH=. python benchmarks/bench_memory.py --sharded     # optimizer state per worker, sharded or not
    PYTHONPATH=. python benchmarks/bench_memory.py --sharded --cnn   # the same on the small CNN

``--sharded`` trains the MLP (or the CNN) with Adam on 1, 2 and 4 workers, with and without
``shard_optimizer_state=True``, interleaved, and prints each worker's optimizer-state bytes
(``worker_context().optimizer_state_bytes``) against the unsharded run's, with the target of
the buddy copy (2/N; 1/N is the owner's slice alone), the gradient bytes a worker holds between
steps (``worker_context().gradient_bytes``: what the next forward's memory holds besides its
own; sharded among several, the gradients exist from a step's first backward to its update
only), and the median step time (steps 10 to 40, the workers' own clocks) as the unsharded
step's time over the sharded one's (1.0: as fast).

Each round runs, in turn, 2 FabricModel workers forked from the warm process (itself a fork of
the job script), 2 FabricModel workers as fresh interpreters (``FABRIC_MODEL_WARM_START=0``),
and 2 DDP ranks on gloo (``torch.multiprocessing.spawn``), each holding the same data set.
Every worker measures itself with psutil after step 20:
RSS (resident pages, shared ones counted in full by each process), PSS (shared pages divided
among the processes sharing them) and USS (pages only this process holds). Forked workers
share the warm process's imported pages, so RSS overstates what they cost together; PSS is
the honest per-worker share, USS what ending one worker gives back; the warm process's own
PSS (printed too) belongs to the job as well: half of it on top of each forked worker's. Figures: median [min-max]
over rounds and workers, in MiB, and the ratio of the medians to DDP's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = 20

COMMON = """
import json, os, sys, psutil, torch, torch.nn as nn, torch.nn.functional as F
F_IN, HID = (1024, 4096) if WIDE else (256, 512)
SHAPE = (3, 32, 32) if CNN else (F_IN,)
def make_model():
    torch.manual_seed(0)
    if CNN:
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10))
    if WIDE:
        return nn.Sequential(nn.Linear(F_IN, HID), nn.ReLU(), nn.Linear(HID, F_IN), nn.ReLU(), nn.Linear(F_IN, 10))
    return nn.Sequential(nn.Linear(F_IN, HID), nn.ReLU(), nn.Linear(HID, HID), nn.ReLU(), nn.Linear(HID, 10))
class Data:
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(2 * 64 * 30, *SHAPE, generator=g)
        self.y = torch.randint(0, 10, (2 * 64 * 30,), generator=g)
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return self.x[i], self.y[i]
def measure(out, step):
    m = psutil.Process().memory_full_info()
    with open(os.path.join(out, f"{os.getpid()}.json"), "w") as f:
        json.dump({"rss": m.rss, "pss": m.pss, "uss": m.uss, "step": step}, f)
"""

FABRIC = """
from fabric_model import FabricModel
class Measure:
    def __init__(self, out):
        self.out, self.done, self.caller = out, False, os.getpid()
    def log_train_metrics(self, metrics, iteration, epoch, workers):
        if iteration == STEP and not self.done:
            self.done = True
            measure(self.out, iteration)
            parent = psutil.Process(os.getppid())
            if parent.pid != self.caller:  # forked from the warm process: its own share, once
                m = parent.memory_full_info()
                with open(os.path.join(self.out, f"warm-{parent.pid}.jsonw"), "w") as f:
                    json.dump({"rss": m.rss, "pss": m.pss, "uss": m.uss}, f)
model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
FabricModel(model, lambda: (Data(), None), F.cross_entropy, opt, worker_logger_callback=Measure(OUT)).train(
    1, 64, 2, seed=0, run_dir=os.path.join(OUT, "run"))
"""

SHARDED = """
import time
from fabric_model import FabricModel, worker_context
class Measure:
    def __init__(self, out):
        self.out, self.times = out, []
    def log_train_metrics(self, metrics, iteration, epoch, workers):
        self.times.append(time.perf_counter())
        if iteration == LAST:
            gaps = sorted(b - a for a, b in zip(self.times[9:], self.times[10:]))
            with open(os.path.join(self.out, f"{os.getpid()}.json"), "w") as f:
                ctx = worker_context()
                json.dump(
                    {"bytes": ctx.optimizer_state_bytes, "grads": ctx.gradient_bytes, "step": gaps[len(gaps) // 2]}, f
                )
model = make_model()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
per_epoch = len(Data()) // (64 * WORKERS)
FabricModel(model, lambda: (Data(), None), F.cross_entropy, opt, worker_logger_callback=Measure(OUT)).train(
    -(-LAST // per_epoch), 64, WORKERS, seed=0, run_dir=os.path.join(OUT, "run"), verbose=0,
    shard_optimizer_state=SHARD, validation_freq=1000, checkpoint_freq=0)
"""

DDP = """
import torch.distributed as dist, torch.multiprocessing as mp
def rank(r):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(max(1, os.cpu_count() // 2))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{PORT}", rank=r, world_size=2)
    model = nn.parallel.DistributedDataParallel(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = Data()  # the same data set as FabricModel's workers hold
    for step in range(1, STEP + 1):
        i = (2 * step + r) * 64
        x, y = data.x[i : i + 64], data.y[i : i + 64]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    measure(OUT, STEP)
    dist.destroy_process_group()
if __name__ == "__main__":
    mp.spawn(rank, nprocs=2)
"""


def _run(kind: str, out: Path, wide: bool, cnn: bool, port: int) -> list[dict[str, int]]:
    out.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env["FABRIC_MODEL_CPU_WORKERS"] = "2"
    if kind == "fresh":
        env["FABRIC_MODEL_WARM_START"] = "0"
    header = f"WIDE={wide}\nCNN={cnn}\nSTEP={STEP}\nOUT={str(out)!r}\nPORT={port}\n" + COMMON
    code = header + (DDP if kind == "ddp" else FABRIC)
    script = out / "job.py"  # a file, not -c: spawned DDP ranks import their __main__
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{done.stderr[-3000:]}")
    warm = [json.loads(p.read_text()) for p in out.glob("*.jsonw")]
    return [json.loads(p.read_text()) for p in out.glob("*.json")] + [{**w, "warm": 1} for w in warm]


def _run_sharded(out: Path, workers: int, shard: bool, cnn: bool) -> list[dict[str, float]]:
    out.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env["FABRIC_MODEL_CPU_WORKERS"] = str(workers)
    header = f"WIDE=False\nCNN={cnn}\nLAST=40\nWORKERS={workers}\nSHARD={shard}\nOUT={str(out)!r}\n" + COMMON
    script = out / "job.py"
    script.write_text(header + SHARDED)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"sharded={shard} on {workers} failed:\n{done.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in out.glob("*.json")]


def sharded_table(rounds: int, cnn: bool) -> None:
    """Optimizer-state bytes a worker and step time, sharded against unsharded, for 1, 2 and 4 workers."""
    samples: dict[tuple[int, bool], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for workers in (1, 2, 4):
                for shard in (False, True):
                    runs = _run_sharded(Path(tmp) / f"{workers}-{shard}-{r}", workers, shard, cnn)
                    samples.setdefault((workers, shard), []).extend(runs)
            print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    model = "small CNN 3x32x32" if cnn else "MLP 256->512->512->10"
    print(f"{model} with Adam; medians over {rounds} rounds x N workers")
    print(
        "workers   state/worker unsharded   sharded   ratio   target (buddy)   "
        "gradients between steps unsharded   sharded   step unsharded/sharded"
    )
    for workers in (1, 2, 4):
        plain, sharded = samples[(workers, False)], samples[(workers, True)]
        plain_bytes = statistics.median(s["bytes"] for s in plain)
        sharded_bytes = statistics.median(s["bytes"] for s in sharded)
        plain_grads = statistics.median(s["grads"] for s in plain)
        sharded_grads = statistics.median(s["grads"] for s in sharded)
        speed = statistics.median(s["step"] for s in plain) / statistics.median(s["step"] for s in sharded)
        target = min(1.0, 2 / workers)
        print(
            f"{workers:>7}   {plain_bytes / 2**20:>17.2f} MiB   {sharded_bytes / 2**20:>5.2f} MiB"
            f"   {sharded_bytes / plain_bytes:>5.2f}   <= {target:.2f} (1/N {1 / workers:.2f})"
            f"   {plain_grads / 2**20:>30.2f} MiB   {sharded_grads / 2**20:>5.2f} MiB   {speed:>12.2f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--wide", action="store_true")
    which.add_argument("--cnn", action="store_true")
    parser.add_argument("--sharded", action="store_true")
    args = parser.parse_args()
    if args.sharded:
        if args.wide:
            parser.error("--sharded takes the MLP or --cnn")
        sharded_table(args.rounds, args.cnn)
        return 0
    kinds = {
        "warm": "fabric_model, forked from the warm process",
        "fresh": "fabric_model, fresh interpreters",
        "ddp": "hand-written DDP (gloo)",
    }
    samples: dict[str, list[dict[str, int]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for i, kind in enumerate(kinds):
                samples[kind] += _run(kind, Path(tmp) / f"{kind}-{r}", args.wide, args.cnn, 29600 + 10 * r + i)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    model = "MLP 1024->4096->1024->10 (8.4M)" if args.wide else "MLP 256->512->512->10"
    model = "small CNN 3x32x32" if args.cnn else model
    print(f"{model}, 2 workers, after step {STEP}; MiB, median [min-max] over {args.rounds} rounds x 2 workers")
    base = {m: statistics.median(s[m] for s in samples["ddp"]) for m in ("rss", "pss", "uss")}
    # The warm process holds the pages its forks share: its PSS counts toward the job's total.
    samples["warm process itself"] = [s for s in samples["warm"] if s.get("warm")]
    samples["warm"] = [s for s in samples["warm"] if not s.get("warm")]
    kinds["warm process itself"] = "  the warm process itself (idle, shared pages)"
    for kind, label in kinds.items():
        cells = []
        for m in ("rss", "pss", "uss"):
            values = [s[m] / 2**20 for s in samples[kind]]
            med = statistics.median(values)
            cells.append(f"{m} {med:6.0f} [{min(values):.0f}-{max(values):.0f}] x{med * 2**20 / base[m]:.2f}")
        print(f"{label:<44} " + "   ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
