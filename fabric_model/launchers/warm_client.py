"""The caller's side of the warm process (:mod:`fabric_model.launchers.warm`).

:class:`WarmProcess` starts it and asks it to fork workers; each fork is a :class:`ForkedWorker`,
which answers the part of ``subprocess.Popen`` the local launcher uses (``poll``, ``wait``,
``kill``, ``terminate``, ``pid``), so exit codes and kill semantics are those of a worker the
launcher started itself. If the warm process is gone, :meth:`WarmProcess.fork` returns None and
the launcher starts a fresh interpreter instead.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any

from .base import module_command

log = logging.getLogger(__name__)


class ForkedWorker:
    """A worker forked by the warm process, seen as a ``Popen``."""

    def __init__(self, warm: WarmProcess, worker_id: int) -> None:
        self.warm, self.worker_id = warm, worker_id
        self.pid: int | None = None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; ``subprocess.TimeoutExpired`` if the worker still runs after ``timeout``."""
        with self.warm.changed:
            if not self.warm.changed.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(f"worker {self.worker_id}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self.warm.request(op="signal", id=self.worker_id, sig=int(sig))

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class WarmProcess:
    """One warm process for one ``train()``: started at once, it imports while the caller goes on.

    Args:
        env: its environment (the workers' own, minus anything per worker or secret).
        log_path: where its own output goes (import warnings, a crash).
        framework: the job's framework; ``"torch"`` preloads the torch adapter too.
    """

    def __init__(self, env: dict[str, str], log_path: Path, framework: str) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] = open(log_path, "ab")
        self.process = subprocess.Popen(
            module_command("fabric_model.launchers.warm", framework),
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=os.getcwd(),
        )
        self.changed = threading.Condition()
        self.alive = True
        self._workers: dict[int, ForkedWorker] = {}
        self._write = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="fabric-model-warm", daemon=True)
        self._reader.start()

    def fork(self, worker_id: int, argv: list[str], env: dict[str, str], log_path: Path) -> ForkedWorker | None:
        """Fork worker ``worker_id`` running ``fabric_model`` with ``argv``; None if the warm process is gone."""
        worker = ForkedWorker(self, worker_id)
        with self.changed:
            if not self.alive:
                return None
            self._workers[worker_id] = worker
        request = {"op": "start", "id": worker_id, "argv": argv, "env": env, "log": str(log_path), "cwd": os.getcwd()}
        if not self.request(**request):
            with self.changed:
                self._workers.pop(worker_id, None)
            return None
        return worker

    def request(self, **message: Any) -> bool:
        """Send one request; False if the warm process is gone."""
        assert self.process.stdin is not None
        try:
            with self._write:
                self.process.stdin.write((json.dumps(message) + "\n").encode())
                self.process.stdin.flush()
            return True
        except (OSError, ValueError):
            return False

    def _read(self) -> None:
        """Events from the warm process; at its end, every worker not reported is gone with it."""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                log.warning("the warm process said %r", line[:200])
                continue
            with self.changed:
                worker = self._workers.get(event.get("id", -1))
                if worker is not None and event["ev"] == "started":
                    worker.pid = event["pid"]
                elif worker is not None and event["ev"] == "exited":
                    worker.returncode = event["code"]
                self.changed.notify_all()
        with self.changed:
            self.alive = False
            for worker in self._workers.values():
                if worker.returncode is None:  # its PR_SET_PDEATHSIG fired with the warm process
                    worker.returncode = -signal.SIGKILL
            self.changed.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        """End the warm process (it SIGKILLs and reaps any worker left) and reap it."""
        try:
            assert self.process.stdin is not None
            with self._write:
                self.process.stdin.close()
        except OSError:
            pass
        deadline = time.monotonic() + timeout
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.error("the warm process (pid %d) did not end: killing it", self.process.pid)
            self.process.kill()
            self.process.wait()
        self._reader.join(max(0.1, deadline - time.monotonic()))
        self._log.close()
