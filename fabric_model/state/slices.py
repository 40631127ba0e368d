"""Which worker holds which slice of the flat parameter space when optimizer state is sharded
(``train(shard_optimizer_state=True)``; docs/elasticity.md, "Sharded optimizer state").

A leaf module of plain integers (no framework import). The flat space is the optimizer's
parameters end to end, in its ``state_dict`` order. A generation of ``world`` members cuts it
into ``world`` contiguous slices and puts its members in a cycle (:func:`cycle`: members of one
host apart where it can); the member at position ``k`` owns slice ``k`` and is the buddy of
slice ``k - 1``: it holds both, so any single member's loss, and where the cycle alternates
hosts any single host's, leaves every slice held. Entering a generation, the members say what
they hold (:class:`Holding`); :func:`sources` says who hands each stretch of the space on, or
which stretches nobody holds any more.
"""

from __future__ import annotations

import dataclasses
import hashlib
import socket
from collections.abc import Sequence
from pathlib import Path


def bounds(total: int, world: int) -> list[tuple[int, int]]:
    """The ``world`` slices of ``[0, total)``: contiguous, sizes differing by at most one."""
    if world < 1:
        raise ValueError(f"a division needs at least one member, not {world}")
    base, extra = divmod(total, world)
    cuts, start = [], 0
    for r in range(world):
        end = start + base + (1 if r < extra else 0)
        cuts.append((start, end))
        start = end
    return cuts


def cycle(hosts: Sequence[int]) -> list[int]:
    """Each member's position in the cycle of slices, by rank (``hosts``: one key per member's
    host). The members, grouped by host, the largest group first, fill the even positions, then
    the odd ones: a member's buddy (the next position) is on another host unless one host has
    more than half the members."""
    by_host: dict[int, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    if len(by_host) == 1:  # one host: ranks in order
        return list(range(len(hosts)))
    grouped = [rank for ranks in sorted(by_host.values(), key=lambda r: (-len(r), r[0])) for rank in ranks]
    slots = [*range(0, len(hosts), 2), *range(1, len(hosts), 2)]
    positions = [0] * len(hosts)
    for slot, rank in zip(slots, grouped):
        positions[rank] = slot
    return positions


def host_key() -> int:
    """This host's key for :func:`cycle`: its name and this boot's id, hashed to 62 bits (two
    containers of one machine share a boot id: they are lost together when it goes)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    digest = hashlib.sha256(f"{socket.gethostname()}/{boot}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 2


def held_slices(position: int, world: int) -> tuple[int, ...]:
    """The slices the member at ``position`` holds: its own, then the one it is the buddy of."""
    return (position,) if world == 1 else (position, (position - 1) % world)


def held_intervals(position: int, world: int, total: int) -> list[tuple[int, int]]:
    """``held_slices`` as sorted, merged intervals of the flat space (empty ones left out)."""
    cuts = bounds(total, world)
    return merge([cuts[s] for s in held_slices(position, world)])


def merge(intervals: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, with touching or overlapping intervals joined and empty ones dropped."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def covers(outer: Sequence[tuple[int, int]], inner: Sequence[tuple[int, int]]) -> bool:
    """Whether every element of ``inner`` lies in ``outer`` (both merged)."""
    return all(any(a <= start and end <= b for a, b in outer) for start, end in inner)


@dataclasses.dataclass(frozen=True)
class Holding:
    """What one member of a generation being entered holds of the sharded state.

    ``unit``: the unit its held state is at (-1: it holds none, a newcomer); ``position`` and
    ``world``: the division it holds by (its position in the cycle of the last generation it
    entered, or ``(0, 1)``: the whole space, as every worker does at the start and after
    loading a complete state); ``whole``: whether its
    parameters are all current (False once a step's gather of updated slices failed);
    ``host``: a key of the host it runs on (:func:`cycle`)."""

    unit: int
    position: int
    world: int
    whole: bool = True
    host: int = 0

    def row(self) -> list[int]:
        return [self.unit, self.position, self.world, int(self.whole), self.host]

    @classmethod
    def of_row(cls, row: Sequence[int]) -> Holding:
        unit, position, world, whole, host = (int(v) for v in row)
        return cls(unit, position, world, bool(whole), host)

    def intervals(self, total: int, unit: int) -> list[tuple[int, int]]:
        """What it holds of the state of ``unit`` (nothing when it is elsewhere)."""
        if self.unit != unit or self.world < 1:
            return []
        return held_intervals(self.position, self.world, total)


class StateLost(Exception):
    """No member of a generation holds some stretch of the sharded optimizer state (an owner and
    its buddy were lost together): the job rolls back to the newest saved state."""


def sources(holdings: Sequence[Holding], unit: int, total: int) -> list[tuple[int, int, int]]:
    """``(start, end, rank)`` stretches covering ``[0, total)``: the lowest new rank that holds
    each stretch of the state of ``unit`` hands it on. Raises :class:`StateLost` naming the
    stretches nobody holds."""
    held = [h.intervals(total, unit) for h in holdings]
    cuts = sorted({0, total, *(x for intervals in held for i in intervals for x in i)})
    out: list[tuple[int, int, int]] = []
    lost: list[tuple[int, int]] = []
    for start, end in zip(cuts, cuts[1:]):
        if end <= start or end > total:
            continue
        rank = next((r for r, intervals in enumerate(held) if any(a <= start and end <= b for a, b in intervals)), -1)
        if rank < 0:
            lost.append((start, end))
        elif out and out[-1][2] == rank and out[-1][1] == start:
            out[-1] = (out[-1][0], end, rank)
        else:
            out.append((start, end, rank))
    if lost:
        stretches = ", ".join(f"[{a}, {b})" for a, b in merge(lost)[:4])
        raise StateLost(
            f"no member holds elements {stretches} of the sharded optimizer state of unit {unit} "
            f"(of {total}): their owner and its buddy were both lost"
        )
    return out
