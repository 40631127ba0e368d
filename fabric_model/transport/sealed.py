"""The control plane's connection: the secret proven both ways, then every frame MAC'd.

:mod:`multiprocessing.connection`'s HMAC challenge, run both ways, proves when a connection
opens that the peer holds the job's secret; it says nothing of the frames that follow, which a
peer on the network path could alter, inject or replay. So after the challenge each side sends
a fresh nonce, both derive a key for this connection alone::

    key = HMAC-SHA256(secret, b"fabric-model control" + accepting side's nonce + connecting side's nonce)

and every later frame carries ``HMAC-SHA256(key, direction + sequence number + payload)``,
checked before the payload is handed to anyone (so before anything is unpickled). The sequence
number is not sent: each side counts its frames, so a replayed, dropped or reordered frame fails
the check as surely as an altered one; the direction byte keeps a frame from being reflected
back to its sender. A frame that fails ends the connection (:class:`TamperedFrame`, an
``OSError``, so every caller treats it as a lost connection), logged once.

On the wire a frame is framed as :mod:`multiprocessing.connection` frames it (a signed 4-byte
big-endian length, or -1 and an 8-byte length), so the handshake is multiprocessing's own and
the driver's one reader thread (:mod:`fabric_model.transport.reader`) cuts the frames; its body
is the 32-byte tag, then the payload. The traffic is authenticated, not encrypted
(docs/clusters.md, "Security").
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

log = logging.getLogger(__name__)

#: Bytes of each side's nonce, and of a frame's tag (HMAC-SHA256).
NONCE = TAG = 32
#: What the per-connection key is derived for (no other use of the secret derives the same key).
LABEL = b"fabric-model control"
#: Payloads up to this size go out with their header in one buffer (a copy cheaper than a second
#: write); larger ones are written from the caller's buffer, never copied.
SMALL = 1 << 14
#: Payloads up to this size are read into one buffer of their announced size; a larger length (all
#: an injected header needs to claim) only gets memory as its bytes actually arrive.
PREALLOCATE = 1 << 24

_SHORT = struct.Struct("!i")
_LONG = struct.Struct("!iQ")
_SEQUENCE = struct.Struct("!Q")


class TamperedFrame(ConnectionError):
    """A frame failed its MAC: altered, injected, replayed or out of order. The connection is over."""


class SealedConnection(Connection):
    """A :class:`multiprocessing.connection.Connection` whose frames, after :meth:`handshake`, are MAC'd.

    ``send_bytes`` may be called from several threads (a lock keeps each frame whole and its
    sequence number in order); frames are received by one thread at a time, through
    ``recv_bytes``, :meth:`recv_buffer` or :meth:`open_frame`."""

    def __init__(self, fd: int, accepting: bool) -> None:
        super().__init__(fd)
        self._accepting = accepting
        self._key = b""
        self._mac: hmac.HMAC | None = None  # keyed, fed nothing yet: copied for each large frame
        self._send_prefix, self._recv_prefix = (b"s", b"c") if accepting else (b"c", b"s")
        self._sent = self._received = 0
        self._send_lock = threading.Lock()
        self._refused = False

    def handshake(self, secret: bytes) -> None:
        """Prove the secret both ways (multiprocessing's challenge), then derive this connection's key.

        Raises ``AuthenticationError`` when the peer does not hold ``secret``, ``EOFError`` or
        ``OSError`` when it goes away. Bound it from outside (shut the socket down on a timer)."""
        try:
            if self._accepting:
                deliver_challenge(self, secret)
                answer_challenge(self, secret)
            else:
                answer_challenge(self, secret)
                deliver_challenge(self, secret)
        except AssertionError as exc:  # multiprocessing asserts that a challenge looks like one
            raise AuthenticationError("the peer's challenge is not one") from exc
        # Both sides send before they read: the nonces cross, costing half a round trip, not one.
        mine = os.urandom(NONCE)
        super().send_bytes(mine)
        theirs = super().recv_bytes(NONCE)
        if len(theirs) != NONCE:
            raise AuthenticationError(f"the peer's nonce has {len(theirs)} bytes, not {NONCE}")
        nonces = mine + theirs if self._accepting else theirs + mine
        self._key = hmac.digest(secret, LABEL + nonces, "sha256")
        self._mac = hmac.new(self._key, digestmod=hashlib.sha256)

    # -- sending -----------------------------------------------------------------------------
    def send_bytes(self, buf: ReadableBuffer, offset: int = 0, size: int | None = None) -> None:
        """Send one frame: the tag over (direction, sequence number, payload), then the payload."""
        if self._mac is None:  # the handshake's own messages
            super().send_bytes(buf, offset, size)
            return
        view: bytes | memoryview
        if type(buf) is bytes and not offset and size is None:
            view = buf  # the common case, taken as it is
        else:
            whole = memoryview(buf).cast("B")
            view = whole[offset:] if size is None else whole[offset : offset + size]
        length = TAG + len(view)
        header = _SHORT.pack(length) if length <= 0x7FFFFFFF else _LONG.pack(-1, length)
        with self._send_lock:
            prefix = self._send_prefix + _SEQUENCE.pack(self._sent)
            if len(view) <= SMALL:
                tag = hmac.digest(self._key, prefix + view, "sha256")  # one C call: cheapest for small frames
                self._write((header + tag + view,))
            else:
                mac = self._mac.copy()
                mac.update(prefix)
                mac.update(view)  # over the caller's buffer, in place
                self._write((header + mac.digest(), view))
            self._sent += 1

    def _write(self, parts: tuple[bytes | memoryview, ...]) -> None:
        """Write ``parts`` whole, gathered (``writev``): the payload is not copied into a frame."""
        fd = self.fileno()
        if len(parts) == 1:
            written = os.write(fd, parts[0])
            if written == len(parts[0]):
                return
            parts = (memoryview(parts[0])[written:],)
        views = [memoryview(part) for part in parts]
        while views:
            written = os.writev(fd, views)
            while views and written >= len(views[0]):
                written -= len(views.pop(0))
            if written:
                views[0] = views[0][written:]

    # -- receiving ---------------------------------------------------------------------------
    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        """The next frame's payload, checked; ``EOFError`` on close, :class:`TamperedFrame` if it fails."""
        if self._mac is None:  # the handshake's own messages
            return super().recv_bytes(maxlength)
        payload = self.recv_buffer()
        if maxlength is not None and len(payload) > maxlength:
            self._refuse(f"a frame of {len(payload)} bytes, over the {maxlength} expected")
        return bytes(payload)

    def recv_buffer(self) -> bytes | bytearray:
        """:meth:`recv_bytes` without the copy into ``bytes`` (``pickle.loads`` takes the buffer)."""
        if self._mac is None:
            raise AuthenticationError("the connection has not completed its handshake")
        if self._refused:
            raise TamperedFrame("this connection already carried a frame that failed its check")
        # The length and the tag in one read (every frame has both), then the payload: two reads a
        # frame, as multiprocessing makes, and never a byte past the frame (the driver's reader
        # thread takes over the socket after the first message).
        head = self._read(_SHORT.size + TAG, at_start=True)
        (length,) = _SHORT.unpack_from(head)
        if length == -1:  # the long form: an 8-byte length, then the tag
            head += self._read(8)
            (_, length), tag = _LONG.unpack_from(head), bytes(head[_LONG.size :])
        else:
            tag = bytes(head[_SHORT.size :])
        if length < TAG:
            self._refuse(f"a frame of {length} bytes, shorter than its tag")
        payload = self._read(length - TAG)
        self._check(tag, payload)
        return payload

    def open_frame(self, frame: bytes) -> memoryview:
        """The payload of a frame body read by someone else (tag, then payload; the driver's reader
        thread cuts them), checked as :meth:`recv_bytes` checks its own: the next in sequence."""
        if self._mac is None:
            raise AuthenticationError("the connection has not completed its handshake")
        if self._refused:
            raise TamperedFrame("this connection already carried a frame that failed its check")
        if len(frame) < TAG:
            self._refuse(f"a frame of {len(frame)} bytes, shorter than its tag")
        view = memoryview(frame)
        self._check(view[:TAG], view[TAG:])
        return view[TAG:]

    def _check(self, tag: bytes | memoryview, payload: bytes | bytearray | memoryview) -> None:
        assert self._mac is not None
        prefix = self._recv_prefix + _SEQUENCE.pack(self._received)
        if len(payload) <= SMALL:
            expected = hmac.digest(self._key, prefix + payload, "sha256")
        else:
            mac = self._mac.copy()  # one key both ways: the direction byte tells them apart
            mac.update(prefix)
            mac.update(payload)
            expected = mac.digest()
        if not hmac.compare_digest(expected, tag):
            self._refuse("a frame failed its integrity check (altered, injected, replayed or out of order)")
        self._received += 1

    def _read(self, size: int, at_start: bool = False) -> bytes | bytearray:
        """Exactly ``size`` bytes, a long frame read in place; its memory grows only as it arrives."""
        fd = self.fileno()
        if size <= SMALL:  # most frames: one read returns them whole, with no buffer to fill
            data = os.read(fd, size)
            if len(data) == size:
                return data
            if not data:
                raise self._ended(at_start)
            buffer, filled = bytearray(data) + bytes(size - len(data)), len(data)
        else:
            buffer, filled = bytearray(min(size, PREALLOCATE)), 0
        while filled < size:
            if filled == len(buffer):
                buffer.extend(bytes(min(size - filled, PREALLOCATE)))
            with memoryview(buffer) as view:
                got = os.readv(fd, [view[filled:]])
            if got == 0:
                raise self._ended(at_start and filled == 0)
            filled += got
        return buffer

    @staticmethod
    def _ended(between_frames: bool) -> Exception:
        if between_frames:
            return EOFError("the peer closed the connection")
        return OSError("the connection ended in the middle of a frame")

    def _refuse(self, why: str) -> None:
        """Log once, end the connection both ways (shut down, so that no thread sending or reading on
        it waits; its owner closes the descriptor), and raise :class:`TamperedFrame`."""
        if not self._refused:
            self._refused = True
            log.warning("control plane: closing a connection: %s", why)
            shut_down(self)
        raise TamperedFrame(why)


def dial(address: tuple[str, int], secret: bytes, timeout: float | None = None) -> SealedConnection:
    """A sealed connection to the listener at ``address``, the handshake done within ``timeout``
    seconds (connecting included; None: unbounded)."""
    sock = socket.create_connection(address, timeout=timeout)
    sock.settimeout(None)  # reads block; the timer below bounds the handshake
    conn = SealedConnection(sock.detach(), accepting=False)
    handshake(conn, secret, timeout)
    return conn


def handshake(conn: SealedConnection, secret: bytes, timeout: float | None) -> None:
    """``conn.handshake(secret)``, the connection shut down if it has not ended within ``timeout``
    seconds; on any failure the connection is closed and the error raised."""
    timer = threading.Timer(timeout, shut_down, args=(conn,)) if timeout is not None else None
    if timer is not None:
        timer.start()
    try:
        conn.handshake(secret)
    except BaseException:
        conn.close()
        raise
    finally:
        if timer is not None:
            timer.cancel()


def shut_down(conn: Connection) -> None:
    """Wake a thread blocked reading ``conn`` (closing the descriptor alone does not)."""
    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
    except OSError:
        return  # already closed
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()
