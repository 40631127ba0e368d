"""Workers as Ray actors: the launcher of ``cluster="ray"`` (docs/architecture.md, "Ray").

One actor per worker (:class:`~fabric_model.launchers.ray_host.WorkerHost`), no placement
groups: an actor Ray cannot place yet is *pending* (:meth:`RayLauncher.pending`), and Ray
places it when a node with room joins, so keeping ``engines_number - alive`` requests
outstanding is the scale-up. Ray reports a lost actor (a node gone, the actor killed) as an
``ActorDiedError`` on its outstanding ``wait`` call: that is an exit with a nonzero code, as a
local process's death is. A frozen worker is not reported by Ray for 15 s or more; the
driver's heartbeat finds it. Worker output is copied, chunk by chunk, from the actor's node
into the driver's run directory (``logs/worker-<id>.log``). A node Ray drains (``ray drain-node``,
the autoscaler's preemption) is read from Ray's draining nodes once a second: its workers are
sent SIGTERM, their notice to leave after their step (docs/architecture.md, "Preemption").
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from ..settings.registry import LAUNCHED
from .base import Launcher
from .ray_host import WorkerHost

log = logging.getLogger(__name__)

#: Seconds between two copies of the workers' output to the run directory.
LOG_INTERVAL = 1.0
#: Seconds ``kill`` waits for the actor to kill its worker, and again for its last output.
KILL_WAIT = 0.3
#: Exit code reported for a worker whose actor died (node lost, actor killed).
ACTOR_DIED = -int(signal.SIGKILL)
#: Seconds between two reads of the nodes Ray is draining.
DRAIN_INTERVAL = 1.0


@dataclasses.dataclass
class _Actor:
    """One worker's actor and its outstanding calls."""

    handle: Any
    started: Any  # ObjectRef of WorkerHost.start: ready once Ray placed the actor
    waited: Any  # ObjectRef of WorkerHost.wait: ready when the worker process ends
    host: str | None = None
    node: str | None = None  # the Ray node id it was placed on
    told_to_leave: bool = False  # its node is being drained: SIGTERM was sent
    local_pid: int | None = None  # the actor's pid, when it runs on this host
    code: int | None = None
    log_offset: int = 0
    log_call: Any = None


class RayLauncher(Launcher):
    """Worker processes inside Ray actors, wherever Ray places them.

    Args:
        address: the driver's control-plane address (reachable from the cluster's nodes).
        secret: the job's secret; it reaches each actor as a task argument.
        log_path: where the copy of worker ``worker_id``'s output goes.
        actor_options: Ray actor options for every worker (resources, runtime_env).
        threads: intra-op threads per worker (``OMP_NUM_THREADS``).
    """

    def __init__(
        self,
        address: tuple[str, int],
        secret: bytes,
        log_path: Callable[[int], Path],
        actor_options: dict[str, Any],
        threads: int,
    ) -> None:
        self.address, self.secret, self.log_path = address, secret, log_path
        self.threads = threads
        self._remote = ray.remote(WorkerHost).options(max_concurrency=4, max_restarts=0, **actor_options)
        self._actors: dict[int, _Actor] = {}
        self._last_logs = 0.0
        self._last_drain = 0.0

    def _child_env(self) -> dict[str, str]:
        env = {LAUNCHED.name: "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(self.threads)}
        if self.address[0].startswith("127.") or self.address[0] == "localhost":
            env["GLOO_SOCKET_IFNAME"] = "lo"  # one host: keep gloo on loopback with the driver
        return env

    def start(self, worker_id: int, device: str | None) -> None:
        args = ["--driver", f"{self.address[0]}:{self.address[1]}", "--worker-id", str(worker_id)]
        if device:
            args += ["--device", device]
        handle: Any = self._remote.remote()
        started = handle.start.remote(args, self.secret.hex(), self._child_env())
        self._actors[worker_id] = _Actor(handle, started, handle.wait.remote())
        log.debug("requested an actor for worker %d", worker_id)

    def pending(self) -> frozenset[int]:
        """Workers whose actor Ray has not placed yet (no node with room so far)."""
        waiting = {a.started: w for w, a in self._actors.items() if a.host is None and a.code is None}
        if not waiting:
            return frozenset()
        ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=0)
        for ref in ready:
            actor = self._actors[waiting.pop(ref)]
            try:
                where = ray.get(ref)
                actor.host, actor.node = where["ip"], where.get("node")
                if where["hostname"] == socket.gethostname():
                    actor.local_pid = int(where["pid"])
            except ray.exceptions.RayError:
                actor.host = "?"  # never ran: exited() reports it
        return frozenset(waiting.values())

    def host(self, worker_id: int) -> str | None:
        """The node IP of the worker's actor (None while pending)."""
        actor = self._actors.get(worker_id)
        if actor is not None and actor.host is None:
            self.pending()
        return actor.host if actor is not None and actor.host != "?" else None

    def exited(self) -> dict[int, int]:
        """Worker ids whose process ended (or whose actor died), with their exit codes."""
        self._copy_logs(wait=0.0)
        self._tell_drained_to_leave()
        running = {a.waited: w for w, a in self._actors.items() if a.code is None}
        if running:
            ready, _ = ray.wait(list(running), num_returns=len(running), timeout=0)
            for ref in ready:
                self._actors[running[ref]].code = self._exit_code(ref)
        return {w: a.code for w, a in self._actors.items() if a.code is not None}

    def _tell_drained_to_leave(self) -> None:
        """Send SIGTERM, once, to the workers on the nodes Ray is draining (read at most once per
        ``DRAIN_INTERVAL``): they leave after their step, as on any preemption notice."""
        now = time.monotonic()
        if now - self._last_drain < DRAIN_INTERVAL:
            return
        self._last_drain = now
        placed = [a for a in self._actors.values() if a.code is None and a.node and not a.told_to_leave]
        if not placed:
            return
        draining = draining_nodes()
        for worker_id, actor in self._actors.items():
            if actor in placed and actor.node in draining:
                log.warning("worker %d: its Ray node is being drained; telling it to leave after its step", worker_id)
                actor.told_to_leave = True
                actor.handle.kill_child.remote(int(signal.SIGTERM))

    @staticmethod
    def _exit_code(ref: Any) -> int:
        try:
            return int(ray.get(ref))
        except ray.exceptions.RayError as exc:  # ActorDiedError: node lost, actor killed, never placed
            log.debug("worker actor died: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return ACTOR_DIED

    def kill(self, worker_id: int) -> None:
        """SIGKILL the worker process, then the actor (a pending request is withdrawn).

        Bounded to well under a second: this runs on the driver's event loop, and an actor on a
        lost or partitioned node answers nothing until Ray declares the node dead (seconds), while
        the other workers' heartbeats wait to be read."""
        actor = self._actors.get(worker_id)
        if actor is None:
            return
        if actor.code is None and actor.host is not None:
            try:
                ray.wait([actor.handle.kill_child.remote()], timeout=KILL_WAIT)
            except ray.exceptions.RayError:
                pass
            self._copy_one(worker_id, actor, wait=KILL_WAIT)  # its last output, if its node answers
        ray.kill(actor.handle, no_restart=True)
        if actor.code is None:
            actor.code = ACTOR_DIED

    def wait_all(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every worker process to exit by itself."""
        running = [a.waited for a in self._actors.values() if a.code is None]
        if running:
            ready, _ = ray.wait(running, num_returns=len(running), timeout=timeout)
            if len(ready) < len(running):
                return False
        self.exited()
        return True

    def stop_all(self, timeout: float = 5.0) -> None:
        """SIGKILL every worker (SIGTERM is a worker's notice to leave after its step:
        worker/notice.py), wait up to ``timeout``, copy the last output, kill every actor."""
        live = {w: a for w, a in self._actors.items() if a.code is None and a.host not in (None, "?")}
        for actor in live.values():
            actor.handle.kill_child.remote(int(signal.SIGKILL))
        if live:
            ray.wait([a.waited for a in live.values()], num_returns=len(live), timeout=timeout)
        for worker_id, actor in self._actors.items():
            if actor.host not in (None, "?"):
                self._copy_one(worker_id, actor, wait=2.0)
                close = actor.handle.close.remote()
                try:
                    ray.get(close, timeout=5.0)
                except (ray.exceptions.RayError, TimeoutError):
                    pass
            ray.kill(actor.handle, no_restart=True)
            actor.code = ACTOR_DIED if actor.code is None else actor.code
        # ray.kill returns at once; on this host, see the actors' processes gone too.
        _wait_gone([a.local_pid for a in self._actors.values() if a.local_pid], timeout)

    def log_tail(self, worker_id: int, lines: int = 30) -> str:
        """The end of the copy of the worker's output in the run directory."""
        actor = self._actors.get(worker_id)
        if actor is not None and actor.host not in (None, "?"):
            self._copy_one(worker_id, actor, wait=2.0)
        try:
            text = self.log_path(worker_id).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # -- worker output ----------------------------------------------------------------------
    def _copy_logs(self, wait: float) -> None:
        """Every LOG_INTERVAL: append what each placed worker wrote since the last copy."""
        now = time.monotonic()
        if now - self._last_logs < LOG_INTERVAL:
            return
        self._last_logs = now
        for worker_id, actor in self._actors.items():
            if actor.host not in (None, "?") and actor.code is None:
                self._copy_one(worker_id, actor, wait)

    def _copy_one(self, worker_id: int, actor: _Actor, wait: float) -> None:
        """Collect the outstanding ``read_log`` call if it is done (waiting up to ``wait`` s),
        write its bytes, and issue the next; a dead actor's output ends where it is."""
        for _ in range(64):  # at most 64 MiB in one go
            fresh = actor.log_call is None  # an older call may have found nothing new yet
            if fresh:
                try:
                    actor.log_call = actor.handle.read_log.remote(actor.log_offset)
                except ray.exceptions.RayError:
                    return
            ready, _ = ray.wait([actor.log_call], timeout=wait)
            if not ready:
                return
            try:
                chunk = ray.get(actor.log_call)
            except ray.exceptions.RayError:
                chunk = b""
            actor.log_call = None
            if not chunk:
                if fresh:
                    return
                continue
            path = self.log_path(worker_id)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "ab") as f:
                f.write(chunk)
            actor.log_offset += len(chunk)


def _wait_gone(pids: list[int], timeout: float) -> None:
    """Wait up to ``timeout`` s for processes of this host to end (a zombie has ended)."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[-1].split()[0] == b"Z":
                        break
            except OSError:
                break  # gone (or no /proc: nothing to wait with)
            time.sleep(0.05)


def draining_nodes() -> set[str]:
    """The ids of the nodes Ray is draining (Ray 2.9+: ``ray drain-node``, or its autoscaler
    taking a node back); empty where this Ray cannot say. Ray keeps this behind a private
    interface (``ray._private.state``), so a failure to read it only turns the watch off."""
    try:
        from ray._private.state import state

        return set(state.get_draining_nodes())
    except Exception:  # noqa: BLE001 - not in this Ray version, or not connected: nothing is draining
        return set()
