"""The rendezvous store's wire format: small explicit frames, never pickle.

A store connection is a control-plane connection (HMAC-authenticated both ways, then every
frame MAC'd: :mod:`fabric_model.transport.sealed`) whose first message is
:class:`~fabric_model.transport.protocol.StoreOpen`; after it, each request and each reply is
one frame (docs/architecture.md, "Processes")::

    frame  = code:u8  request:u32  then, per field,  length:u32  bytes
    request code: an :class:`Op`;  reply code: ``OK`` or ``ERROR`` (one field: the reason)

Requests carry an id because replies may come out of order: a ``GET`` or ``WAIT`` for a key
not yet set is answered when another member sets it, while the same connection's other
requests are answered at once.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence

#: Reply codes.
OK, ERROR = 0, 1

_HEADER = struct.Struct("!BI")
_LENGTH = struct.Struct("!I")
#: The most fields one frame may carry (a multi-get of every rank's key stays far below).
MAX_FIELDS = 1 << 16


class Op(enum.IntEnum):
    """The store operations; each names its request fields and its reply's."""

    SET = 1  # key, value -> ()
    GET = 2  # key -> value; waits for the key
    WAIT = 3  # key... -> (); waits for every key
    CHECK = 4  # key... -> b"1" if every key is set, else b"0"
    ADD = 5  # key, amount (ASCII integer) -> the new value (ASCII integer)
    COMPARE_SET = 6  # key, expected, desired -> the value now held
    DELETE = 7  # key -> b"1" if it existed, else b"0"
    NUM_KEYS = 8  # () -> the number of keys (ASCII integer)
    MULTI_GET = 9  # key... -> value...; waits for every key
    MULTI_SET = 10  # key, value, key, value... -> ()
    APPEND = 11  # key, value -> ()
    CANCEL = 12  # () -> no reply: forget the waiting request with this id (the client timed out)


#: Operations that may wait for keys another member has not set yet.
BLOCKING = frozenset({Op.GET, Op.WAIT, Op.MULTI_GET})


def encode(code: int, request: int, fields: Sequence[bytes] = ()) -> bytes:
    """One frame: ``code`` (an :class:`Op`, or ``OK``/``ERROR``), the request id, the fields."""
    parts = [_HEADER.pack(code, request)]
    for field in fields:
        parts += [_LENGTH.pack(len(field)), bytes(field)]
    return b"".join(parts)


def decode(frame: bytes) -> tuple[int, int, list[bytes]]:
    """``(code, request, fields)`` of a frame; ``ValueError`` if it is malformed."""
    if len(frame) < _HEADER.size:
        raise ValueError(f"a store frame of {len(frame)} bytes is shorter than its header")
    code, request = _HEADER.unpack_from(frame)
    fields: list[bytes] = []
    offset = _HEADER.size
    while offset < len(frame):
        if len(fields) >= MAX_FIELDS or offset + _LENGTH.size > len(frame):
            raise ValueError("a store frame has a truncated field or too many fields")
        (length,) = _LENGTH.unpack_from(frame, offset)
        offset += _LENGTH.size
        if offset + length > len(frame):
            raise ValueError(f"a store frame's field of {length} bytes runs past its end")
        fields.append(frame[offset : offset + length])
        offset += length
    return code, request, fields
