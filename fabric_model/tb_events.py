"""A TensorBoard event file writer for scalars, without TensorFlow or tensorboard (a leaf module).

An event file is a sequence of TFRecords, each ``length (u64) | masked crc32c(length) | data |
masked crc32c(data)``, whose data is an ``Event`` protobuf: ``wall_time`` (field 1, double),
``step`` (2, int64), then ``file_version`` (3, string) for the first record or ``summary`` (5)
holding ``Summary.Value``s (field 1) of ``tag`` (1, string) and ``simple_value`` (2, float).
Those few fields are encoded here by hand; tests read the files back with tensorboard's own
``EventAccumulator``. Why not depend on tensorboard: it is a large package (and pulls protobuf
and grpc) for what is about 80 lines, and not every user wants it.
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


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord framing uses it."""
    table, crc = _crc_table(), 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
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


def scalar_event(tag: str, value: float, step: int, wall_time: float) -> bytes:
    """One ``Event`` protobuf holding one scalar."""
    summary_value = _field_bytes(1, tag.encode()) + b"\x15" + struct.pack("<f", float(value))
    return _event(wall_time, step, _field_bytes(5, _field_bytes(1, summary_value)))


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
        self._write(_event(now, 0, _field_bytes(3, b"brain.Event:2")))
        self.flush()

    def _write(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._file.write(header + struct.pack("<I", _masked_crc(header)) + data + struct.pack("<I", _masked_crc(data)))

    def scalar(self, tag: str, value: float, step: int, wall_time: float | None = None) -> None:
        self._write(scalar_event(tag, value, step, time.time() if wall_time is None else wall_time))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
