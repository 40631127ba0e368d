"""One thread reads every worker's control connection (docs/architecture.md, "Scale").

A thread per connection costs the driver little with a handful of workers, but with thousands
each message wakes its own thread, and they take turns under the interpreter's lock with the
driver's loop. Here one thread waits on all the connections at once (``selectors``), reads
what each has ready without ever blocking on one (a peer frozen mid-frame holds up nobody),
cuts the bytes into frames as :mod:`multiprocessing.connection` writes them, and hands each
frame to the connection's callback.

The sockets stay blocking, since the driver sends on them from other threads: a read is only
made after the selector said the socket is readable, when it returns what is there.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: Most bytes read from one connection at a time (then the others get their turn).
READ_SIZE = 1 << 18


class Frames:
    """Bytes of one connection, cut into the frames ``Connection.send_bytes`` writes: a signed
    4-byte big-endian length, or -1 and an 8-byte length, then the payload."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """Add ``data``; return the frames it completes, in order."""
        buffer = self._buffer
        buffer += data
        frames: list[bytes] = []
        while len(buffer) >= 4:
            size, header = int.from_bytes(buffer[:4], "big", signed=True), 4
            if size == -1:
                if len(buffer) < 12:
                    break
                size, header = int.from_bytes(buffer[4:12], "big"), 12
            if size < 0:
                raise ValueError(f"a frame of negative length {size}")
            if len(buffer) < header + size:
                break
            with memoryview(buffer) as view:  # one copy of the payload, not two
                frames.append(bytes(view[header : header + size]))
            del buffer[: header + size]
        return frames


class ConnectionReader:
    """A thread reading many connections: ``add`` one with what to do with each of its frames
    and with its end; both are called on this thread, in the order the bytes came."""

    def __init__(self, name: str = "fabric-reader") -> None:
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._closed = False
        # A socket pair whose one end wakes the selector when a connection is added or it closes.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._added: list[tuple[int, Callable[[bytes], None], Callable[[BaseException], None]]] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, fd: int, on_frame: Callable[[bytes], None], on_end: Callable[[BaseException], None]) -> None:
        """Read connection ``fd`` from now on: ``on_frame`` for each frame, then ``on_end`` once,
        with what ended it (``EOFError`` on a clean close). The caller must not read it any more."""
        with self._lock:
            if self._closed:
                raise OSError("the reader is closed")
            self._added.append((fd, on_frame, on_end))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # its buffer is full: a wake-up is pending anyway

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    break
                added, self._added = self._added, []
            for fd, on_frame, on_end in added:
                self._selector.register(fd, selectors.EVENT_READ, (Frames(), on_frame, on_end))
            for key, _ in self._selector.select(timeout=1.0):
                if key.data is None:
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except BlockingIOError:
                        pass
                    continue
                self._read(key)
        for key in list(self._selector.get_map().values()):
            if key.data is not None:
                self._end(key, EOFError("the control server closed"))
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def _read(self, key: Any) -> None:
        frames, on_frame, on_end = key.data
        try:
            data = os.read(key.fd, READ_SIZE)
            if not data:
                raise EOFError()
            for frame in frames.feed(data):
                on_frame(frame)
        except Exception as exc:  # noqa: BLE001 - the connection's end, whatever ended it
            self._end(key, exc)

    def _end(self, key: Any, exc: BaseException) -> None:
        try:
            self._selector.unregister(key.fd)
        except (KeyError, ValueError, OSError):
            pass
        try:
            key.data[2](exc)
        except Exception:  # noqa: BLE001 - one connection's handler must not stop the others' reading
            log.exception("control plane: ending a connection failed")

    def close(self) -> None:
        """End every connection (``on_end`` each) and the thread."""
        with self._lock:
            self._closed = True
        self._wake()
        self._thread.join(timeout=5.0)
