"""A worker's rendezvous store: a ``torch.distributed.Store`` served by the driver.

The connection is a control-plane connection (HMAC-authenticated both ways, then every frame
MAC'd, :mod:`fabric_model.transport.sealed`; to the same address and port as the worker's own)
opened with :class:`~fabric_model.transport.protocol.StoreOpen`;
requests and replies are the frames of :mod:`fabric_model.transport.store.wire`. ``ProcessGroupGloo``
and ``ProcessGroupNCCL`` use it through a ``PrefixStore`` (docs/architecture.md,
"Processes"); gloo's rendezvous calls only ``set``, ``wait`` and ``get``, the others follow
``TCPStore``'s semantics for completeness. Keep the Python object referenced while torch
uses it (the collective holds it): a ``PrefixStore`` over a collected one loses its methods.

Several threads may call it at once: each request has an id, a reader thread hands every
reply to its caller, and a caller waiting for a key blocks no other request. A refused
request (the worker is not a member of the current generation, or the key is not of it) and
a timeout raise ``torch.distributed.DistStoreError``, which the collective turns into a
:class:`~fabric_model.transport.collective.CollectiveError`.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from .. import control
from .. import protocol as p
from .wire import BLOCKING, OK, Op, decode, encode


class _Pending:
    """One request's reply, filled by the reader thread."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.code = OK
        self.fields: list[bytes] = []


class RemoteStore(dist.Store):
    """The driver's store, as ``worker_id`` sees it; ``timeout`` bounds waits for keys."""

    def __init__(self, address: tuple[str, int], secret: bytes, worker_id: int, timeout: timedelta) -> None:
        super().__init__()
        self.set_timeout(timeout)
        self._address, self._secret, self._worker_id = address, secret, worker_id
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._next_id = 0
        self._closed: str | None = None
        self._open()

    def _open(self) -> None:
        self._channel = control.connect(self._address, self._secret, timeout=control.HANDSHAKE_TIMEOUT)
        self._channel.send(p.StoreOpen(self._worker_id))
        self._reader = threading.Thread(target=self._read, args=(self._channel,), name="fabric-store", daemon=True)
        self._reader.start()

    def reopen(self) -> None:
        """Connect again, to a driver that came back at the same address (worker/reattach.py):
        calls made while it was away failed; later ones go to it."""
        self._channel.shutdown()
        self._reader.join(timeout=2.0)
        self._open()
        with self._lock:
            self._closed = None

    # -- the Store interface ------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._call(Op.SET, [_b(key), _b(value)])

    def get(self, key: str) -> bytes:
        return self._call(Op.GET, [_b(key)])[0]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call(Op.WAIT, [_b(k) for k in keys], timeout)

    def check(self, keys: list[str]) -> bool:
        return self._call(Op.CHECK, [_b(k) for k in keys])[0] == b"1"

    def add(self, key: str, value: int) -> int:
        return int(self._call(Op.ADD, [_b(key), str(int(value)).encode()])[0])

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        return self._call(Op.COMPARE_SET, [_b(key), _b(expected_value), _b(desired_value)])[0]

    def delete_key(self, key: str) -> bool:
        return self._call(Op.DELETE, [_b(key)])[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(Op.NUM_KEYS, [])[0])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call(Op.MULTI_GET, [_b(k) for k in keys])

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        self._call(Op.MULTI_SET, [_b(x) for pair in zip(keys, values) for x in pair])

    def append(self, key: str, value: bytes | str) -> None:
        self._call(Op.APPEND, [_b(key), _b(value)])

    def has_extended_api(self) -> bool:
        return True  # append, multi_get and multi_set are served, not emulated

    # The names torch's C++ side (PrefixStore, the process groups) calls these two by.
    deleteKey = delete_key
    getNumKeys = num_keys

    def close(self) -> None:
        """Close the connection; calls in flight and later ones raise."""
        self._channel.shutdown()
        self._reader.join(timeout=2.0)

    # -- requests and replies -------------------------------------------------------------------
    def _call(self, op: Op, fields: list[bytes], timeout: timedelta | None = None) -> list[bytes]:
        """Send one request and wait for its reply: up to ``timeout`` (default: the store's)
        for a blocking one, and as long for any other (the driver answers those at once)."""
        bound = (timeout or self.timeout).total_seconds()  # type: ignore[attr-defined]  # torch's stubs lack it
        pending = _Pending()
        with self._lock:
            if self._closed is not None:
                raise dist.DistStoreError(f"the driver's store is unreachable ({self._closed})")
            request = self._next_id = (self._next_id + 1) % (1 << 32)
            self._pending[request] = pending
        try:
            self._channel.send_bytes(encode(op, request, fields))
        except OSError as exc:
            self._forget(request)
            raise dist.DistStoreError(f"the driver's store is unreachable ({exc})") from exc
        if not pending.done.wait(bound):
            self._forget(request)
            if op in BLOCKING:
                self._cancel(request)
            keys = b", ".join(fields[:4]).decode(errors="replace") if op in BLOCKING else op.name
            raise dist.DistStoreError(f"timed out after {bound:.1f} s waiting for the store ({keys})")
        if pending.code != OK:
            reason = pending.fields[0].decode(errors="replace") if pending.fields else "refused"
            raise dist.DistStoreError(f"the driver's store refused {op.name}: {reason}")
        return pending.fields

    def _forget(self, request: int) -> None:
        with self._lock:
            self._pending.pop(request, None)

    def _cancel(self, request: int) -> None:
        try:
            self._channel.send_bytes(encode(Op.CANCEL, request))
        except OSError:
            pass

    def _read(self, channel: control.Channel) -> None:
        """The reader thread of ``channel``: every reply to its caller; on close, every caller fails."""
        reason = "closed"
        try:
            while True:
                code, request, fields = decode(channel.recv_bytes())
                with self._lock:
                    pending = self._pending.pop(request, None)
                if pending is not None:  # else: a reply to a request that timed out
                    pending.code, pending.fields = code, fields
                    pending.done.set()
        except (EOFError, OSError, ValueError) as exc:
            reason = f"connection lost: {exc!r}"
        with self._lock:
            self._closed = reason
            orphans, self._pending = list(self._pending.values()), {}
        for pending in orphans:
            pending.code, pending.fields = -1, [reason.encode()]
            pending.done.set()


def _b(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
