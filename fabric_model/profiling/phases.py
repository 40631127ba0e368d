"""Named ranges of the step loop: free while no profile window is open, timed and marked in the
torch profiler's trace while one is (docs/architecture.md, "Profiling").

The loop and the adapters wrap each part of a step in ``with phases(NAME):``. Off (every step
outside a window, every worker but the profiling one), the call returns one shared object whose
``__enter__`` and ``__exit__`` do nothing: a tenth of a microsecond each. On, each range is a
``torch.profiler.record_function`` (so the trace shows it) and its *exclusive* time (its own,
less the ranges nested in it) adds to a total per name, from which the summary is made.

Marking a range costs microseconds while the profiler records (its ``record_function`` and the
clock), paid where the range begins and ends, that is in its parent's time. :meth:`Phases.calibrate`
measures that cost once the profiler runs, and each range's share is taken out of its parent
and counted on its own (``INSTRUMENTATION``), so the framework's rows are not charged for the
profiling.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

# The ranges, as the trace and the summary name them. "user/": the user's code (through ours);
# "fabric_model/": the framework's own work.
STEP = "fabric_model/step"
DATA = "fabric_model/data"
SEED = "fabric_model/seed"
BUFFERS = "fabric_model/buffers"
STATS = "fabric_model/stats"
REDUCE = "fabric_model/reduce"
REPORT = "fabric_model/report"
SNAPSHOT = "fabric_model/snapshot"
CHECKPOINT = "fabric_model/checkpoint"
FINGERPRINT = "fabric_model/fingerprint"
VALIDATION = "fabric_model/validation"
UPLOAD = "fabric_model/upload (thread)"
FORWARD = "user/forward"
BACKWARD = "user/backward"
METRICS = "user/metrics"
OPTIMIZER = "user/optimizer"
CALLBACKS = "user/callbacks"
#: Not ranges of the step: what marking them cost (``close``), and the ranges ``calibrate`` times.
INSTRUMENTATION = "profiling/instrumentation"
CALIBRATION = "profiling/calibration"


class _Off:
    """The range of a closed window: nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_OFF = _Off()


class _Range:
    __slots__ = ("phases", "name", "mark", "start", "nested")

    def __init__(self, phases: Phases, name: str) -> None:
        self.phases, self.name, self.nested = phases, name, 0.0

    def __enter__(self) -> None:
        import torch

        self.mark = torch.autograd.profiler.record_function(self.name)
        self.mark.__enter__()
        self.phases._stack.append(self)
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        elapsed = time.perf_counter() - self.start
        phases = self.phases
        stack = phases._stack
        stack.pop()
        phases.totals[self.name] += elapsed - self.nested
        phases.marked += 1
        if stack:
            stack[-1].nested += elapsed + phases.overhead
        self.mark.__exit__(*exc)


class Phases:
    """The loop's named ranges; ``phases(name)`` is a context manager. ``on`` opens the window."""

    def __init__(self) -> None:
        self.on = False
        self.totals: defaultdict[str, float] = defaultdict(float)  # name -> exclusive seconds
        self._stack: list[_Range] = []
        self.overhead = 0.0  # seconds a range's marking costs outside its own time (calibrate)
        self.marked = 0  # ranges closed since open

    def __call__(self, name: str) -> Any:
        return _Range(self, name) if self.on else _OFF

    def open(self) -> None:
        """Start timing (totals from zero)."""
        self.totals.clear()
        self._stack.clear()
        self.marked = 0
        self.on = True

    def calibrate(self, rounds: int = 200) -> None:
        """Measure what marking a range costs now (the profiler running): the time ``rounds``
        empty ranges add to the one around them."""
        self.overhead = 0.0
        with self(CALIBRATION):
            for _ in range(rounds):
                with self(CALIBRATION):
                    pass
        self.overhead = self.totals.pop(CALIBRATION) / (rounds + 1)  # the outer range's own time, mostly
        self.marked = 0

    def close(self) -> dict[str, float]:
        """Stop timing; the exclusive seconds per name since :meth:`open`, and under
        :data:`INSTRUMENTATION` what marking the ranges cost."""
        self.on = False
        return {**self.totals, INSTRUMENTATION: self.marked * self.overhead}


#: What an adapter holds until a loop gives it its own: always off.
OFF = Phases()
