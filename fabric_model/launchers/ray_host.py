"""The Ray actor that hosts one worker process (docs/architecture.md, "Processes", "Ray").

A light, threaded actor: it imports neither torch nor the worker, and starts the ordinary
worker command line (``python -m fabric_model worker ...``) as a child process, so a worker on
Ray is the same program as a local one. The child runs with ``_FABRIC_MODEL_LAUNCHED`` set, so
it dies with this actor (``PR_SET_PDEATHSIG``, armed against the thread that started it: that
thread lives exactly as long as the child). Ray sets ``CUDA_VISIBLE_DEVICES`` in the actor to
the GPUs it was given; the child inherits it. The job's secret arrives as a task argument and
goes into the child's environment, never onto a command line.

The actor is threaded (``max_concurrency`` > 1) so that ``wait`` can block while
``read_log`` and ``kill_child`` still answer.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading

from ..settings.registry import SECRET
from .base import module_command

#: Most log bytes one ``read_log`` call returns.
LOG_CHUNK = 1 << 20


class WorkerHost:
    """Hosts one worker process on whichever node Ray placed this actor."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._code: int | None = None
        self._started = threading.Event()
        self._done = threading.Event()
        # The worker's output goes to a file that has no name: it lives as long as this actor
        # holds it, so no exit path (a killed actor, a lost node) leaves a log behind.
        self._log_fd, path = tempfile.mkstemp(prefix="fabric-model-worker-", suffix=".log")
        os.unlink(path)

    def start(self, args: list[str], secret_hex: str, env: dict[str, str]) -> dict[str, str]:
        """Start ``python -m fabric_model worker <args>``; returns where it runs (node IP, host
        name, this actor's pid)."""
        import ray

        child_env = dict(os.environ)
        child_env.update(env)
        child_env[SECRET.name] = secret_hex
        # The child imports what this actor can: the job's working_dir (this actor's working
        # directory, which module_command's -P leaves out) and py_modules come first.
        paths = [os.getcwd(), *(p for p in sys.path if p and os.path.isdir(p))]
        child_env["PYTHONPATH"] = os.pathsep.join([*paths, child_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        cmd = module_command("fabric_model", "worker", *args)
        threading.Thread(target=self._run, args=(cmd, child_env), name="fabric-worker", daemon=True).start()
        self._started.wait()
        where = {"ip": ray.util.get_node_ip_address(), "hostname": socket.gethostname(), "pid": str(os.getpid())}
        return {**where, "node": ray.get_runtime_context().get_node_id()}

    def _run(self, cmd: list[str], env: dict[str, str]) -> None:
        try:
            self._proc = subprocess.Popen(
                cmd, env=env, stdout=self._log_fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        except OSError as exc:
            os.write(self._log_fd, f"fabric-model: could not start the worker: {exc}\n".encode())
            self._code = 127
            self._started.set()
            self._done.set()
            return
        self._started.set()
        self._code = self._proc.wait()
        self._done.set()

    def wait(self) -> int:
        """Block until the worker process exits; its exit code (negative: the signal)."""
        self._done.wait()
        assert self._code is not None
        return self._code

    def read_log(self, offset: int) -> bytes:
        """The worker's output from byte ``offset`` on (at most :data:`LOG_CHUNK` bytes)."""
        if self._log_fd < 0:  # closed: the driver has copied it
            return b""
        try:
            return os.pread(self._log_fd, LOG_CHUNK, offset)  # moves no offset: the child writes on at its own
        except OSError:
            return b""

    def kill_child(self, sig: int = signal.SIGKILL) -> None:
        """Signal the worker process (SIGKILL by default: a frozen one ignores anything gentler)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(sig)

    def close(self) -> None:
        """Kill the worker if it still runs and free its log (the driver has copied it)."""
        self.kill_child()
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
        fd, self._log_fd = self._log_fd, -1
        if fd >= 0:
            os.close(fd)
