"""The warm process: an interpreter that has imported torch once and forks local workers.

A fresh worker interpreter spends seconds importing torch (and ``torch._dynamo``, which the
optimizer pulls in) after the caller has already paid the same. So each job has this process,
started when ``FabricModel`` is built, and each local worker is a ``fork`` of it that then runs
the ordinary worker command line. It is a fork of the caller itself, taken while the caller
has no thread pool, CUDA context or TensorFlow (:mod:`.fork_safety`; it starts with torch
imported: :func:`from_fork`), or else a fresh interpreter (``python -m
fabric_model.launchers.warm``: :func:`main`; always with ``FABRIC_MODEL_WARM_START=fresh``).
Either way it never runs a torch operation, creates no CUDA context and no thread pool, and imports
no TensorFlow; see docs/architecture.md, "Start-up".

Protocol (JSON lines; the caller's side is :mod:`fabric_model.launchers.warm_client`):

- on stdin: ``{"op": "start", "id", "argv", "env", "log", "cwd", "linger"}`` starts worker ``id``
  (a spare, or a new fork); ``{"op": "signal", "id", "sig"}`` signals it; ``{"op": "log",
  "path"}`` appends what this process has written so far to ``path`` and writes there from now
  on; ``{"op": "spares", "n"}`` keeps ``n`` spares (Keras only, below); ``{"op": "park", "idle",
  "spares"}`` (its job over, its workers reaped): its output goes nowhere until the next ``log``,
  it keeps ``spares`` spares, and it exits when ``idle`` seconds pass without another request;
  ``{"op": "end"}``, then end of input: every worker and spare is SIGKILLed and reaped, then the
  process exits.
- on stdout: ``{"ev": "ready"}`` once imported, ``{"ev": "started", "id", "pid", "spare"}``
  (``spare``: ``"ready"`` or ``"importing"`` when a spare became the worker, else absent),
  ``{"ev": "exited", "id", "code"}`` (a ``Popen.returncode``: ``-N`` for signal ``N``),
  ``{"ev": "spares", "pids"}`` when its idle spares change, ``{"ev": "parked"}`` after ``park``.

*Spares* (Keras jobs): TensorFlow cannot be forked once loaded, so a Keras worker imports it
after its fork (~10 s). A spare is a child forked ahead of time that imports what a Keras worker
imports before its first step (:data:`SPARE_IMPORTS`; no TensorFlow operation, no thread pool),
then blocks reading its start request from a pipe of its own and becomes that worker exactly as a
fork does (:func:`become_worker`). It never ran a job; a worker is never reused.

Each worker dies with it (``PR_SET_PDEATHSIG``). When the caller ends its input with ``end``,
it kills them all and exits. When the caller vanishes instead (its input ends without ``end``,
or ``PR_SET_PDEATHSIG`` sends SIGHUP: a driver SIGKILLed), it keeps its workers, which wait
for a driver to come back (worker/reattach.py), reaps those that exit, and kills those still
running after ``linger`` seconds (the job's ``FABRIC_MODEL_DRIVER_WAIT`` and a margin): no
process outlives the caller by more than that.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import fcntl
import functools
import gc
import importlib
import io
import json
import logging
import os
import random
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from ..setup.cores import usable_cores
from ..setup.settings import PREEMPT_SIGNALS, TF_NOTICES
from ..worker.native import die_with_parent

#: What every worker imports before its first step; ``torch`` jobs add their adapter.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "numpy", "cloudpickle", "fabric_model.worker.main")
PRELOAD_BY_FRAMEWORK = {"torch": ("fabric_model.frameworks.torch.adapter",)}
#: What a spare imports before its start request: what a Keras worker imports before its first
#: step that the warm process must not (TensorFlow). The frameworks named here keep spares; which
#: Keras ``tf.keras`` is (``TF_USE_LEGACY_KERAS``) is read at import, from the warm process's
#: environment, which the caller's next job must match (launchers/warm_spare.py, ``fits``).
_KERAS_WORKER = ("fabric_model.frameworks.keras.adapter", "fabric_model.frameworks.keras.runtime")
SPARE_IMPORTS = {
    "keras": ("tensorflow", "keras", *_KERAS_WORKER),
    "tf_keras": ("tensorflow", "tf_keras", *_KERAS_WORKER, "fabric_model.frameworks.keras.keras2"),
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

    def __init__(self, out: int, framework: str = "torch") -> None:
        self.out = out  # the events' pipe (fd 1 itself carries stray output to the log)
        self.framework = framework
        self.children: dict[int, int] = {}  # worker id -> pid, until reaped
        self.spares = Spares(framework, self.send_quietly)  # never workers until one takes a start request
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
            waiting = [0, self._wake_r, *self.spares.importing]
            readable, _, _ = select.select(waiting, [], [], self.idle if parked else None)
            if parked and not readable:
                return  # kept for a next job that did not come
            if self._wake_r in readable:
                os.read(self._wake_r, 4096)
            self.spares.heard(readable)
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
            self.spares.top_up(self.own_fds(), len(self.children))

    def handle(self, request: dict[str, Any]) -> None:
        if request["op"] != "park":
            self.idle = None  # taken by a job: it waits for its requests as long as they take
        if request["op"] == "start":
            self.linger = max(self.linger, float(request.get("linger", 0.0)))
            # train(verbose=2) shows TensorFlow's start-up notices in worker logs: a spare's are behind it.
            notices = request["env"].get(TF_NOTICES.name) == "1"
            spare = None if notices else self.spares.take(json.dumps(request).encode())
            pid = spare.pid if spare is not None else in_child(lambda: become_worker(request, self.own_fds()))
            self.children[request["id"]] = pid
            how = {} if spare is None else {"spare": "ready" if spare.ready else "importing"}
            self.send(ev="started", id=request["id"], pid=pid, **how)
        elif request["op"] == "spares":
            self.spares.keep(int(request["n"]), self.own_fds(), len(self.children))
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
            self.spares.keep(int(request.get("spares", 0)), self.own_fds(), len(self.children))  # for the next job
            self.send(ev="parked")

    def own_fds(self) -> tuple[int, ...]:
        """The descriptors a child of this process closes: requests, events, wakeup, spares' pipes."""
        return (0, self.out, self._wake_r, self._wake_w, *self.spares.fds())

    def send_quietly(self, **event: Any) -> None:
        try:
            self.send(**event)
        except OSError:
            pass  # the caller closed its end

    def outlive_caller(self) -> None:
        """The caller vanished: keep the workers, which wait for a driver to come back, reaping
        those that exit, for ``linger`` seconds at most; SIGHUP (the caller's death) no longer
        concerns this process."""
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        self.spares.end_all()  # no job will come
        deadline = time.monotonic() + self.linger + LINGER_MARGIN
        while self.children and time.monotonic() < deadline:
            for worker_id, pid in list(self.children.items()):
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done:
                    del self.children[worker_id]
            time.sleep(0.1)

    def reap(self) -> None:
        self.spares.reap()
        for worker_id, pid in list(self.children.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del self.children[worker_id]
                self.send(ev="exited", id=worker_id, code=exit_code(status))

    def kill_all(self) -> None:
        """The caller is done (or gone): no worker or spare outlives this process."""
        self.spares.end_all()
        for worker_id, pid in list(self.children.items()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, status = os.waitpid(pid, 0)
            del self.children[worker_id]
            self.send_quietly(ev="exited", id=worker_id, code=exit_code(status))


def in_child(run: Callable[[], Any]) -> int:
    """Fork; the child runs ``run`` and exits (its code; 70 if it raised), never back into the
    server's loop; the parent gets the child's pid."""
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            result = run()
            code = result if isinstance(result, int) else 0
        except SystemExit as exc:  # a usage error exits as it would in a fresh interpreter
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


@dataclasses.dataclass
class Spare:
    """The server's side of a spare: its pid, the pipe its start request goes down, and the one
    on which it says it has imported (``ready``), closed once it has."""

    pid: int
    requests: int
    ready_pipe: int | None
    ready: bool = False

    def fits(self, request: bytes) -> bool:
        """Whether its empty pipe takes ``request`` whole, without blocking."""
        return len(request) <= fcntl.fcntl(self.requests, fcntl.F_GETPIPE_SZ)

    def hand(self, request: bytes) -> bool:
        """Write its start request (False if it is gone)."""
        try:
            while request:  # an empty pipe that fits it never blocks
                request = request[os.write(self.requests, request) :]
            return True
        except OSError:  # BrokenPipeError: it died
            return False

    def heard(self) -> None:
        """Its ready pipe is readable: it has imported (one byte), or died (end of file)."""
        assert self.ready_pipe is not None
        try:
            self.ready = os.read(self.ready_pipe, 1) == b"r"
        except OSError:
            pass
        _close(self.ready_pipe)
        self.ready_pipe = None


class Spares:
    """A Keras warm process's spares: ``target`` idle ones kept, replaced as jobs take them, on
    the cores the job's workers leave free: a spare imports only while fewer processes than this
    process's usable cores are workers or importing spares (an import is one busy core for
    seconds, which a job's own start-up or steps are not to share). With cores to spare, a job's
    replacements import beside it, ready for a job that comes right after; else they import once
    it has ended (``park``).

    Args:
        framework: the warm process's; only those of :data:`SPARE_IMPORTS` keep spares.
        send: the events' writer (``spares``: the idle spares' pids, whenever they change).
    """

    def __init__(self, framework: str, send: Callable[..., None]) -> None:
        self.imports = SPARE_IMPORTS.get(framework, ())
        self.send = send
        self.target = 0
        self.idle: dict[int, Spare] = {}  # pid -> spare, oldest first
        self.importing: dict[int, Spare] = {}  # ready pipe -> a spare (idle or now a worker) still importing
        self.cores = usable_cores()

    def fds(self) -> list[int]:
        return [fd for spare in self.idle.values() for fd in (spare.requests, spare.ready_pipe) if fd is not None] + [
            fd for fd, spare in self.importing.items() if spare.pid not in self.idle
        ]

    def keep(self, n: int, server_fds: tuple[int, ...], workers: int) -> None:
        """``n`` idle spares from now on: the extra ones ended, the missing ones forked (now, or as
        cores come free of ``workers`` and imports)."""
        self.target = max(0, n) if self.imports else 0
        while len(self.idle) > self.target:
            self.end(next(reversed(self.idle.values())))
        self.top_up(server_fds, workers)

    def top_up(self, server_fds: tuple[int, ...], workers: int) -> None:
        """Fork the missing spares on the cores that neither ``workers`` (those that were spares
        still importing among them) nor idle spares still importing use."""
        busy = workers + sum(spare.pid in self.idle for spare in self.importing.values())
        forked = False
        while len(self.idle) < self.target and busy < self.cores:
            requests_r, requests_w = os.pipe()
            ready_r, ready_w = os.pipe()
            inherited = (*server_fds, *self.fds(), requests_w, ready_r)
            pid = in_child(functools.partial(run_spare, self.imports, requests_r, ready_w, inherited))
            os.close(requests_r)
            os.close(ready_w)
            self.idle[pid] = self.importing[ready_r] = Spare(pid, requests_w, ready_r)
            busy, forked = busy + 1, True
        if forked:
            self._changed()

    def heard(self, readable: list[int]) -> None:
        """The ready pipes among ``readable``: those spares are done importing (or dead)."""
        for fd in readable:
            spare = self.importing.pop(fd, None)
            if spare is not None:
                spare.heard()

    def take(self, request: bytes) -> Spare | None:
        """The spare that becomes the worker of ``request`` (one done importing first, else the
        oldest: it has a head start on a new fork), or None (none alive, or the request is larger
        than its pipe holds: the server never blocks on a spare still importing)."""
        for spare in sorted(self.idle.values(), key=lambda spare: not spare.ready):
            if not spare.fits(request):
                return None
            if os.waitpid(spare.pid, os.WNOHANG)[0]:  # it died unused: only dropped (and replaced)
                self._forget(spare)  # reaped now: never signalled again, its pid may be another's
                self._changed()
            elif spare.hand(request):
                del self.idle[spare.pid]
                _close(spare.requests)  # its end of file: the request is whole
                self._changed()
                return spare  # in `importing` until it is done: it holds a core as a spare did
            else:
                self.end(spare)  # dying: its pipe is closed
        return None

    def reap(self) -> None:
        """Drop the idle spares that died (a spare that dies unused is replaced like a taken one)."""
        for spare in list(self.idle.values()):
            if os.waitpid(spare.pid, os.WNOHANG)[0]:
                self._forget(spare)
                self._changed()

    def end(self, spare: Spare) -> None:
        """SIGKILL and reap an idle spare (it holds nothing of a job)."""
        self._forget(spare)
        try:
            os.kill(spare.pid, signal.SIGKILL)
            os.waitpid(spare.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass  # reaped already
        self._changed()

    def end_all(self) -> None:
        self.target = 0
        for spare in list(self.idle.values()):
            self.end(spare)
        for spare in self.importing.values():  # those that became workers: the server reaps them
            _close(spare.ready_pipe)
        self.importing.clear()

    def _forget(self, spare: Spare) -> None:
        self.idle.pop(spare.pid, None)
        if spare.ready_pipe is not None:
            self.importing.pop(spare.ready_pipe, None)
            _close(spare.ready_pipe)
            spare.ready_pipe = None
        _close(spare.requests)

    def _changed(self) -> None:
        self.send(ev="spares", pids=list(self.idle))


def _close(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def run_spare(imports: tuple[str, ...], requests: int, ready: int, server_fds: tuple[int, ...]) -> int:
    """In a spare: import ``imports`` (quietly, as a Keras worker does; no TensorFlow operation),
    say so on ``ready``, then wait for the start request on ``requests`` and become that worker;
    0 at once if the server closes the pipe first."""
    signal.set_wakeup_fd(-1)  # before the server's wakeup pipe is closed: a signal must not write there
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    die_with_parent()
    for fd in set(server_fds) - {0, 1, 2}:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # not the caller's requests
    os.close(null)
    from ..frameworks.keras.quiet import quiet_tensorflow

    try:
        with quiet_tensorflow():
            for name in imports:
                importlib.import_module(name)
    except Exception:  # noqa: BLE001 - the worker imports it again, and its own log says what failed
        pass
    try:
        os.write(ready, b"r")
        os.close(ready)
    except OSError:
        return 0  # the server let it go while it imported
    data = b""
    while chunk := os.read(requests, 1 << 16):
        data += chunk
    if not data:
        return 0  # ended unused
    become_worker(json.loads(data), (requests,))
    return 70  # become_worker does not return


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
    # Each worker draws its own entropy, as a fresh interpreter would (a spare, forked long before
    # its job, too; Python's random reseeds at every fork, but is drawn afresh all the same).
    random.seed()
    if "numpy" in sys.modules:
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
    for name in PRELOAD + PRELOAD_BY_FRAMEWORK.get(framework, ()):
        importlib.import_module(name)
    before_ready(out)
    server = Server(out, framework)
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
