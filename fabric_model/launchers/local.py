"""Local worker processes: the default launcher.

Workers run ``python -m fabric_model worker``: forks of the job's warm process
(:mod:`fabric_model.launchers.warm`, which has imported torch: a fork of the caller taken
before it had thread pools, CUDA or TensorFlow, or a fresh interpreter), else fresh
interpreters. Unlike
``multiprocessing``'s spawn, this does not re-import the user's main script in the child, so a
script without an
``if __name__ == "__main__":`` guard, or a notebook, works unchanged.

Workers choose their devices independently of the driver's ``CUDA_VISIBLE_DEVICES``: when the
script changed it after the process started (TensorFlow scripts set ``""`` to keep the driver off
the GPU), workers get the value the process started with, or none; a value set before the process
started (a cluster's allocation) is passed on (see :mod:`fabric_model.setup.devices`).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from ..settings.registry import CUDA_VISIBLE, JOIN_FILE, LAUNCHED, SECRET, WARM_START
from ..setup.devices import cuda_visible_for_workers
from . import warm_spare
from .base import Launcher, module_command
from .cluster import check_cluster
from .fork_safety import fork_blockers
from .warm_client import ForkedWorker, WarmProcess

log = logging.getLogger(__name__)


class LocalLauncher(Launcher):
    """Worker processes on this host, one per device slot; ``stop_all`` leaves none running.

    Args:
        address: the driver's control-plane address, passed on each worker's command line.
        secret: the job's secret, passed in each worker's environment.
        log_path: where worker ``worker_id`` writes its stdout and stderr.
        threads: intra-op threads per CPU worker (``OMP_NUM_THREADS``).
        warm: the job's warm process, which forks the workers; without one (or once it is
            gone), each worker is a fresh interpreter.
        linger: how long its forked workers may outlive a driver that vanished, waiting for it
            to come back (``FABRIC_MODEL_DRIVER_WAIT``; launchers/warm.py). A fresh
            interpreter dies with the driver.
        join_file: the run's ``join.json``, which a worker that waited in vain removes.
    """

    def __init__(
        self,
        address: tuple[str, int],
        secret: bytes,
        log_path: Callable[[int], Path],
        threads: int,
        warm: WarmProcess | None = None,
        linger: float = 0.0,
        join_file: Path | None = None,
    ) -> None:
        self.linger, self.join_file = linger, join_file
        self.address = address
        self.secret = secret
        self.log_path = log_path
        self.threads = threads
        self.warm = warm
        self.processes: dict[int, subprocess.Popen[bytes] | ForkedWorker] = {}
        self._logs: dict[int, IO[bytes]] = {}

    def _environment(self) -> dict[str, str]:
        env = worker_environment(self.threads, self.address[0])
        env[SECRET.name] = self.secret.hex()
        env[LAUNCHED.name] = "1"
        if self.join_file is not None:
            env[JOIN_FILE.name] = str(self.join_file)
        return env

    def start(self, worker_id: int, device: str | None) -> None:
        path = self.log_path(worker_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        argv = ["worker", "--driver", f"{self.address[0]}:{self.address[1]}", "--worker-id", str(worker_id)]
        if device:
            argv += ["--device", device]
        proc: subprocess.Popen[bytes] | ForkedWorker | None = None
        if self.warm is not None:
            proc = self.warm.fork(worker_id, argv, self._environment(), path, self.linger)
        if proc is None:
            logfile = open(path, "ab")
            proc = subprocess.Popen(
                module_command("fabric_model", *argv),
                env=self._environment(),
                stdout=logfile,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=os.getcwd(),
            )
            self._logs[worker_id] = logfile
        self.processes[worker_id] = proc
        log.debug("started worker %d (%s)", worker_id, "forked" if isinstance(proc, ForkedWorker) else "fresh")

    def exited(self) -> dict[int, int]:
        """Worker ids whose process has ended, with their exit codes."""
        return {wid: code for wid, p in self.processes.items() if (code := p.poll()) is not None}

    def kill(self, worker_id: int) -> None:
        """SIGKILL one worker (a frozen process ignores anything gentler) and reap it."""
        proc = self.processes.get(worker_id)
        if proc is None or proc.poll() is not None:
            return
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            log.error("worker %d (pid %d) did not die after SIGKILL", worker_id, proc.pid)

    def wait_all(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every worker to exit by itself."""
        deadline = time.monotonic() + timeout
        for proc in self.processes.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def stop_all(self, timeout: float = 5.0) -> None:
        """Kill every worker still running and reap them all (up to ``timeout`` s each, then again).

        SIGKILL, not SIGTERM: SIGTERM is a worker's notice to leave after its step
        (worker/notice.py), and what is stopped here has nothing left to do."""
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.kill()
        deadline = time.monotonic() + timeout
        for proc in self.processes.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for f in self._logs.values():
            f.close()
        self._logs.clear()

    def log_tail(self, worker_id: int, lines: int = 30) -> str:
        """The end of the worker's log file."""
        try:
            text = self.log_path(worker_id).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def warm_environment() -> dict[str, str]:
    """The environment of the job's warm process: a local worker's, but for what is per job
    (threads, interface) or secret."""
    env = dict(os.environ)
    changed, cuda_visible = cuda_visible_for_workers()
    if changed:  # the script's own choice for the driver, not the job's allocation
        env.pop(CUDA_VISIBLE.name, None)
        if cuda_visible is not None:
            env[CUDA_VISIBLE.name] = cuda_visible
    env.pop(SECRET.name, None)
    # The worker must import what the caller could import (modules next to the script; "" is
    # the working directory of an interactive caller, which the worker's -P leaves out).
    paths = [os.path.abspath(p or os.curdir) for p in sys.path if os.path.isdir(p or os.curdir)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def worker_environment(threads: int, host: str) -> dict[str, str]:
    """A local worker's environment, but for the job's secret."""
    env = warm_environment()
    env.setdefault("OMP_NUM_THREADS", str(threads))  # torch's threads are set by the worker too
    if host.startswith("127.") or host == "localhost":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo on loopback with the driver
    return env


def warm_start_mode() -> str:
    """``$FABRIC_MODEL_WARM_START``, checked: one of :data:`~fabric_model.settings.registry.WARM_STARTS`."""
    return WARM_START.get()


def start_warm_process(framework: str, log_path: Path | None = None) -> WarmProcess | None:
    """A warm process for a job of ``framework``, importing from now on (its output in
    ``log_path``, else an unnamed file until the job names one); None where workers start fresh
    instead (``FABRIC_MODEL_WARM_START=0``, or not Linux)."""
    mode = warm_start_mode()
    if mode == "0" or not sys.platform.startswith("linux"):
        return None
    kept = warm_spare.take(framework, warm_environment())
    if kept is not None:  # a fresh interpreter an earlier job of this caller left ready (warm_spare.py)
        kept.how = "kept from an earlier job (a fresh interpreter: no import to wait for)"
        if log_path is not None:
            kept.move_log(log_path)
        return kept
    if mode == "fork-always":
        blockers: list[str] = []
    else:
        blockers = ["FABRIC_MODEL_WARM_START=fresh"] if mode == "fresh" else fork_blockers()
    log.debug("warm process: %s", "; ".join(blockers) or "a fork of the caller")
    try:
        return WarmProcess(warm_environment(), framework, log_path, fork=not blockers, why_fresh="; ".join(blockers))
    except OSError as exc:  # the workers start as fresh interpreters, as they would without it
        log.warning("could not start the warm process (%s): workers start as fresh interpreters", exc)
        return None


def prestart_warm_process(framework: str) -> WarmProcess | None:
    """The warm process of a job yet to be trained (``FabricModel`` is being built): None where
    the job's workers will not be local (``$FABRIC_MODEL_CLUSTER``) or start fresh."""
    try:
        if check_cluster(None) != "local":
            return None
    except (ValueError, ImportError):
        return None  # train() says what is wrong with it
    return start_warm_process(framework)


def local_launcher_factory(
    log_path: Callable[[int], Path],
    threads: int,
    warm: WarmProcess | None,
    linger: float = 0.0,
    join_file: Path | None = None,
) -> Callable[[tuple[str, int], bytes], LocalLauncher]:
    """The driver's launcher factory (address, secret -> launcher) for local workers."""
    return lambda address, secret: LocalLauncher(address, secret, log_path, threads, warm, linger, join_file)
