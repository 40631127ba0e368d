"""A TensorBoard event file writer for scalars, without TensorFlow or tensorboard (a leaf module).

An event file is a sequence of TFRecords, each ``length (u64) | masked crc32c(length) | data |
masked crc32c(data)``, whose data is an ``Event`` protobuf: ``wall_time`` (field 1, double),
``step`` (2, int64), then ``file_version`` (3, string) for the first record or ``summary`` (5)
holding ``Summary.Value``s (field 1) of ``tag`` (1, string) and ``simple_value`` (2, float).
Those few fields are encoded here by hand; tests read the files back with tensorboard's own
``EventAccumulator``. Why not depend on tensorboard: it is a large package (and pulls protobuf
and grpc) for what is about 80 lines, and not every user wants it.

The driver writes a scalar per metric per committed step, on the cores the workers compute on,
so a scalar's record is cheap to make: its ``summary`` comes first (protobuf fields may come in
any order), so the bytes up to its value, and their CRC, are made once per tag; only the value,
the time and the step are encoded and checksummed each time.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

_CRC_TABLE: list[int] = []


def _crc_table() -> list[int]:
    if not _CRC_TABLE:
        for n in range(256):
            c = n
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli polynomial, reflected
            _CRC_TABLE.append(c)
    return _CRC_TABLE


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C (Castagnoli), as TFRecord framing uses it; ``crc``: that of bytes before ``data``."""
    table, crc = _crc_table(), crc ^ 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _mask(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    return _mask(crc32c(data))


_SMALL_VARINTS = [bytes((n,)) for n in range(128)]


def _varint(value: int) -> bytes:
    if 0 <= value < 128:
        return _SMALL_VARINTS[value]  # field keys, lengths, early steps
    value &= (1 << 64) - 1  # int64 fields are two's complement varints
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, body: bytes) -> bytes:
    return b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step) + body


def _scalar_prefix(tag: str) -> bytes:
    """An ``Event``'s ``summary`` field holding one value of ``tag``, up to the value's 4 bytes."""
    value = _field_bytes(1, tag.encode()) + b"\x15"  # Summary.Value: tag, then simple_value's key
    summary = _varint(1 << 3 | 2) + _varint(len(value) + 4) + value  # Summary: its value (field 1)
    return _varint(5 << 3 | 2) + _varint(len(summary) + 4) + summary  # Event: its summary (field 5)


class EventWriter:
    """Appends scalars to a new ``events.out.tfevents.*`` file in ``directory``.

    Records are flushed by :meth:`flush` (the caller decides how often) and on :meth:`close`.
    """

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        now = time.time()
        name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.fabric"
        self.path = directory / name
        self._file = open(self.path, "wb")
        self._headers: dict[int, bytes] = {}  # record length -> its framing header
        self._prefixes: dict[str, tuple[bytes, int]] = {}  # tag -> (its summary's bytes, their CRC)
        self._write(_event(now, 0, _field_bytes(3, b"brain.Event:2")))
        self.flush()

    def _write(self, data: bytes, data_crc: int | None = None) -> None:
        size = len(data)
        header = self._headers.get(size)
        if header is None:  # a record's length and its CRC: a few distinct lengths per run
            length = struct.pack("<Q", size)
            header = self._headers[size] = length + struct.pack("<I", _masked_crc(length))
        crc = crc32c(data) if data_crc is None else data_crc
        self._file.write(header + data + struct.pack("<I", _mask(crc)))

    def scalar(self, tag: str, value: float, step: int, wall_time: float | None = None) -> None:
        """One ``Event`` holding one scalar: its summary first, then its value, time and step."""
        prefix = self._prefixes.get(tag)
        if prefix is None:
            summary = _scalar_prefix(tag)
            prefix = self._prefixes[tag] = (summary, crc32c(summary))
        rest = struct.pack("<f", float(value)) + _event(time.time() if wall_time is None else wall_time, step, b"")
        self._write(prefix[0] + rest, crc32c(rest, prefix[1]))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
