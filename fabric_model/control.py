"""The control plane: authenticated message channels between the driver and its workers.

Built on :mod:`multiprocessing.connection`, whose ``Listener(authkey=...)`` runs an HMAC
challenge-response before the first message, so nothing is unpickled from a peer that has
not proven it holds the job's secret (DESIGN §2). Messages are ``(kind, payload)`` tuples.
"""

from __future__ import annotations

import logging
import pickle
import queue
import socket
import threading
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

log = logging.getLogger(__name__)

# Worker -> driver.
HELLO = "hello"  # {"worker_id" (None: assign one), "pid", "host"}
READY = "ready"  # set up (job, datasets, device), waiting to join a generation {"attempt"}
BOUNDARY = "boundary"  # stopped after a committed step, as voted {"generation", "next_unit"}
FAILED = "failed"  # a collective failed; the step was undone {"generation", "next_unit", "reason"}
HEARTBEAT = "heartbeat"  # {} every EDT_HEARTBEAT_INTERVAL seconds, from a thread
STEP = "step"  # {"generation", "epoch", "step", "rank", "micro_batches", "stats" (rank 0 only)}
EVAL = "eval"  # {"epoch", "iteration", "stats"}
FINAL = "final"  # {"model_state", "optimizer_state"}
ERROR = "error"  # {"worker_id", "traceback", "exception" (cloudpickled or None)}
DONE = "done"  # {"digest", "next_unit"}; the worker then waits for FINAL_REQUEST or STOP
CHECKPOINT = "checkpoint"  # {"generation", "unit", "epoch", "path" and "seconds", or "error"}: rank 0 wrote one
# Driver -> worker.
JOB = "job"  # {"payload": cloudpickled job, "config", "plan", "worker_id"}
GENERATION = "generation"  # {"generation", "rank", "world_size", "store", "resume_unit", "source_rank", "checkpoint"}
PENDING = "pending"  # {"generation"}: someone waits to join; vote to switch at the next step
FINAL_REQUEST = "final_request"  # {}: send FINAL
ABORT = "abort"  # {"generation"}: a member was lost; give up collectives of that generation
STOP = "stop"  # {}: exit now
# Raised internally by the driver's reader threads.
LOST = "lost"  # the connection closed


class Channel:
    """One end of a driver/worker connection; ``send`` may be called from several threads."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, kind: str, payload: dict[str, Any] | None = None) -> None:
        # Plain pickle, not Connection.send's ForkingPickler: with torch loaded that one ships
        # tensors as shared-memory file descriptors, which only work between local processes.
        data = pickle.dumps((kind, payload or {}), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self._conn.send_bytes(data)

    def recv(self, timeout: float | None = None) -> tuple[str, dict[str, Any]]:
        """Next message; raises ``TimeoutError`` after ``timeout`` seconds, ``EOFError`` on close."""
        if timeout is not None and not self._conn.poll(timeout):
            raise TimeoutError(f"no message from the peer within {timeout:.1f} s")
        kind, payload = pickle.loads(self._conn.recv_bytes())
        return kind, payload

    def close(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass


def connect(address: tuple[str, int], secret: bytes) -> Channel:
    """A worker's connection to the driver at ``address``, authenticated with ``secret``."""
    return Channel(Client(address, family="AF_INET", authkey=secret))


class ControlServer:
    """The driver's listener: accepts authenticated workers and funnels their messages.

    Every message from every worker lands on one queue as ``(worker_id, kind, payload)``,
    so the driver is a single loop over events. ``worker_id`` is learned from the
    worker's first message (``HELLO``); a closed connection becomes a ``LOST`` event.
    """

    def __init__(
        self, secret: bytes, host: str = "127.0.0.1", port: int = 0, allocate_id: Callable[[], int] | None = None
    ) -> None:
        self._allocate_id = allocate_id
        self._listener = Listener((host, port), family="AF_INET", authkey=secret)
        self.events: queue.Queue[tuple[int, str, dict[str, Any]]] = queue.Queue()
        self.channels: dict[int, Channel] = {}
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="fabric-accept", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._listener.address
        return str(host), int(port)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn = self._listener.accept()
            except (AuthenticationError, EOFError, ConnectionError):
                if not self._closed.is_set():
                    log.warning("rejected a control-plane connection that failed authentication")
                continue
            except OSError:
                return  # listener closed
            threading.Thread(target=self._read_loop, args=(Channel(conn),), daemon=True).start()

    def _read_loop(self, channel: Channel) -> None:
        worker_id = -1
        try:
            kind, payload = channel.recv(timeout=60.0)
            if kind != HELLO:
                raise ValueError(f"expected {HELLO!r} first, got {kind!r}")
            if payload.get("worker_id") is None and self._allocate_id is not None:
                payload["worker_id"] = self._allocate_id()
                channel.send(HELLO, {"worker_id": payload["worker_id"]})  # tell it its id
            worker_id = int(payload["worker_id"])
            with self._lock:
                self.channels[worker_id] = channel
            self.events.put((worker_id, kind, payload))
            while True:
                kind, payload = channel.recv()
                self.events.put((worker_id, kind, payload))
        except (EOFError, OSError, TimeoutError, ValueError, KeyError) as exc:
            if worker_id >= 0:
                self.events.put((worker_id, LOST, {"reason": repr(exc)}))
        finally:
            channel.close()

    def send(self, worker_id: int, kind: str, payload: dict[str, Any] | None = None) -> bool:
        """Send to a worker; False when it is gone."""
        with self._lock:
            channel = self.channels.get(worker_id)
        if channel is None:
            return False
        try:
            channel.send(kind, payload)
            return True
        except (OSError, EOFError):
            return False

    def close(self) -> None:
        self._closed.set()
        # A thread blocked in accept() is not woken by close(); a throw-away connection is.
        try:
            socket.create_connection(self.address, timeout=1.0).close()
        except OSError:
            pass
        self._thread.join(timeout=2.0)
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            for channel in self.channels.values():
                channel.close()
            self.channels.clear()
