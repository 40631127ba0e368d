"""The control plane: authenticated message channels between the driver and its workers.

Each connection is a :class:`~fabric_model.transport.sealed.SealedConnection`: multiprocessing's
HMAC challenge-response runs both ways before the first message, and every frame after it
carries a MAC under a key derived for that connection, checked before it is unpickled. So
nothing is unpickled from a peer that has not proven it holds the job's secret, nor any frame
injected or replayed on the way. Messages are the dataclasses of
:mod:`fabric_model.transport.protocol` (docs/architecture.md, "The protocol").
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from typing import Any, Literal, Protocol

from . import protocol as p
from .descriptors import allow_many_descriptors
from .reader import ConnectionReader
from .sealed import SealedConnection, dial, handshake
from .sealed import shut_down as _shut_down

log = logging.getLogger(__name__)

#: Seconds a new connection has to complete the handshake before it is cut off.
HANDSHAKE_TIMEOUT = 10.0


def _dumps(message: Any) -> bytes:
    # Plain pickle, not Connection.send's ForkingPickler: with torch loaded that one ships
    # tensors as shared-memory file descriptors, which only work between local processes.
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


#: A heartbeat as it arrives from a worker of this version (any other encoding is unpickled).
HEARTBEAT_FRAME = _dumps(p.Heartbeat())


class Channel:
    """One end of a driver/worker connection; ``send`` may be called from several threads.

    Messages go out in the order they are given, held ones (:meth:`send_soon`) included."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._held: list[Any] = []  # messages waiting for the next frame (send_soon)
        self.holding = threading.Event()  # set while _held is not empty (the heartbeat thread waits on it)
        self._written = 0.0  # time.monotonic() of the last frame sent

    def send(self, message: Any, data: bytes | None = None) -> None:
        """Send one message of :mod:`fabric_model.transport.protocol`, after any held ones
        (``data``: the message already pickled, for one sent to many)."""
        if data is None:
            data = _dumps(message)  # outside the lock: a 4 MiB state chunk does not hold up the others
        with self._lock:
            self._write_held()
            self._conn.send_bytes(data)
            self._written = time.monotonic()

    def send_soon(self, message: Any, within: float) -> None:
        """Send ``message`` now if no frame went out in the last ``within`` seconds, else hold it
        for the next frame (any :meth:`send`, or :meth:`flush`).

        A fast step's report then shares a frame, and the driver one wake-up, with the next
        ones (docs/architecture.md, "What a step costs beyond the math"). Held messages die
        with the process; only step reports are held, which the driver can do without."""
        with self._lock:
            self._held.append(message)
            if time.monotonic() - self._written >= within:
                self._write_held()
            elif len(self._held) == 1:
                # Set once per held frame, not per report: the heartbeat thread needs one wake-up,
                # and ``Event.set`` is six Python calls even when it wakes no one.
                self.holding.set()

    def flush(self, older_than: float = 0.0) -> None:
        """Send the held messages if the last frame went out ``older_than`` seconds ago or more."""
        with self._lock:
            if self._held and time.monotonic() - self._written >= older_than:
                self._write_held()

    def _write_held(self) -> None:
        """Under the lock: the held messages, as one frame."""
        if not self._held:
            return
        held, self._held = self._held, []
        self.holding.clear()
        self._conn.send_bytes(_dumps(held[0] if len(held) == 1 else p.Batch(tuple(held))))
        self._written = time.monotonic()

    def recv(self, timeout: float | None = None) -> Any:
        """Next message; raises ``TimeoutError`` after ``timeout`` seconds, ``EOFError`` on close."""
        conn = self._conn
        if timeout is not None and not conn.poll(timeout):
            raise TimeoutError(f"no message from the peer within {timeout:.1f} s")
        # A sealed connection's payload is unpickled from the buffer it was read into (no copy).
        return pickle.loads(conn.recv_buffer() if isinstance(conn, SealedConnection) else conn.recv_bytes())

    def send_bytes(self, data: bytes) -> None:
        """Send one raw frame (the store's, :mod:`fabric_model.transport.store.wire`)."""
        with self._lock:
            self._conn.send_bytes(data)

    def recv_bytes(self) -> bytes:
        """Next raw frame; ``EOFError`` on close."""
        return self._conn.recv_bytes()

    def fileno(self) -> int:
        return self._conn.fileno()

    def fence(self, message: Any) -> None:
        """Send ``message``, then end our half of the stream (the peer reads it, then EOF)."""
        try:
            self.send(message)
            sock = socket.socket(fileno=os.dup(self._conn.fileno()))
        except (OSError, EOFError):
            return
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            sock.close()

    def close(self) -> None:
        # Under the send lock: a reader thread closing the connection while the driver sends
        # on it would otherwise hand the send a closed (or reused) descriptor mid-write.
        with self._lock:
            try:
                self._conn.close()
            except OSError:
                pass

    def close_soon(self) -> None:
        """Close now if no send is under way, else on a thread once it ends (the caller, the
        reader of every connection, must not wait on a send to a peer that stopped reading)."""
        if self._lock.acquire(blocking=False):
            try:
                self._conn.close()
            except OSError:
                pass
            finally:
                self._lock.release()
        else:
            threading.Thread(target=self.close, name="fabric-close", daemon=True).start()

    def shutdown(self) -> None:
        """Close, waking a thread blocked reading this channel (closing alone does not)."""
        _shut_down(self._conn)
        self.close()


def connect(
    address: tuple[str, int], secret: bytes, timeout: float | None = None, kind: type[Channel] = Channel
) -> Channel:
    """A worker's connection to the driver at ``address``, authenticated with ``secret``.

    ``timeout``: seconds for the connection and the handshake both (a peer at the address that
    accepts and then stays silent would otherwise hold the caller for ever); None: no bound.
    Raises ``OSError``/``EOFError``, or ``AuthenticationError`` when the peer does not hold
    ``secret`` (nothing it sent has been unpickled then)."""
    return kind(dial(address, secret, timeout))


class StoreHandler(Protocol):
    """What serves a store connection (:class:`fabric_model.transport.store.server.StoreService`)."""

    def serve(self, channel: Channel, worker_id: int) -> None:
        """Answer the connection's requests on the calling thread until it closes."""


class ControlServer:
    """The driver's listener: accepts authenticated workers and funnels their messages.

    Every message from every worker lands on one queue as ``(worker_id, message)``, so the
    driver is a single loop over events. ``worker_id`` is learned from the worker's first
    message (:class:`~fabric_model.transport.protocol.Hello`); a closed connection becomes a
    :class:`~fabric_model.transport.protocol.ConnectionLost` event. A connection that opens with
    :class:`~fabric_model.transport.protocol.StoreOpen` is handed to ``store`` on its own thread
    instead: the rendezvous store shares this port and its authentication.
    """

    def __init__(
        self,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        allocate_id: Callable[[], int] | None = None,
        store: StoreHandler | None = None,
    ) -> None:
        allow_many_descriptors()  # two connections a worker: thousands of them (transport/descriptors.py)
        self._allocate_id = allocate_id
        self._store = store
        self._secret = secret
        # The handshake runs on each connection's thread, never the accept thread, where one idle
        # or garbage-sending peer would stall all registration. A deep backlog: with a backlog of
        # 1, a burst of connections (honest or not) waits for SYN retransmits while it is busy.
        self._listener = socket.create_server((host, port), family=socket.AF_INET, backlog=64)
        # A SimpleQueue: its put and get are C, with no Python-level lock the reader thread and the
        # driver's loop would contend for at thousands of messages a second (docs/architecture.md, "Scale").
        self.events: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self.channels: dict[int, Channel] = {}
        # Workers whose reader is still reading (their every message may not be queued yet),
        # and those whose connection ended (its ConnectionLost follows all they sent).
        self._reading: set[int] = set()
        self._ended: set[int] = set()
        self._peers: dict[int, str] = {}  # worker id -> the address its connection came from
        # worker id -> when its last frame arrived (time.monotonic()), written by the reader thread.
        # Heartbeats end here, never queued: with thousands of workers they are most of the
        # messages, and all a heartbeat says is this (docs/architecture.md, "Scale").
        self.heard: dict[int, float] = {}
        self._closed = threading.Event()
        self._lock = threading.Lock()
        # One thread reads every worker's connection once it said Hello (transport/reader.py).
        self._reader = ConnectionReader()
        self._thread = threading.Thread(target=self._accept_loop, name="fabric-accept", daemon=True)
        self._thread.start()

    @property
    def secret(self) -> bytes:
        """The job's secret, which every connection proves it holds."""
        return self._secret

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._listener.getsockname()
        return str(host), int(port)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._listener.accept()
                sock.setblocking(True)
                conn = SealedConnection(sock.detach(), accepting=True)
            except OSError:
                if self._closed.is_set():
                    return  # listener closed
                log.warning("control plane: accepting a connection failed", exc_info=True)
                continue
            host = peer[0] if isinstance(peer, tuple) and peer else None
            threading.Thread(target=self._serve, args=(conn, host), name="fabric-conn", daemon=True).start()

    def _serve(self, conn: SealedConnection, host: str | None = None) -> None:
        """A new connection, on a thread of its own: the handshake and its first message; then
        the reader thread reads it (a store connection keeps this thread)."""
        if self._authenticate(conn):
            self._read_loop(Channel(conn), conn, host)

    def _authenticate(self, conn: SealedConnection) -> bool:
        """The HMAC challenge both ways and the connection's key, within ``HANDSHAKE_TIMEOUT``
        seconds; nothing is unpickled before it succeeds. A peer that fails it or stays silent is
        cut off."""
        try:
            handshake(conn, self._secret, HANDSHAKE_TIMEOUT)  # closes conn on failure
            return True
        except (AuthenticationError, EOFError, OSError, ValueError) as exc:
            if not self._closed.is_set():
                log.warning("control plane: rejected a connection that failed authentication (%s)", type(exc).__name__)
            return False

    def _read_loop(self, channel: Channel, conn: SealedConnection, host: str | None = None) -> None:
        worker_id = -1
        try:
            hello = channel.recv(timeout=60.0)
            if isinstance(hello, p.StoreOpen) and self._store is not None:
                try:
                    self._store.serve(channel, int(hello.worker_id))
                finally:
                    channel.close()
                return
            if not isinstance(hello, p.Hello):
                raise ValueError(f"expected Hello first, got {type(hello).__name__}")
            if hello.worker_id is None:
                if self._allocate_id is None:
                    raise ValueError("a worker without an id connected, and this server assigns none")
                worker_id = self._allocate_id()
                channel.send(p.Assigned(worker_id))
            else:
                worker_id = int(hello.worker_id)
            with self._lock:
                self.channels[worker_id] = channel
                self._reading.add(worker_id)
                if host is not None:
                    self._peers[worker_id] = host
            self.events.put((worker_id, hello))
            self._reader.add(channel.fileno(), self._on_frame(worker_id, conn), self._on_end(worker_id, channel))
        except (EOFError, OSError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            if worker_id >= 0:
                self._on_end(worker_id, channel)(exc)
            else:
                channel.close()

    def _on_frame(self, worker_id: int, conn: SealedConnection) -> Callable[[bytes], None]:
        """What the reader thread does with each of ``worker_id``'s frames: its MAC checked (a frame
        that fails raises, which ends the connection unread), the time heard, and its messages but
        heartbeats, queued."""
        put, heard, clock, open_frame = self.events.put, self.heard, time.monotonic, conn.open_frame

        def on_frame(frame: bytes) -> None:
            payload = open_frame(frame)
            heard[worker_id] = clock()
            if payload == HEARTBEAT_FRAME:
                return
            message = pickle.loads(payload)
            for one in message.messages if isinstance(message, p.Batch) else (message,):
                if type(one) is not p.Heartbeat:
                    put((worker_id, one))

        return on_frame

    def _on_end(self, worker_id: int, channel: Channel) -> Callable[[BaseException], None]:
        """What ends ``worker_id``'s connection: a ``ConnectionLost`` after all it sent."""

        def on_end(exc: BaseException) -> None:
            self.events.put((worker_id, p.ConnectionLost(repr(exc))))
            channel.close_soon()
            with self._lock:
                self._reading.discard(worker_id)
                self._ended.add(worker_id)

        return on_end

    def peer(self, worker_id: int) -> str | None:
        """The address ``worker_id``'s control connection came from (None before its Hello)."""
        with self._lock:
            return self._peers.get(worker_id)

    def connection(self, worker_id: int) -> Literal["none", "open", "ended"]:
        """``worker_id``'s connection: never made, ``open`` (being read: a message it sent may
        not be on the queue yet), or ``ended`` (its :class:`~fabric_model.transport.protocol.ConnectionLost`
        is on the queue after everything it sent)."""
        with self._lock:
            if worker_id in self._reading:
                return "open"
            return "ended" if worker_id in self._ended else "none"

    def send(self, worker_id: int, message: Any, data: bytes | None = None) -> bool:
        """Send a message to a worker (``data``: it pickled already); False when it is gone."""
        with self._lock:
            channel = self.channels.get(worker_id)
        if channel is None:
            return False
        try:
            channel.send(message, data)
            return True
        except (OSError, EOFError):
            return False

    def send_all(self, worker_ids: Iterable[int], message: Any) -> None:
        """Send one message to many workers, pickled once (an abort goes to thousands)."""
        data = _dumps(message)
        for worker_id in worker_ids:
            self.send(worker_id, message, data)

    def fence(self, worker_id: int, reason: str) -> None:
        """Tell a removed worker why (:class:`~fabric_model.transport.protocol.Stop`) and close our side.

        On a thread: a peer behind a partition cannot block the driver's loop. The write side
        is shut after the message, so it arrives before the end of the stream even when the
        partition heals later; the reader thread ends when the peer closes."""
        with self._lock:
            channel = self.channels.get(worker_id)
        if channel is not None:
            threading.Thread(target=channel.fence, args=(p.Stop(reason),), name="fabric-fence", daemon=True).start()

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
        self._reader.close()
        with self._lock:
            for channel in self.channels.values():
                channel.close()
            self.channels.clear()
