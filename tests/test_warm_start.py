"""The warm process: local workers are its forks, keep what a fresh worker gets, and no process
outlives the job (the caller killed or interrupted: tests/test_failures.py)."""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.config import threads_per_worker
from fabric_model.launchers.local import worker_environment
from fabric_model.launchers.warm_client import WarmProcess
from fabric_model.protocol import LAUNCHED_ENV, SECRET_ENV
from fabric_model.testing import FaultInjector

from .helpers import fresh_model_and_optimizer, make_data

DATA = make_data(128)
WARM = "fabric_model.launchers.warm"


class Inspect:
    """A worker logger that records, once per worker, what its process looks like."""

    def __init__(self, out: Path) -> None:
        self.out = str(out)

    def log_train_metrics(self, metrics, iteration, epoch, workers):
        import torch

        path = Path(self.out) / f"{os.getpid()}.json"
        if path.exists():
            return
        print(f"worker output {os.getpid()}")  # must reach this worker's log file
        facts = {
            "parent": psutil.Process(os.getppid()).cmdline(),
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "threads": torch.get_num_threads(),
            "launched": os.environ.get(LAUNCHED_ENV),
            "sigint_ignored": signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
            "tensorflow": "tensorflow" in sys.modules,
            "package": sys.modules["fabric_model"].__file__,
        }
        path.write_text(json.dumps(facts))


class KillWarmProcess:
    """A driver logger that SIGKILLs the job's warm process at ``iteration``."""

    def __init__(self, iteration: int) -> None:
        self.iteration = iteration

    def log_train_metrics(self, metrics, iteration, epoch, workers):
        if iteration == self.iteration and self.iteration > 0:
            self.iteration = 0  # once: after the roll back, iteration 3 comes again
            for child in psutil.Process().children():
                if WARM in child.cmdline():
                    child.kill()


def shadowing_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Work in a folder holding another ``fabric_model``: workers must import the caller's."""
    shadow = tmp_path / "cwd" / "fabric_model"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('the working directory shadowed the package')\n")
    monkeypatch.chdir(shadow.parent)


SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []


def test_workers_are_forks_of_the_warm_process_with_a_fresh_workers_environment(run_dir, tmp_path, monkeypatch):
    shadowing_package(monkeypatch, tmp_path)
    # An interactive caller (python -c, a notebook) imports from its working directory ("" on
    # sys.path, last here so the caller's fabric_model stays first): so must its workers.
    (tmp_path / "cwd" / "cwd_datasets.py").write_text(
        "from tests.helpers import make_data\n\ndef datasets():\n    return make_data(128), None\n"
    )
    monkeypatch.setattr(sys, "path", [*sys.path, ""])
    datasets = importlib.import_module("cwd_datasets").datasets
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(model, datasets, F.cross_entropy, opt, worker_logger_callback=Inspect(tmp_path))
    fm.train(1, 16, 2, run_dir=run_dir)
    facts = {int(p.stem): json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert len(facts) == 2
    for fact in facts.values():
        assert fact["parent"][1:] == [*SAFE_PATH, "-m", WARM, "torch"]
        assert fact["package"] == sys.modules["fabric_model"].__file__
        assert fact["threads"] == threads_per_worker(2)
        assert fact["omp"] == os.environ.get("OMP_NUM_THREADS", str(threads_per_worker(2)))
        assert fact["launched"] == "1" and fact["sigint_ignored"] and not fact["tensorflow"]
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("worker-*.log"))
    assert all(f"worker output {pid}" in logs for pid in facts)


def test_a_killed_warm_process_takes_its_workers_and_fresh_ones_finish_the_job(run_dir, tmp_path, monkeypatch):
    shadowing_package(monkeypatch, tmp_path)
    (tmp_path / "facts").mkdir()
    paced = FaultInjector([], tmp_path, inner=Inspect(tmp_path / "facts"), step_delay=0.05)  # no fault, slower steps
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(
        model,
        lambda: (DATA, None),
        F.cross_entropy,
        opt,
        worker_logger_callback=paced,
        driver_logger_callback=KillWarmProcess(3),
    )
    result = fm.train(3, 16, 2, run_dir=run_dir)
    assert len(result.history) == 3 and len(set(result.replica_digests.values())) == 1
    parents = [json.loads(p.read_text())["parent"] for p in (tmp_path / "facts").glob("*.json")]
    assert any(WARM in cmd for cmd in parents)  # the first workers, forked
    assert any(WARM not in cmd for cmd in parents)  # then fresh interpreters
    packages = {json.loads(p.read_text())["package"] for p in (tmp_path / "facts").glob("*.json")}
    assert packages == {sys.modules["fabric_model"].__file__}


@pytest.fixture
def warm(tmp_path):
    process = WarmProcess(worker_environment(1, "127.0.0.1"), tmp_path / "warm.log", "torch")
    yield process
    process.close()


def _env(secret: str = "00" * 32) -> dict[str, str]:
    return {**worker_environment(1, "127.0.0.1"), SECRET_ENV: secret, LAUNCHED_ENV: "1"}


def test_a_forked_workers_exit_code_output_and_kill_are_a_fresh_ones(warm, tmp_path):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens there
    refused = warm.fork(0, ["worker", "--driver", f"127.0.0.1:{port}", "--worker-id", "0"], _env(), tmp_path / "w0.log")
    assert refused is not None and refused.wait(timeout=60) == 2
    assert "cannot join the driver" in (tmp_path / "w0.log").read_text()
    usage = warm.fork(3, ["worker"], _env(), tmp_path / "w3.log")  # no --driver: argparse's exit 2
    assert usage is not None and usage.wait(timeout=60) == 2
    assert "the driver's address is missing" in (tmp_path / "w3.log").read_text()
    with socket.socket() as silent:  # accepts, never answers the handshake: the worker blocks
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        stuck = warm.fork(1, ["worker", "--driver", address, "--worker-id", "1"], _env(), tmp_path / "w1.log")
        assert stuck is not None
        with pytest.raises(subprocess.TimeoutExpired):
            stuck.wait(timeout=1.0)
        stuck.kill()
        assert stuck.wait(timeout=10) == -signal.SIGKILL
        left = warm.fork(2, ["worker", "--driver", address, "--worker-id", "2"], _env(), tmp_path / "w2.log")
        assert left is not None
        deadline = time.monotonic() + 30
        while left.pid is None and time.monotonic() < deadline:
            time.sleep(0.05)
        warm.close()  # the warm process takes a worker still running along
        assert left.wait(timeout=10) == -signal.SIGKILL
        assert not psutil.pid_exists(left.pid) or psutil.Process(left.pid).status() == psutil.STATUS_ZOMBIE
    assert warm.fork(4, ["worker"], _env(), tmp_path / "w4.log") is None  # gone: the launcher starts a fresh one
