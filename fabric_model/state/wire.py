"""A state record's bytes on their way from rank 0 to the driver (docs/architecture.md, "Saved state").

``torch.save`` writes each tensor's storage in one call that holds the interpreter's lock for
its whole length (164 ms for one 256 MB tensor on a 2-core host), so a snapshot serialised by
``torch.save`` in the upload thread stalled the training thread for as long. An upload goes
instead as a small header, the record with each tensor replaced by its place, saved with
``torch.save``, then every tensor's bytes as they lie in memory, cut into pieces that each
cost one copy of a few MiB when pickled into a message. The driver puts the record back
together over one buffer (:func:`assemble`; the header is read with ``weights_only=True``) and
writes checkpoints with ``torch.save`` itself, on its writer thread.

Layout: the header's length (8 bytes, little-endian), the header, then each tensor's bytes
(C-contiguous) in the header's order.
"""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Iterator
from typing import Any

import torch

#: Marks where a tensor stood in the header's skeleton; the value is its index among the tensors.
_TENSOR = "__fabric_tensor__"
_LENGTH = struct.Struct("<Q")


def pieces(record: Any, size: int) -> Iterator[Any]:
    """``record``'s bytes (module docstring) in pieces of at most ``size`` bytes: memory of its
    tensors (``pickle.PickleBuffer``s, copied once when a message holding them is pickled) or
    ``bytes``. ``record``'s tensors must be on the CPU and no longer written to."""
    tensors: list[torch.Tensor] = []
    skeleton = strip(record, tensors)
    header = io.BytesIO()
    torch.save({"skeleton": skeleton, "specs": [(str(t.dtype), tuple(t.shape)) for t in tensors]}, header)
    pending = bytearray(_LENGTH.pack(len(header.getvalue())) + header.getvalue())
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
    header = torch.load(io.BytesIO(bytes(buffer[8 : 8 + length])), weights_only=True)
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
