"""The warm process: an interpreter that has imported torch (and TensorFlow) once and forks local workers.

A fresh worker interpreter spends seconds importing torch (and ``torch._dynamo``, which the
optimizer pulls in) after the caller has already paid the same. So each job has this process,
started when ``FabricModel`` is built, and each local worker is a ``fork`` of it that then runs
the ordinary worker command line. It is a fork of the caller itself, taken while the caller
has no thread pool, CUDA context or TensorFlow (:mod:`.fork_safety`; it starts with torch
imported: :func:`from_fork`), or else a fresh interpreter (``python -m
fabric_model.launchers.warm``: :func:`main`; always with ``FABRIC_MODEL_WARM_START=fresh``).
Either way it never runs a torch or TensorFlow operation and creates no CUDA context and no thread
pool. A Keras job's imports TensorFlow too (TensorFlow's runtime starts with its first operation:
imported, it forks as torch does), so that no Keras worker spends ~10 s importing it. Where the
imports left a thread a fork breaks (:func:`.fork_safety.blockers_after_imports`), and for the
workers of a Keras job whose TensorFlow notices are asked for (``train(verbose=2)``: they are
written while TensorFlow loads), a worker is a fresh interpreter started from it instead
(:func:`become_worker`, ``fresh``); see docs/architecture.md, "Start-up".

Protocol (JSON lines; the caller's side is :mod:`fabric_model.launchers.warm_client`):

- on stdin: ``{"op": "start", "id", "argv", "env", "log", "cwd", "linger"}`` forks worker ``id``;
  ``{"op": "signal", "id", "sig"}`` signals it; ``{"op": "log", "path"}`` appends what this
  process has written so far to ``path`` and writes there from now on; ``{"op": "park", "idle"}``
  (its job over, its workers reaped): its output goes nowhere until the next ``log``, and it
  exits when ``idle`` seconds pass without another request; ``{"op": "end"}``, then end of input:
  every worker is SIGKILLed and reaped, then the process exits.
- on stdout: ``{"ev": "ready"}`` once imported, ``{"ev": "started", "id", "pid"}``,
  ``{"ev": "exited", "id", "code"}`` (a ``Popen.returncode``: ``-N`` for signal ``N``).

Each worker dies with it (``PR_SET_PDEATHSIG``). When the caller ends its input with ``end``,
it kills them all and exits. When the caller vanishes instead (its input ends without ``end``,
or ``PR_SET_PDEATHSIG`` sends SIGHUP: a driver SIGKILLed), it keeps its workers, which wait
for a driver to come back (worker/reattach.py), reaps those that exit, and kills those still
running after ``linger`` seconds (the job's ``FABRIC_MODEL_DRIVER_WAIT`` and a margin): no
process outlives the caller by more than that.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import io
import json
import logging
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from ..settings.registry import PREEMPT_SIGNALS, TF_NOTICES
from .base import module_command
from .fork_safety import blockers_after_imports
from .native import die_with_parent

#: What every worker imports before its first step; each framework adds its own. A Keras job's
#: warm process imports TensorFlow and runs no operation of it, so its runtime has not started
#: and its workers fork as torch's do (:func:`.fork_safety.blockers_after_imports`). Which Keras
#: ``tf.keras`` is (``TF_USE_LEGACY_KERAS``) is read at import, from the warm process's environment,
#: which a job it is kept for must match (launchers/warm_spare.py, ``fits``).
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "numpy", "cloudpickle", "fabric_model.worker.main")
_KERAS_WORKER = ("tensorflow", "fabric_model.frameworks.keras.adapter", "fabric_model.frameworks.keras.runtime")
KERAS_FRAMEWORKS = ("keras", "tf_keras")
PRELOAD_BY_FRAMEWORK = {
    "torch": ("fabric_model.frameworks.torch.adapter",),
    "keras": ("keras", *_KERAS_WORKER),
    "tf_keras": ("tf_keras", *_KERAS_WORKER, "fabric_model.frameworks.keras.keras2"),
}


def exit_code(status: int) -> int:
    """A ``waitpid`` status as ``Popen.returncode`` gives it."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


class _Caller:
    """Whether the caller died (``PR_SET_PDEATHSIG``'s SIGHUP came)."""

    gone = False


def _caller_gone(signum: int, frame: Any) -> None:
    """SIGHUP: only noted (the wakeup fd wakes the server's ``select``). An exception raised here
    could land anywhere: between the end of input and keeping the workers, it killed them."""
    _Caller.gone = True


#: Seconds the warm process keeps its workers beyond their own wait for a vanished driver.
LINGER_MARGIN = 10.0


class Server:
    """Reads requests, forks and signals workers, reports their exits."""

    def __init__(self, out: int, framework: str = "torch", blockers: tuple[str, ...] = ()) -> None:
        self.out = out  # the events' pipe (fd 1 itself carries stray output to the log)
        self.framework = framework
        self.blockers = blockers  # why its workers must not be its forks (fork_safety.blockers_after_imports)
        self.children: dict[int, int] = {}  # worker id -> pid, until reaped
        self.linger = 0.0  # how long workers may outlive a vanished caller (the start requests say)
        self.ended = False  # the caller said "end": it is done with every worker
        self.idle: float | None = None  # parked: seconds it waits for a next job before it ends
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
        """Until stdin ends or the caller dies: handle requests and reap children as they exit."""
        while not _Caller.gone:
            parked = self.idle is not None and not self.children
            readable, _, _ = select.select([0, self._wake_r], [], [], self.idle if parked else None)
            if parked and not readable:
                return  # kept for a next job that did not come
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
        if request["op"] != "park":
            self.idle = None  # taken by a job: it waits for its requests as long as they take
        if request["op"] == "start":
            self.linger = max(self.linger, float(request.get("linger", 0.0)))
            fresh = bool(self.blockers) or (
                self.framework in KERAS_FRAMEWORKS and request["env"].get(TF_NOTICES.name) == "1"
            )
            pid = os.fork()
            if pid == 0:
                code = 70
                try:
                    become_worker(request, (0, self.out, self._wake_r, self._wake_w), fresh)
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
        elif request["op"] == "log":
            move_log(request["path"])
        elif request["op"] == "end":
            self.ended = True
        elif request["op"] == "park":
            # Kept for the caller's next job (launchers/warm_spare.py): its workers are gone, so
            # nothing is kept for a vanished caller, and its output leaves the finished run's log.
            self.idle, self.linger = float(request["idle"]), 0.0
            move_log(os.devnull, copy=False)

    def outlive_caller(self) -> None:
        """The caller vanished: keep the workers, which wait for a driver to come back, reaping
        those that exit, for ``linger`` seconds at most; SIGHUP (the caller's death) no longer
        concerns this process."""
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        deadline = time.monotonic() + self.linger + LINGER_MARGIN
        while self.children and time.monotonic() < deadline:
            for worker_id, pid in list(self.children.items()):
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done:
                    del self.children[worker_id]
            time.sleep(0.1)

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


def become_worker(request: dict[str, Any], server_fds: tuple[int, ...], fresh: bool = False) -> None:
    """In the forked child: the launcher's environment, log file and signals, then the worker's
    ``main``; or, if ``fresh``, a fresh worker interpreter in their place (``exec``)."""
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
    if fresh:
        os.execve(sys.executable, module_command("fabric_model", *request["argv"]), request["env"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy" in sys.modules:  # each worker draws its own entropy, as a fresh interpreter would
        sys.modules["numpy"].random.seed()
    sys.argv = ["fabric_model", *request["argv"]]
    from fabric_model.__main__ import main

    os._exit(main(request["argv"]))


def move_log(path: str, copy: bool = True) -> None:
    """Append what this process has written so far (its output is an unnamed file until the job
    has a run directory) to ``path`` (unless not ``copy``), and write there from now on."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    offset = 0
    try:
        while copy and (chunk := os.pread(2, 1 << 16, offset)):
            offset += len(chunk)
            while chunk:
                chunk = chunk[os.write(fd, chunk) :]
    except OSError:
        pass  # not a file (a terminal, a pipe): nothing to copy
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def serve(framework: str, before_ready: Callable[[int], None] = lambda out: None) -> int:
    """Import what workers need, say ready, serve requests until stdin ends; ``before_ready``
    gets the events' descriptor first."""
    signal.signal(signal.SIGHUP, _caller_gone)
    die_with_parent(signal.SIGHUP)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the caller decides
    # So may a preemption signal (Slurm signals every process of a job): dying of it here would
    # kill every worker (they die with this process) before the driver saves their state; each
    # worker installs its own notice (docs/architecture.md, "Preemption").
    for name in PREEMPT_SIGNALS.get():
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    out = os.dup(1)  # events only; whatever an import prints goes to the log, not into the protocol
    os.dup2(2, 1)
    imports = PRELOAD + PRELOAD_BY_FRAMEWORK.get(framework, ())
    if framework in KERAS_FRAMEWORKS:
        from ..frameworks.keras.quiet import quiet_tensorflow

        with quiet_tensorflow():  # as a Keras worker imports it: its start-up notices dropped
            for name in imports:
                importlib.import_module(name)
    else:
        for name in imports:
            importlib.import_module(name)
    blockers = tuple(blockers_after_imports())
    if blockers:
        print(f"[fabric-model] workers start as fresh interpreters: {'; '.join(blockers)}", flush=True)
    before_ready(out)
    server = Server(out, framework, blockers)
    server.send(ev="ready")
    try:
        server.serve()
    finally:
        try:
            if not server.ended and server.linger > 0:
                server.outlive_caller()
        finally:
            server.kill_all()
    return 0


def main() -> int:
    """A fresh interpreter's warm process (``python -m fabric_model.launchers.warm <framework>``)."""
    return serve(sys.argv[1] if len(sys.argv) > 1 else "torch")


#: The caller's objects this fork replaced: kept, so that no finalizer of theirs runs here (it
#: would close a descriptor of the caller's, or one reused since).
_INHERITED: list[Any] = []

#: How long the OpenMP probe may take once the imports are done; it takes milliseconds.
PROBE_TIMEOUT = 5.0


def from_fork(env: dict[str, str], framework: str, fresh_command: list[str]) -> NoReturn:
    """The warm process in a fork of the caller whose descriptors 0, 1 and 2 are already the
    requests, the events and the log: what the caller set up is reset to what a fresh
    interpreter has, then it serves as :func:`main` does. Should OpenMP hang in this fork (the
    caller's threads checked out, but a runtime kept state for threads a fork does not have), it
    becomes a fresh warm process in place: ``fresh_command`` by exec, with ``env``."""
    code = 70
    try:
        reset_inherited(env)
        probe = start_openmp_probe()

        def check_openmp(out: int) -> None:
            if not probe_passed(probe, PROBE_TIMEOUT):
                print("warm process: OpenMP hangs in a fork of the caller; starting afresh", file=sys.stderr)
                os.dup2(out, 1)
                os.execve(fresh_command[0], fresh_command, env)

        code = serve(framework, check_openmp)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def reset_inherited(env: dict[str, str]) -> None:
    """What a fork of the caller inherited beyond its modules, set as a fresh interpreter has it:
    signal handlers, tracing, descriptors (those exec would close), standard streams, the
    package's loggers, the environment and torch's grad mode."""
    gc.freeze()  # the caller's objects stay as they are: never collected, never finalized here
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        try:
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    sys.settrace(None)
    sys.setprofile(None)
    threading.settrace(None)
    threading.setprofile(None)
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            if fd > 2 and not os.get_inheritable(fd):
                os.close(fd)
        except OSError:
            pass  # the listing's own descriptor, closed by now
    # The caller's may be a test's capture or a notebook's; sys.__stderr__ & co. write to 0, 1 and 2.
    _INHERITED.extend([sys.stdin, sys.stdout, sys.stderr])
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    if faulthandler.is_enabled():
        faulthandler.enable(sys.stderr)
    _reset_logging()
    os.environ.clear()
    os.environ.update(env)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_grad_enabled(True)
    sys.argv = [__file__]


def _reset_logging() -> None:
    """No handler of the caller's, and the package's loggers as they are before any set-up."""
    root = logging.getLogger()
    _INHERITED.append(root.handlers[:])
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    logging.disable(logging.NOTSET)
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and (name == "fabric_model" or name.startswith("fabric_model.")):
            _INHERITED.append(logger.handlers[:])
            logger.handlers.clear()
            logger.setLevel(logging.NOTSET)
            logger.propagate, logger.disabled = True, False


def start_openmp_probe() -> int:
    """A child that runs one parallel torch operation: it hangs where OpenMP kept threads this
    fork does not have."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            die_with_parent()
            os.dup2(2, 1)  # not the events' pipe
            import torch

            torch.set_num_threads(2)
            torch.ones(1 << 20).add_(1)  # far above ATen's grain size: a parallel region
            code = 0
        finally:
            os._exit(code)
    return pid


def probe_passed(pid: int, timeout: float) -> bool:
    """Whether the probe ``pid`` ended well within ``timeout`` seconds; killed and reaped if not."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return False
        time.sleep(0.002)


if __name__ == "__main__":
    sys.exit(main())
