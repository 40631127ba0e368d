"""Starting and stopping local worker processes.

Workers are fresh interpreters running ``python -m fabric_model worker`` (never a fork:
CUDA and TensorFlow break under it). Unlike ``multiprocessing``'s spawn, this does not
re-import the user's main script in the child, so a script without an
``if __name__ == "__main__":`` guard, or a notebook, works unchanged.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from ..protocol import LAUNCHED_ENV, SECRET_ENV

log = logging.getLogger(__name__)


class LocalLauncher:
    """Owns the worker processes this driver started; ``stop_all`` leaves none running."""

    def __init__(self, address: tuple[str, int], secret: bytes, log_dir: Path, threads: int) -> None:
        self.address = address
        self.secret = secret
        self.log_dir = log_dir
        self.threads = threads
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self._logs: dict[int, IO[bytes]] = {}

    def log_path(self, worker_id: int) -> Path:
        return self.log_dir / f"worker-{worker_id}.log"

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env[SECRET_ENV] = self.secret.hex()
        env[LAUNCHED_ENV] = "1"
        # The worker must import what the caller could import (modules next to the script).
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.setdefault("OMP_NUM_THREADS", str(self.threads))
        if self.address[0].startswith("127.") or self.address[0] == "localhost":
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo on loopback with the driver
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start(self, worker_id: int, device: str | None) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        logfile = open(self.log_path(worker_id), "ab")
        cmd = [
            sys.executable,
            "-m",
            "fabric_model",
            "worker",
            "--driver",
            f"{self.address[0]}:{self.address[1]}",
            "--worker-id",
            str(worker_id),
        ]
        if device:
            cmd += ["--device", device]
        proc = subprocess.Popen(
            cmd,
            env=self._environment(),
            stdout=logfile,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=os.getcwd(),
        )
        self.processes[worker_id] = proc
        self._logs[worker_id] = logfile
        log.debug("started worker %d (pid %d)", worker_id, proc.pid)
        return proc

    def exited(self) -> dict[int, int]:
        """Worker ids whose process has ended, with their exit codes."""
        return {wid: code for wid, p in self.processes.items() if (code := p.poll()) is not None}

    def kill(self, worker_id: int) -> None:
        """SIGKILL one worker (a frozen process ignores anything gentler) and reap it."""
        proc = self.processes[worker_id]
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
        """Terminate every worker, kill those still alive after ``timeout``, reap them all."""
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.terminate()
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
        try:
            text = self.log_path(worker_id).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])
