"""Workers started by hand while a job runs, as a user would on another host (see
:mod:`fabric_model.testing`)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..launchers.base import module_command
from ..run.hooks import Hooks
from ..run.rundir import RunDirectory
from ..settings.registry import SECRET


class WorkerStarter:
    """A driver logger that starts one extra worker by hand when ``iteration`` reaches each of
    ``at_iterations`` (and ``at_start`` of them as training begins, before any step: a driver with
    ``FABRIC_MODEL_LOCAL_WORKERS=0`` waits for them), with the command line a user would run on
    another host. ``env``: variables its workers get on top of this process's (``CUDA_VISIBLE_DEVICES``
    empty: a host without a GPU)."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        at_iterations: Sequence[int],
        inner: Any = None,
        at_start: int = 0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.env = dict(env or {})
        self.at_start = at_start
        self.at_iterations = sorted(at_iterations)
        self.inner = inner
        self.processes: list[subprocess.Popen[bytes]] = []

    @functools.cached_property
    def _inner(self) -> Hooks:
        return Hooks.for_driver(self.inner)  # the user's logger, of either signature

    def on_train_begin(self) -> None:
        for _ in range(self.at_start):
            self.start()
        self._inner.on_train_begin()

    def on_train_end(self) -> None:
        self._inner.on_train_end()

    def log_test_metrics(self, metrics: dict[str, float], iteration: int, epoch: int) -> None:
        self._inner.log_test_metrics(metrics, iteration, epoch)

    def log_train_metrics(self, metrics: dict[str, float], iteration: int, epoch: int, workers: int) -> None:
        while self.at_iterations and iteration >= self.at_iterations[0]:
            self.at_iterations.pop(0)
            self.start()
        self._inner.log_train_metrics(metrics, iteration, epoch, workers)

    def start(self, device: str | None = None) -> subprocess.Popen[bytes]:
        run = RunDirectory(self.run_dir)
        info = json.loads(run.join_json.read_text())
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **self.env)
        env[SECRET.name] = info["secret"]
        cmd = module_command("fabric_model", "worker", "--driver", info["driver"])
        if device:
            cmd += ["--device", device]
        log = open(run.joined_log(len(self.processes)), "ab")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        self.processes.append(proc)
        return proc

    def close(self, timeout: float = 15.0) -> None:
        """Wait for the started workers to exit (they do when the job ends); kill stragglers."""
        deadline = time.monotonic() + timeout
        for proc in self.processes:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
