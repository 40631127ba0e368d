"""A state record's bytes on their way from rank 0 to the driver (docs/architecture.md, "Saved state").

``torch.save`` writes each tensor's storage in one call that holds the interpreter's lock for
its whole length (164 ms for one 256 MB tensor on a 2-core host), so a snapshot serialised by
``torch.save`` in the upload thread stalled the training thread for as long. An upload goes
instead as a small header, the record with each tensor replaced by its place (below), then
every tensor's bytes as they lie in memory, cut into pieces that each
cost one copy of a few MiB when pickled into a message. The driver puts the record back
together over one buffer (:func:`assemble`) and writes checkpoints with ``torch.save`` itself,
on its writer thread.

The header is a pickle of plain values (dicts, lists, tuples, strings, numbers, ``torch.Size``),
read by an unpickler that resolves no other name (:class:`PlainValues`): the driver reads one a
snapshot on the cores the workers compute on, and ``torch.load(weights_only=True)`` took ~30
times as long (0.34 ms against 0.01 ms for the tied LM's header). A header holding anything else
(a ``torch.dtype`` in an optimizer's options) is saved with ``torch.save`` and read with
``weights_only=True``, as before.

Layout: the header's length (8 bytes, little-endian), the header, then each tensor's bytes
(C-contiguous) in the header's order.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
from collections.abc import Iterator
from typing import Any

import torch

#: The names a header's pickle may hold besides plain values (everything else: torch.save).
_PLAIN_NAMES: dict[tuple[str, str], Any] = {
    ("builtins", "complex"): complex,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): torch.Size,
}


class PlainValues(pickle.Unpickler):
    """Unpickles plain values only: a name outside ``_PLAIN_NAMES`` raises ``UnpicklingError``, so
    no code runs that the payload names (the pickle documentation's "Restricting Globals")."""

    def find_class(self, module: str, name: str) -> Any:
        found = _PLAIN_NAMES.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not a plain value")
        return found


def _plain_loads(data: bytes) -> Any:
    return PlainValues(io.BytesIO(data)).load()


def header_bytes(header: Any) -> bytes:
    """The header as a plain pickle when it holds plain values only (checked as the driver reads
    it), else as ``torch.save`` writes it."""
    data = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
    try:
        _plain_loads(data)
    except pickle.UnpicklingError:
        saved = io.BytesIO()
        torch.save(header, saved)
        return saved.getvalue()
    return data


def read_header(data: bytes) -> Any:
    """What :func:`header_bytes` made: plain values only, whichever its form."""
    if data[:1] == b"\x80":  # a pickle's first opcode (PROTO); torch.save's zip starts with "PK"
        return _plain_loads(data)
    return torch.load(io.BytesIO(data), weights_only=True)


#: Marks where a tensor stood in the header's skeleton; the value is its index among the tensors.
_TENSOR = "__fabric_tensor__"
_LENGTH = struct.Struct("<Q")


def pieces(record: Any, size: int) -> Iterator[Any]:
    """``record``'s bytes (module docstring) in pieces of at most ``size`` bytes: memory of its
    tensors (``pickle.PickleBuffer``s, copied once when a message holding them is pickled) or
    ``bytes``. ``record``'s tensors must be on the CPU and no longer written to."""
    tensors: list[torch.Tensor] = []
    skeleton = strip(record, tensors)
    header = header_bytes({"skeleton": skeleton, "specs": [(str(t.dtype), tuple(t.shape)) for t in tensors]})
    pending = bytearray(_LENGTH.pack(len(header)) + header)
    for tensor in tensors:
        data = _bytes_of(tensor)
        if len(pending) + len(data) <= size:  # small tensors travel together
            pending += data
            continue
        if pending:
            yield bytes(pending)
            pending = bytearray()
        for start in range(0, len(data), size):
            piece = data[start : start + size]
            if len(piece) < size:  # a tail: the next tensors may join it
                pending += piece
            else:
                yield pickle.PickleBuffer(piece)
    if pending or not tensors:
        yield bytes(pending)


def assemble(data: bytes | bytearray) -> Any:
    """The record :func:`pieces` cut, from its pieces joined; its tensors share ``data``'s memory."""
    buffer = data if isinstance(data, bytearray) else bytearray(data)  # torch.frombuffer wants it writable
    (length,) = _LENGTH.unpack_from(buffer, 0)
    header = read_header(bytes(buffer[8 : 8 + length]))
    offset, tensors = 8 + length, []
    for dtype_name, shape in header["specs"]:
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if offset + nbytes > len(buffer):
            raise ValueError(f"a state's bytes end at {len(buffer)}, before its tensors do ({offset + nbytes})")
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset) if nbytes else None
        tensors.append(flat.view(dtype).view(shape) if flat is not None else torch.empty(shape, dtype=dtype))
        offset += nbytes
    if offset != len(buffer):
        raise ValueError(f"a state's bytes hold {len(buffer) - offset} bytes past its tensors")
    return fill(header["skeleton"], tensors)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data


def strip(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` (a nest of dicts, lists, tuples, plain values and tensors) with each tensor replaced
    by a marker of its place; the tensors are appended to ``tensors`` (detached)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return {_TENSOR: len(tensors) - 1}
    if isinstance(obj, dict):
        return {k: strip(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(strip(v, tensors) for v in obj)
    return obj


def fill(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`strip`: ``skeleton`` with each marker replaced by its tensor."""
    if isinstance(skeleton, dict):
        if len(skeleton) == 1 and _TENSOR in skeleton:
            return tensors[skeleton[_TENSOR]]
        return {k: fill(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(fill(v, tensors) for v in skeleton)
    return skeleton


def encode(record: Any) -> bytes:
    """``record``'s bytes in one piece (what the driver joins the parts of an upload into)."""
    return b"".join(bytes(p.raw()) if isinstance(p, pickle.PickleBuffer) else p for p in pieces(record, 1 << 30))
