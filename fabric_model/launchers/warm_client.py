"""The caller's side of the warm process (:mod:`fabric_model.launchers.warm`).

:class:`WarmProcess` starts it (a fork of this process, or a fresh interpreter) and asks it to
fork workers; each fork is a :class:`ForkedWorker`,
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
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import IO, Any

from .base import module_command
from .warm import exit_code, from_fork

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


class ForkedCaller:
    """The warm process as a fork of this process, seen as the part of ``Popen`` :class:`WarmProcess` uses.

    The caller must be fit to fork (:func:`fabric_model.launchers.fork_safety.fork_blockers`).
    """

    def __init__(self, env: dict[str, str], framework: str, fresh_command: list[str], log: int) -> None:
        requests_r, requests_w = os.pipe()
        events_r, events_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # or the fork would print the caller's pending output again
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        with warnings.catch_warnings():
            # Python 3.12+ warns of any other thread: fork_safety has checked those there are.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            try:
                os.dup2(requests_r, 0)
                os.dup2(events_w, 1)
                os.dup2(log, 2)
                from_fork(env, framework, fresh_command)
            finally:
                os._exit(70)  # never back into the caller's code
        os.close(requests_r)
        os.close(events_w)
        self.pid = pid
        self.returncode: int | None = None
        self.stdin: IO[bytes] | None = os.fdopen(requests_w, "wb")
        self.stdout: IO[bytes] | None = os.fdopen(events_r, "rb")

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its status is lost (Popen says 0 too)
                done, status = self.pid, 0
            if done:
                self.returncode = exit_code(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"warm process {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return code

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


class WarmProcess:
    """One warm process for one ``train()`` at a time: started at once, it imports while the
    caller goes on; a fresh interpreter may be kept for the next (:mod:`.warm_spare`).

    Args:
        env: its environment (the workers' own, minus anything per worker, per job or secret).
        framework: the job's framework; ``"torch"`` preloads the torch adapter too.
        log_path: where its own output goes (import warnings, a crash); None: an unnamed file
            until :meth:`move_log` names one.
        fork: a fork of this process (which must be fit for it: :mod:`.fork_safety`), not a
            fresh interpreter.
        why_fresh: why it is not a fork (what :func:`~.fork_safety.fork_blockers` found, or
            the setting), for :attr:`how`.
    """

    def __init__(
        self,
        env: dict[str, str],
        framework: str,
        log_path: Path | None = None,
        fork: bool = False,
        why_fresh: str = "",
    ) -> None:
        self.env, self.framework, self.forked = dict(env), framework, fork
        #: How it started, for run.json's start-up record: a slow start names its cause.
        self.how = "a fork of the caller" if fork else f"a fresh interpreter ({why_fresh or 'not a fork'})"
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab") if log_path is not None else tempfile.TemporaryFile()
        command = module_command("fabric_model.launchers.warm", framework)
        try:
            self.process: subprocess.Popen[bytes] | ForkedCaller = (
                ForkedCaller(env, framework, command, log.fileno())
                if fork
                else subprocess.Popen(
                    command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=os.getcwd()
                )
            )
        finally:
            log.close()  # the process has its own
        self.changed = threading.Condition()
        self.alive = True
        self.ready = False  # it has imported what workers need (its "ready" event)
        self.closed = False
        self.parked = False  # kept between jobs (launchers/warm_spare.py)
        self.kept_before = False  # taken from there
        self._workers: dict[int, ForkedWorker] = {}
        self._write = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="fabric-model-warm", daemon=True)
        self._reader.start()

    def move_log(self, path: Path) -> None:
        """Its output so far, and from now on, into ``path`` (the run's ``logs/warm.log``)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with self.changed:
            self.parked = False
        self.request(op="log", path=str(path))

    def park(self, idle: float) -> bool:
        """Keep it for a next job, its job over: True if it is alive, a fresh interpreter and
        every worker it forked has exited (their exits reported); it ends by itself after
        ``idle`` seconds without a request. Its output goes nowhere until :meth:`move_log`."""
        with self.changed:
            if self.closed or self.forked or not self.alive:
                return False
            if any(worker.returncode is None for worker in self._workers.values()):
                return False
            self._workers.clear()
            self.parked = True
        if not self.request(op="park", idle=idle):
            with self.changed:
                self.parked = False
            return False
        return True

    def fork(
        self, worker_id: int, argv: list[str], env: dict[str, str], log_path: Path, linger: float = 0.0
    ) -> ForkedWorker | None:
        """Fork worker ``worker_id`` running ``fabric_model`` with ``argv``; None if the warm process is
        gone. ``linger``: how long the worker may outlive a vanished driver (launchers/warm.py)."""
        worker = ForkedWorker(self, worker_id)
        with self.changed:
            if not self.alive:
                return None
            self._workers[worker_id] = worker
        request = {
            "op": "start",
            "id": worker_id,
            "argv": argv,
            "env": env,
            "log": str(log_path),
            "cwd": os.getcwd(),
            "linger": linger,
        }
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
                if event["ev"] == "ready":
                    self.ready = True
                elif worker is not None and event["ev"] == "started":
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
            parked = self.parked
        if parked:  # it ended by itself, kept past its idle time: reaped here, not left a zombie
            try:
                self.process.wait(5.0)
            except subprocess.TimeoutExpired:
                pass

    def close(self, timeout: float = 5.0) -> None:
        """End the warm process (it SIGKILLs and reaps any worker left) and reap it."""
        if self.closed:
            return
        self.closed = True
        with self.changed:
            unused = not self.ready and not self._workers
        if unused:  # still importing (a fresh interpreter, a short job) and never asked for a worker
            self.process.kill()
        self.request(op="end")  # done with every worker: none is kept for a driver to come back
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

    def discard(self) -> None:
        """End it now, importing or not: for one no job has used (it has no workers)."""
        if not self.closed:
            self.process.kill()
        self.close()
