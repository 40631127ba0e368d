"""The warm process: a clean interpreter that has imported torch once and forks local workers.

A fresh worker interpreter spends seconds importing torch (and ``torch._dynamo``, which the
optimizer pulls in) after the caller has already paid the same. The local launcher therefore
starts this process once per ``train()`` (``python -m fabric_model.launchers.warm``, a fresh
interpreter: the caller, which may hold a CUDA context or thread pools, is never forked), and
each worker is a ``fork`` of it that then runs the ordinary worker command line. The warm
process itself never runs a torch operation, creates no CUDA context and no thread pool, and
imports no TensorFlow; see docs/architecture.md, "Processes".

Protocol (JSON lines; the caller's side is :mod:`fabric_model.launchers.warm_client`):

- on stdin: ``{"op": "start", "id", "argv", "env", "log", "cwd"}`` forks worker ``id``;
  ``{"op": "signal", "id", "sig"}`` signals it; end of input: every worker is SIGKILLed and
  reaped, then the process exits.
- on stdout: ``{"ev": "ready"}`` once imported, ``{"ev": "started", "id", "pid"}``,
  ``{"ev": "exited", "id", "code"}`` (a ``Popen.returncode``: ``-N`` for signal ``N``).

It dies with the caller (``PR_SET_PDEATHSIG`` and the end of its stdin), and each worker dies
with it (``PR_SET_PDEATHSIG`` again), so no process outlives the caller on any path.
"""

from __future__ import annotations

import ctypes
import importlib
import io
import json
import os
import select
import signal
import sys
import traceback
from typing import Any

#: What every worker imports before its first step; ``torch`` jobs add their adapter.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "numpy", "cloudpickle", "fabric_model.worker.main")
PRELOAD_BY_FRAMEWORK = {"torch": ("fabric_model.frameworks.torch_adapter",)}


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux); exit at once if it already has."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    if os.getppid() != parent or parent == 1:
        os._exit(1)


def exit_code(status: int) -> int:
    """A ``waitpid`` status as ``Popen.returncode`` gives it."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


class Server:
    """Reads requests, forks and signals workers, reports their exits."""

    def __init__(self, out: int) -> None:
        self.out = out  # the events' pipe (fd 1 itself carries stray output to the log)
        self.children: dict[int, int] = {}  # worker id -> pid, until reaped
        self._pending = b""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
        signal.set_wakeup_fd(self._wake_w)

    def send(self, **event: Any) -> None:
        data = (json.dumps(event) + "\n").encode()
        while data:
            data = data[os.write(self.out, data) :]

    def serve(self) -> None:
        """Until stdin ends: handle requests and reap children as they exit."""
        while True:
            readable, _, _ = select.select([0, self._wake_r], [], [])
            if self._wake_r in readable:
                os.read(self._wake_r, 4096)
            self.reap()
            if 0 in readable:
                chunk = os.read(0, 1 << 16)
                if not chunk:
                    return
                self._pending += chunk
                *lines, self._pending = self._pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        self.handle(json.loads(line))

    def handle(self, request: dict[str, Any]) -> None:
        if request["op"] == "start":
            pid = os.fork()
            if pid == 0:
                code = 70
                try:
                    become_worker(request, (0, self.out, self._wake_r, self._wake_w))
                except SystemExit as exc:  # a usage error exits as it would in a fresh interpreter
                    code = exc.code if isinstance(exc.code, int) else 1
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(code)  # never back into the server's loop
            self.children[request["id"]] = pid
            self.send(ev="started", id=request["id"], pid=pid)
        elif request["op"] == "signal":
            target = self.children.get(request["id"])
            if target is not None:  # not reaped yet, so the pid is still this worker's
                os.kill(target, request["sig"])

    def reap(self) -> None:
        for worker_id, pid in list(self.children.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del self.children[worker_id]
                self.send(ev="exited", id=worker_id, code=exit_code(status))

    def kill_all(self) -> None:
        """The caller is done (or gone): no worker outlives this process."""
        for worker_id, pid in list(self.children.items()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, status = os.waitpid(pid, 0)
            del self.children[worker_id]
            try:
                self.send(ev="exited", id=worker_id, code=exit_code(status))
            except OSError:
                pass  # the caller closed its end


def become_worker(request: dict[str, Any], server_fds: tuple[int, ...]) -> None:
    """In the forked child: the launcher's environment, log file and signals, then the worker's ``main``."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter; a launched worker ignores it
    die_with_parent()
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for fd in {log, null, *server_fds} - {0, 1, 2}:
        os.close(fd)
    # As with PYTHONUNBUFFERED in a fresh worker: every line reaches the log at once.
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy" in sys.modules:  # each worker draws its own entropy, as a fresh interpreter would
        sys.modules["numpy"].random.seed()
    sys.argv = ["fabric_model", *request["argv"]]
    from fabric_model.__main__ import main

    os._exit(main(request["argv"]))


def main() -> int:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the caller decides
    out = os.dup(1)  # events only; whatever an import prints goes to the log, not into the protocol
    os.dup2(2, 1)
    framework = sys.argv[1] if len(sys.argv) > 1 else "torch"
    for name in PRELOAD + PRELOAD_BY_FRAMEWORK.get(framework, ()):
        importlib.import_module(name)
    server = Server(out)
    server.send(ev="ready")
    try:
        server.serve()
    finally:
        server.kill_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
