"""What a preemption notice costs (docs/architecture.md, "Preemption"), for a fast and a slow step.

    python benchmarks/bench_preemption.py                 # a ~2 ms and a ~50 ms step, 3 rounds each
    python benchmarks/bench_preemption.py --rounds 5

For each step size, with 2 CPU workers (``deterministic=False``, the default):

- **worker**: one worker sends itself SIGTERM after a step mid-epoch (so the signal comes
  between steps, as a platform's would at a random time). Measured: the signal to that
  worker's process exit (polled every millisecond from the driver's process), and the pause
  the other sees: the time between the commits of the last step with it and the first
  step without it, less the median step interval of the run.
- **driver**: the script's process gets SIGTERM mid-epoch. Measured: the signal to the
  checkpoint on disk (the driver's own figure, in driver.log), to the process's exit (status
  143: the workers stopped, then the interpreter's own teardown), and the checkpoint's size.

Step times are the runs' own median commit intervals (the driver's records), not targets.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import commits
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: (label, input features, hidden width, hidden layers, samples per micro-batch)
SIZES = {"fast": (32, 64, 1, 16), "slow": (256, 1408, 3, 128)}
EPOCHS, STEPS, WORKERS = 2, 40, 2

JOB = """
import json, os, signal, sys, time
from pathlib import Path
import torch
import torch.nn.functional as F
from fabric_model import FabricModel
from fabric_model.context import worker_context

features, width, layers, batch, out_dir, mode = sys.argv[1:7]
features, width, layers, batch = int(features), int(width), int(layers), int(batch)
g = torch.Generator().manual_seed(0)
n = {steps} * batch * {workers}
x = torch.randn(n, features, generator=g)
y = (x @ torch.randn(features, 10, generator=g)).argmax(1)
data = [(x[i].clone(), int(y[i])) for i in range(n)]
torch.manual_seed(0)
mods = [torch.nn.Linear(features, width), torch.nn.ReLU()]
for _ in range(layers - 1):
    mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
model = torch.nn.Sequential(*mods, torch.nn.Linear(width, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
at = {steps} + {steps} // 2  # mid-way through the second epoch


class SignalSelf:  # a worker logger: the last worker signals itself after step `at`
    def log_train_metrics(self, metrics, iteration, epoch, workers):
        ctx = worker_context()
        if mode == "worker" and ctx.worker_id == {workers} - 1 and iteration == at:
            Path(out_dir, "signalled.json").write_text(json.dumps({{"pid": os.getpid(), "time": time.time()}}))
            os.kill(os.getpid(), signal.SIGTERM)


class Mark:  # the driver's logger: says when the run is mid-way through the second epoch
    def log_train_metrics(self, metrics, iteration, epoch, workers):
        if iteration == at:
            Path(out_dir, "mark").write_text(str(time.time()))


os.environ["EDT_REPLACE_WORKERS"] = "0"
fm = FabricModel(model, lambda: (data, None), F.cross_entropy, opt, worker_logger_callback=SignalSelf(),
                 driver_logger_callback=Mark())
fm.train({epochs}, batch, {workers}, effective_batch_size=batch * {workers}, seed=1, run_dir=str(Path(out_dir, "run")),
         verbose=0)
"""


def records(run_dir: Path, kind: str) -> list[dict]:
    with open(run_dir / "logs" / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if r.get("type") == kind]


def step_interval(train: list[dict]) -> float:
    """A step's median time from the commit stamps (a lone worker's come in frames: benchmarks/commits.py)."""
    return commits.median_step([r["time"] for r in sorted(train, key=lambda r: r["iteration"])], 0)


def start(script: Path, size: str, out: Path, mode: str) -> subprocess.Popen:
    args = [str(v) for v in SIZES[size]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FABRIC_MODEL_CPU_WORKERS": str(WORKERS)}
    return subprocess.Popen([sys.executable, str(script), *args, str(out), mode], env=env, stderr=subprocess.PIPE)


def worker_round(script: Path, size: str, out: Path) -> dict[str, float]:
    proc = start(script, size, out, "worker")
    signalled, exited = out / "signalled.json", []

    def watch() -> None:  # the leaver's exit, seen from outside, to the millisecond
        while not signalled.exists() and proc.poll() is None:
            time.sleep(0.001)
        if proc.poll() is not None:
            return
        pid = json.loads(signalled.read_text())["pid"]
        try:
            process = psutil.Process(pid)
            while process.status() != psutil.STATUS_ZOMBIE:
                time.sleep(0.001)
        except psutil.NoSuchProcess:
            pass  # gone (and reaped) between two polls
        exited.append(time.time())

    watcher = threading.Thread(target=watch)
    watcher.start()
    _, err = proc.communicate(timeout=600)
    watcher.join(5)
    assert proc.returncode == 0 and exited, (proc.returncode, exited, err.decode()[-2000:])
    sent = json.loads(signalled.read_text())["time"]
    run = out / "run"
    train, (_, left) = records(run, "train"), records(run, "generation")
    assert "leaves (SIGTERM)" in left["reason"], left
    step = step_interval(train)
    before = max(r["time"] for r in train if r["time"] < left["time"])
    after = min(r["time"] for r in train if r["time"] > left["time"])
    return {"step_ms": step * 1e3, "exit_ms": (exited[0] - sent) * 1e3, "pause_ms": (after - before - step) * 1e3}


def driver_round(script: Path, size: str, out: Path) -> dict[str, float]:
    proc = start(script, size, out, "driver")
    mark = out / "mark"
    while not mark.exists() and proc.poll() is None:
        time.sleep(0.001)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    took = time.monotonic() - sent
    assert proc.returncode == 143, err.decode()[-2000:]
    run = out / "run"
    end = json.loads((run / "run.json").read_text())["end"]
    size_bytes = (run / "checkpoints" / end["checkpoint"]).stat().st_size
    # "SIGTERM: saved <file> (<n> bytes) in <s> s": from the signal to the checkpoint on disk.
    saved = re.search(r"SIGTERM: saved .* in ([0-9.]+) s", (run / "logs" / "driver.log").read_text())
    assert saved is not None
    return {
        "step_ms": step_interval(records(run, "train")) * 1e3,
        "saved_ms": float(saved.group(1)) * 1e3,
        "exit_ms": took * 1e3,
        "checkpoint_mb": size_bytes / 2**20,
    }


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp, "job.py")
        script.write_text(JOB.format(steps=STEPS, workers=WORKERS, epochs=EPOCHS))
        for size in SIZES:
            rounds = {"worker": [], "driver": []}
            for i in range(args.rounds):
                for mode, fn in (("worker", worker_round), ("driver", driver_round)):
                    out = Path(tmp, f"{size}-{mode}-{i}")
                    out.mkdir()
                    rounds[mode].append(fn(script, size, out))
            w, d = rounds["worker"], rounds["driver"]
            print(
                f"{size} step {summary([r['step_ms'] for r in w])} ms, {WORKERS} workers: "
                f"worker SIGTERM -> its exit {summary([r['exit_ms'] for r in w])} ms, "
                f"the survivor's pause {summary([r['pause_ms'] for r in w])} ms; "
                f"driver SIGTERM -> checkpoint on disk {summary([r['saved_ms'] for r in d])} ms, "
                f"-> exit 143 {summary([r['exit_ms'] for r in d])} ms, "
                f"checkpoint {statistics.median(r['checkpoint_mb'] for r in d):.2f} MiB",
                flush=True,
            )


if __name__ == "__main__":
    main()
