"""Handing a replica's state (weights, optimizer state) to the members of a generation that need it.

The tensors travel as one flat buffer per dtype, broadcast in place by the collective. Only
a small skeleton goes as bytes: the nesting, the plain values, and each tensor's dtype and
shape, as an upload's header goes (state/wire.py, ``header_bytes``), so nothing but plain
values is ever unpickled. Pickling the whole state to bytes and broadcasting those instead costs a join
three extra copies of every tensor (save, bytes to tensor, tensor to bytes) and a load,
about 0.3 s for 76 MB (see docs/architecture.md, "Elasticity").
"""

from __future__ import annotations

from typing import Any

import torch

from .wire import fill, header_bytes, read_header, strip


def broadcast_state(collective: Any, state: Any, source: int) -> Any:
    """``state`` (a nest of dicts, lists, tuples, plain values and tensors) from rank ``source``
    to every rank of ``collective``; other ranks pass None and get a copy (tensors on the CPU)."""
    tensors: list[torch.Tensor] = []
    header = None
    if collective.rank == source:
        skeleton = strip(state, tensors)
        header = header_bytes({"skeleton": skeleton, "specs": [(str(t.dtype), tuple(t.shape)) for t in tensors]})
    decoded = read_header(collective.broadcast_bytes(header, source))
    if collective.rank == source:
        _send(collective, tensors, source)
        return state
    specs = [(getattr(torch, name.removeprefix("torch.")), tuple(shape)) for name, shape in decoded["specs"]]
    return fill(decoded["skeleton"], _receive(collective, specs, source))


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a dtype travels as: bool as bytes (not every backend reduces bools)."""
    return torch.uint8 if dtype == torch.bool else dtype


def _groups(specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> dict[torch.dtype, list[int]]:
    """Tensor indices by wire dtype, in order of first appearance (the same on every rank)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, (dtype, _) in enumerate(specs):
        groups.setdefault(_wire_dtype(dtype), []).append(i)
    return groups


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _receive(collective: Any, specs: list[tuple[torch.dtype, tuple[int, ...]]], source: int) -> list[torch.Tensor]:
    """Receive every tensor of ``specs``: one broadcast per wire dtype."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(specs)
    for wire, indices in _groups(specs).items():
        sizes = [_numel(specs[i][1]) for i in indices]
        flat = torch.empty(sum(sizes), dtype=wire, device=collective.device)
        collective.broadcast(flat, source)
        flat = flat.cpu()
        for i, part in zip(indices, torch.split(flat, sizes)):
            dtype, shape = specs[i]
            out[i] = part.view(shape) if dtype == wire else part.view(shape).to(dtype)
    return out


def _send(collective: Any, tensors: list[torch.Tensor], source: int) -> None:
    """The source's side of :func:`_receive`: the same broadcasts, from its tensors."""
    specs = [(t.dtype, tuple(t.shape)) for t in tensors]
    for wire, indices in _groups(specs).items():
        # Each part to the collective's device first: one state mixes devices (on a GPU, Adam's
        # ``step`` counts stay CPU tensors beside moments on the GPU), which torch.cat refuses.
        parts = [tensors[i].reshape(-1).to(device=collective.device, dtype=wire) for i in indices]
        flat = torch.cat(parts) if parts else torch.empty(0, dtype=wire, device=collective.device)
        collective.broadcast(flat, source)
