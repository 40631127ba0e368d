"""Where start-up went: from ``train()`` to the first committed step, in phases (a leaf module).

The caller marks the end of each of its phases on one clock (``time.monotonic``); the driver
marks the first worker's arrival, readiness, the first generation and the first commit; the
first worker reports how long its own set-up took inside that (``Ready.phases``) and how long
entering the first generation took (``Entered``). :meth:`StartUp.record` writes them once, to
``run.json``'s ``startup`` (docs/run-directory.md; docs/architecture.md, "Start-up"), so a slow
start can be named: ``benchmarks/bench_startup.py`` prints them.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

#: The caller's and the driver's marks, in order: each names the phase that ends there.
CALLER_PHASES = ("argument checks", "first-batch check", "shipping the job", "run directory and driver")
DRIVER_PHASES = ("process start", "worker set-up", "waiting for the first generation", "entering it")
#: What the first worker reports of its set-up (inside "worker set-up") and of entering (inside "entering it").
WORKER_SET_UP = ("unpickling the job", "device init", "state to the device", "datasets_function")
WORKER_ENTERING = ("group formed", "state loaded or pulled")


class StartUp:
    """The start-up's marks and the first worker's durations, until :meth:`record`."""

    def __init__(self, began: float | None = None) -> None:
        self.began = time.monotonic() if began is None else began
        self._marks: dict[str, float] = {}
        self._worker: dict[str, dict[str, float]] = {"worker set-up": {}, "entering it": {}}
        self.notes: dict[str, str] = {}
        self.recorded = False

    def note(self, name: str, text: str) -> None:
        """A fact that explains the phases (``"warm process"``: how the local workers' processes start)."""
        self.notes[name] = text

    def mark(self, phase: str) -> None:
        """``phase`` ends now (the first mark of a name stands)."""
        self._marks.setdefault(phase, time.monotonic())

    def marked(self, phase: str) -> bool:
        return phase in self._marks

    def worker(self, within: str, phases: Mapping[str, float]) -> None:
        """The first worker's own durations inside the driver's phase ``within`` (the first report stands)."""
        if not self._worker[within]:
            self._worker[within] = {k: float(v) for k, v in phases.items()}

    def phases(self) -> dict[str, Any]:
        """``{"phases": [[name, seconds], ...], "total": seconds}``; a worker's parts follow the
        phase that holds them, indented by two spaces, then what that phase spent besides."""
        rows: list[list[Any]] = []
        last = self.began
        for phase in (*CALLER_PHASES, *DRIVER_PHASES, "first step"):
            if phase not in self._marks:
                continue
            seconds = self._marks[phase] - last
            last = self._marks[phase]
            rows.append([phase, round(seconds, 4)])
            parts = self._worker.get(phase, {})
            if parts:
                for name, part in parts.items():
                    rows.append([f"  {name}", round(part, 4)])
                rows.append([f"  the rest of {phase}", round(max(0.0, seconds - sum(parts.values())), 4)])
        record: dict[str, Any] = {"phases": rows, "total": round(last - self.began, 4)}
        if self.notes:
            record["notes"] = dict(self.notes)
        return record

    def record(self, run_json: Any) -> None:
        """Add ``"startup"`` to ``run.json`` (once; best effort, never raised: start-up is done)."""
        if self.recorded:
            return
        self.recorded = True
        from .rundir import atomic_write

        try:
            record = json.loads(run_json.read_text())
            record["startup"] = self.phases()
            data = json.dumps(record, indent=2, default=str).encode()
            atomic_write(run_json, lambda f: f.write(data))
        except (OSError, ValueError, TypeError) as exc:
            log.warning("run.json not updated with the start-up's phases: %s", exc)
