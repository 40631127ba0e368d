"""The profiling worker's side: the torch profiler around the window's steps, the phases' times,
and what goes to the driver when the window closes (docs/architecture.md, "Profiling").

Rank 0 of the generation that runs a window's step opens it at that step and closes it after the
window's last (or when its generation ends first: a partial profile); a worker profiles at most
once. Closing stops the profiler, exports its Chrome trace, and sends the driver the trace
(gzip, in parts) and the figures its summary is made of (:mod:`.summary`). Only the profiling
worker pays anything: every other step costs two integer comparisons.
"""

from __future__ import annotations

import gzip
import logging
import os
import tempfile
import time
from typing import Any

from ..settings.profile_window import ProfileWindow
from ..transport import protocol as p
from .phases import Phases

log = logging.getLogger(__name__)

#: Bytes per ProfilePart: heartbeats and step reports pass between them.
PART_BYTES = 4 << 20
#: Operators the summary lists (the profiler's busiest by self CPU time).
TOP_OPERATORS = 8


class StepProfiler:
    """Opens and closes the window around the steps this worker runs as rank 0."""

    def __init__(self, window: ProfileWindow | None, phases: Phases, channel: Any, device: str, worker_id: int) -> None:
        self.window, self.phases, self.channel = window, phases, channel
        self.device, self.worker_id = device, worker_id
        # Outside the window every call is two comparisons: the bounds as plain ints.
        self._first, self._stop = (window.start, window.stop) if window is not None else (-1, -1)
        self._profiler: Any = None
        self._done = window is None
        self._steps = 0
        self._began = 0.0
        self._where = ""

    @property
    def open(self) -> bool:
        return self._profiler is not None

    def step_begins(self, global_step: int, rank: int, world_size: int) -> None:
        """Before step ``global_step``'s unit: opens the window at its first step this worker runs as rank 0."""
        if self._done or self._profiler is not None or not self._first <= global_step < self._stop or rank != 0:
            return
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.start()
        self._where = f"rank 0 of {world_size}"
        self._first_profiled = global_step
        self._steps = 0
        self.phases.open()
        self.phases.calibrate()  # what marking a range costs with the profiler on
        self._began = time.perf_counter()

    def step_ends(self, global_step: int) -> None:
        """After step ``global_step``'s unit (its report, callbacks and fingerprint)."""
        if self._profiler is None:
            return
        self._steps += 1
        if global_step >= self._stop - 1:
            self.close()

    def close(self, partial: bool = False) -> None:
        """Stop, and send the driver the trace and the figures (``partial``: the generation ended first)."""
        if self._profiler is None:
            return
        profiler, self._profiler, self._done = self._profiler, None, True
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()  # the window's kernels are the window's time
        wall = time.perf_counter() - self._began
        phases = self.phases.close()
        profiler.stop()
        figures = {
            "worker": self.worker_id,
            "where": self._where,
            "device": self.device,
            "first": self._first_profiled,
            "steps": self._steps,
            "partial": partial,
            "wall": wall,
            "phases": phases,
            "device_phases": _device_times(profiler, phases),
            "operators": _busiest(profiler),
        }
        try:
            trace = gzip.compress(_chrome_trace(profiler), compresslevel=1)
        except Exception as exc:  # the figures still matter without the trace
            log.warning("the profiler's trace could not be exported: %s", exc)
            trace = b""
        parts = max(1, -(-len(trace) // PART_BYTES))
        for i in range(parts):
            last = i == parts - 1
            data = trace[i * PART_BYTES : (i + 1) * PART_BYTES]
            self.channel.send(p.ProfilePart(i, data, last, figures if last else None))
        first, steps = self._first_profiled, self._steps
        log.info("profile of %d step(s) from step %d sent (%d bytes of trace)", steps, first, len(trace))


def _chrome_trace(profiler: Any) -> bytes:
    handle, path = tempfile.mkstemp(suffix=".pt.trace.json")
    os.close(handle)
    try:
        profiler.export_chrome_trace(path)
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


def _ours(name: str) -> bool:
    return name.startswith(("fabric_model/", "user/", "profiling/", "ProfilerStep"))


def _busiest(profiler: Any) -> list[tuple[str, float, float]]:
    """(operator, self CPU seconds, self device seconds) of the busiest operators in the window."""
    rows = []
    for event in profiler.key_averages():
        if _ours(event.key):
            continue
        device = getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)) or 0.0
        rows.append((event.key, event.self_cpu_time_total / 1e6, device / 1e6))
    rows.sort(key=lambda r: max(r[1], r[2]), reverse=True)
    return rows[:TOP_OPERATORS]


def _device_times(profiler: Any, phases: dict[str, float]) -> dict[str, float]:
    """Per named range, the device time of the kernels it launched (seconds; none on a CPU)."""
    times = {}
    for event in profiler.key_averages():
        if event.key in phases:
            device = getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0.0)) or 0.0
            if device:
                times[event.key] = device / 1e6
    return times
