"""A script whose FabricModel may fork it into the warm process, run as its own process.

python -m tests.warm_job OUT_DIR RUN_DIR [--forward] [--datasets]

Before building ``FabricModel`` it sets up what a worker must not inherit (a log file on the
root logger, the package's loggers at ERROR, a SIGTERM handler, grad mode off, an open file);
``--forward`` runs the model first, so torch's OpenMP threads exist; ``--datasets`` imports Hugging
Face's ``datasets`` first (pyarrow starts jemalloc's background thread). It writes ``OUT_DIR/job.json``
(its own pid and command line, its warm process's right after ``FabricModel(...)``, the
replicas' digests), and every worker writes ``OUT_DIR/worker-<pid>.json`` (tests/test_warm_start.py).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F

from fabric_model import FabricModel
from tests.helpers import MLP, make_data


class Inspect:
    """A worker logger that records, once per worker, what its process inherited."""

    def __init__(self, out: str, caller_file: str) -> None:
        self.out, self.caller_file = out, caller_file

    def log_train_metrics(self, metrics, iteration, epoch, workers):
        path = Path(self.out) / f"worker-{os.getpid()}.json"
        if path.exists():
            return
        logging.getLogger("fabric_model.worker").info("inspected worker %d", os.getpid())
        fds = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                fds.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        facts = {
            "parent": os.getppid(),
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "threads": torch.get_num_threads(),
            "package_level": logging.getLogger("fabric_model").getEffectiveLevel(),
            "root_handlers": [type(h).__name__ for h in logging.getLogger().handlers],
            # Not the caller's handler: the worker's own preemption notice (worker/notice.py).
            "sigterm": type(getattr(signal.getsignal(signal.SIGTERM), "__self__", None)).__name__,
            "grad": torch.is_grad_enabled(),
            "caller_file_open": self.caller_file in fds,
        }
        path.write_text(json.dumps(facts))


def datasets():
    return make_data(128), None


def thread_names() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return names


def main(out: Path, run_dir: str, forward: bool, with_datasets: bool = False) -> None:
    if with_datasets:
        import time

        import datasets as hf_datasets  # noqa: F401  (what almost every Hugging Face script imports)

        time.sleep(0.2)  # jemalloc's background thread starts as pyarrow allocates
    threads = thread_names()
    torch.manual_seed(0)
    model = MLP()
    if forward:
        model(torch.randn(4096, 12))
        torch.set_num_threads(2)  # a parallel operation on two threads: OpenMP's pool starts on any CPU
        torch.ones(1 << 22).add_(1.0)
    caller_file = out / "caller.log"
    logging.basicConfig(filename=caller_file, level=logging.INFO)
    logging.getLogger("fabric_model").setLevel(logging.ERROR)
    signal.signal(signal.SIGTERM, lambda *_: None)
    held = open(out / "held.txt", "w")  # noqa: SIM115  (open while the job runs)
    torch.set_grad_enabled(False)
    fm = FabricModel(
        model,
        datasets,
        F.cross_entropy,
        torch.optim.SGD(model.parameters(), lr=0.1),
        worker_logger_callback=Inspect(str(out), str(out / "held.txt")),
    )
    torch.set_grad_enabled(True)
    warm = [{"pid": p.pid, "cmdline": p.cmdline()} for p in psutil.Process().children()]
    result = fm.train(1, 16, 2, run_dir=run_dir, seed=3, verbose=0)
    held.close()
    job = {
        "pid": os.getpid(),
        "cmdline": psutil.Process().cmdline(),
        "warm": warm,
        "digests": sorted(set(result.replica_digests.values())),
        "threads": threads,  # the caller's, before FabricModel(...)
    }
    (out / "job.json").write_text(json.dumps(job))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], "--forward" in sys.argv[3:], "--datasets" in sys.argv[3:])
