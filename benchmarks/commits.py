"""Step times from the driver's commit stamps (``logs/metrics.jsonl``), however the reports arrive.

A lone worker sends its step reports ~0.1 s at a time (``worker/inbox.py``, ``REPORT_WITHIN``),
each frame right after its last step, and the driver commits a frame's steps one after another,
~0.1 ms apart: only a frame's last stamp is its step's time, the others are up to a frame late.
A span that starts at an arbitrary stamp is short by up to a frame (7% of a 1.3 s span), and
the intervals between consecutive stamps are ~0 inside a frame. So spans run from frame end to
frame end, and a step's time is a frame's time over its steps; the run's last stamp is no frame
end (``frame_ends``). A generation of several sends each report at once: a stamp further than
``FRAME_GAP`` from the next ends its frame there too, and steps shorter than that group into
frames whose ends are as exact.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

#: Stamps further apart than this are in different frames (the driver commits a frame's steps
#: ~0.1 ms apart; a preemption inside one can split it, which moves a median little).
FRAME_GAP = 0.001


def train_stamps(run_dir: Path) -> list[float]:
    """The commit stamps of a run's steps, in step order."""
    lines = (Path(run_dir) / "logs" / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r.get("type") == "train"]
    return [r["time"] for r in sorted(records, key=lambda r: r["iteration"])]


def frame_ends(times: list[float], first: int = 0) -> list[int]:
    """Indices from ``first`` on of the stamps that end a frame (the next is ``FRAME_GAP`` later).
    The last stamp is left out: a report held at the run's end (a validation after the last step,
    the final state) waits up to a frame for the heartbeat thread's flush."""
    return [i for i in range(first, len(times) - 1) if times[i + 1] - times[i] > FRAME_GAP]


def mean_step(times: list[float], warmup: int) -> float:
    """Seconds a step between the ends of the first frame holding step ``warmup`` (0-based) or
    later and of the last frame."""
    ends = frame_ends(times, warmup)
    if len(ends) < 2:
        raise ValueError(f"fewer than two frames end between step {warmup} and the last: run more steps")
    return (times[ends[-1]] - times[ends[0]]) / (ends[-1] - ends[0])


def median_step(times: list[float], warmup: int) -> float:
    """The median over frames after step ``warmup`` of a frame's time over its steps: a frame slowed
    down by other load on the machine does not move it."""
    ends = frame_ends(times, warmup)
    per_step = [(times[b] - times[a]) / (b - a) for a, b in zip(ends, ends[1:])]
    if not per_step:
        raise ValueError(f"fewer than two frames after step {warmup}: run more steps")
    return statistics.median(per_step)
