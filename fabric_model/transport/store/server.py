"""The driver's rendezvous store, served to the members of the current generation only.

Workers reach it over the control plane: a second authenticated connection (its frames MAC'd,
so none is injected or replayed on the way: :mod:`fabric_model.transport.sealed`) whose first
message is :class:`~fabric_model.transport.protocol.StoreOpen`, then the frames of
:mod:`fabric_model.transport.store.wire`. Each connection is served on its own thread (the control
server's); a request for a key that is not set yet waits here, as a registered waiter, and is
answered when a member sets the key, so the connection's other requests and the driver's
event loop never wait behind it. The client enforces its timeouts and cancels.

Fencing (docs/architecture.md, "Processes"): every key must lie under ``generation/{g}/``
with ``g`` the current generation, and the asking worker must be one of its members. The
driver calls :meth:`StoreService.admit` before it tells the members to enter a generation;
that drops the older generations' keys and fails whoever still waits on them. A worker of an
older generation (a zombie of a healed partition) can then neither read nor write the keys
of the newer one, nor make its members wait.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
from collections.abc import Iterable

from ..control import Channel
from .wire import BLOCKING, ERROR, OK, Op, decode, encode

log = logging.getLogger(__name__)

_GENERATION_KEY = re.compile(rb"generation/(\d+)/")
#: Requests one connection may leave waiting at once (an honest rank has one or two).
MAX_WAITERS = 256


class Refused(Exception):
    """A request the store does not serve; its text goes back to the worker."""


@dataclasses.dataclass
class _Waiter:
    channel: Channel
    request: int
    op: Op
    keys: list[bytes]


class StoreService:
    """A key-value store fenced to the current generation's members."""

    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}
        self._waiters: list[_Waiter] = []
        self._lock = threading.Lock()
        self.generation = -1
        self.members: frozenset[int] = frozenset()
        self.aborted = -1  # generations up to this one are being abandoned

    # -- the driver's side ------------------------------------------------------------------
    def admit(self, generation: int, members: Iterable[int]) -> None:
        """From now on serve ``generation``'s ``members`` only; forget older generations' keys."""
        with self._lock:
            self.generation, self.members = generation, frozenset(members)
            self._data = {k: v for k, v in self._data.items() if _generation_of(k) == generation}
            stale = [w for w in self._waiters if any(_generation_of(k) != generation for k in w.keys)]
            self._waiters = [w for w in self._waiters if w not in stale]
        for waiter in stale:
            _reply(waiter.channel, waiter.request, ERROR, [f"generation {generation} has formed: fenced".encode()])

    def abort(self, generation: int) -> None:
        """``generation`` is being abandoned (a member was lost): fail its waiters and refuse its
        requests from now on, so a rank still forming its group fails at once instead of
        waiting for a peer that will never come (EDT_COLLECTIVE_TIME_OUT)."""
        with self._lock:
            self.aborted = max(self.aborted, generation)
            stale = [w for w in self._waiters if any(_generation_of(k) <= generation for k in w.keys)]
            self._waiters = [w for w in self._waiters if w not in stale]
        for waiter in stale:
            _reply(waiter.channel, waiter.request, ERROR, [f"generation {generation} was aborted".encode()])

    def keys(self) -> list[bytes]:
        """The keys held now (for tests and diagnostics)."""
        with self._lock:
            return sorted(self._data)

    # -- a connection's thread --------------------------------------------------------------
    def serve(self, channel: Channel, worker_id: int) -> None:
        """Answer ``worker_id``'s requests on ``channel`` until it closes or sends a malformed frame."""
        try:
            while True:
                code, request, fields = decode(channel.recv_bytes())
                self._handle(channel, worker_id, code, request, fields)
        except (EOFError, OSError, ValueError) as exc:
            if not isinstance(exc, EOFError):
                log.warning("store: closing worker %d's connection (%s)", worker_id, exc)
        finally:
            with self._lock:
                self._waiters = [w for w in self._waiters if w.channel is not channel]
            channel.close()

    def _handle(self, channel: Channel, worker_id: int, code: int, request: int, fields: list[bytes]) -> None:
        if code == Op.CANCEL:
            with self._lock:
                self._waiters = [w for w in self._waiters if not (w.channel is channel and w.request == request)]
            return
        try:
            op = Op(code)
            with self._lock:
                self._fence(worker_id, _keys_of(op, fields))
                if op in BLOCKING:
                    if op is Op.GET:
                        _arity(op, fields, 1)
                    answer = self._answer(op, fields)
                    if answer is None:
                        if sum(w.channel is channel for w in self._waiters) >= MAX_WAITERS:
                            raise Refused(f"more than {MAX_WAITERS} requests waiting on one connection")
                        self._waiters.append(_Waiter(channel, request, op, fields))
                        return
                    woken: list[tuple[_Waiter, list[bytes]]] = []
                else:
                    answer = self._apply(op, fields)
                    woken = self._wake()
        except (Refused, ValueError) as exc:
            _reply(channel, request, ERROR, [str(exc).encode()])
            return
        _reply(channel, request, OK, answer)
        for waiter, values in woken:  # sent outside the lock: a slow peer holds up no one else
            _reply(waiter.channel, waiter.request, OK, values)

    def _fence(self, worker_id: int, keys: list[bytes]) -> None:
        if self.generation <= self.aborted:
            raise Refused(f"generation {self.generation} was aborted")
        if worker_id not in self.members:
            raise Refused(f"fenced: worker {worker_id} is not a member of generation {self.generation}")
        for key in keys:
            if _generation_of(key) != self.generation:
                raise Refused(f"fenced: key {key!r} is not under generation/{self.generation}/")

    def _answer(self, op: Op, keys: list[bytes]) -> list[bytes] | None:
        """A blocking request's answer, or None while a key is missing (lock held)."""
        if not all(k in self._data for k in keys):
            return None
        return [] if op is Op.WAIT else [self._data[k] for k in keys]

    def _wake(self) -> list[tuple[_Waiter, list[bytes]]]:
        """The waiters whose keys are all set now, removed, with their answers (lock held)."""
        woken = []
        for waiter in list(self._waiters):
            answer = self._answer(waiter.op, waiter.keys)
            if answer is not None:
                self._waiters.remove(waiter)
                woken.append((waiter, answer))
        return woken

    def _apply(self, op: Op, f: list[bytes]) -> list[bytes]:
        """Run a non-blocking request (lock held); semantics as torch's TCPStore."""
        data = self._data
        if op is Op.SET or op is Op.APPEND:
            _arity(op, f, 2)
            data[f[0]] = (data.get(f[0], b"") if op is Op.APPEND else b"") + f[1]
            return []
        if op is Op.MULTI_SET:
            if len(f) % 2:
                raise ValueError("MULTI_SET takes key, value pairs")
            data.update(zip(f[0::2], f[1::2]))
            return []
        if op is Op.CHECK:
            return [b"1" if all(k in data for k in f) else b"0"]
        if op is Op.ADD:
            _arity(op, f, 2)
            value = int(data.get(f[0], b"0")) + int(f[1])
            data[f[0]] = str(value).encode()
            return [data[f[0]]]
        if op is Op.COMPARE_SET:
            _arity(op, f, 3)
            key, expected, desired = f
            if data.get(key, b"") == expected and (key in data or expected == b""):
                data[key] = desired
            return [data.get(key, expected)]
        if op is Op.DELETE:
            _arity(op, f, 1)
            return [b"1" if data.pop(f[0], None) is not None else b"0"]
        if op is Op.NUM_KEYS:
            return [str(len(data)).encode()]
        raise ValueError(f"unknown store operation {op!r}")


def _keys_of(op: Op, fields: list[bytes]) -> list[bytes]:
    """The keys a request touches, for the fence."""
    if op is Op.NUM_KEYS:
        return []
    if op is Op.MULTI_SET:
        return fields[0::2]
    if op in (Op.SET, Op.GET, Op.ADD, Op.COMPARE_SET, Op.DELETE, Op.APPEND):
        return fields[:1]
    return fields


def _arity(op: Op, fields: list[bytes], n: int) -> None:
    if len(fields) != n:
        raise ValueError(f"{op.name} takes {n} fields, got {len(fields)}")


def _generation_of(key: bytes) -> int:
    match = _GENERATION_KEY.match(key)
    return int(match.group(1)) if match else -1


def _reply(channel: Channel, request: int, code: int, fields: list[bytes]) -> None:
    try:
        channel.send_bytes(encode(code, request, fields))
    except (OSError, EOFError):
        pass  # the connection is closing; its thread cleans up
