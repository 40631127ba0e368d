"""Named ranges of the step loop: free while no profile window is open, timed and marked in the
torch profiler's trace while one is (docs/architecture.md, "Profiling").

The parts of a step a range times are methods: the loop and the torch step strategies name
theirs (``{method: range name}``) to :meth:`Phases.follow`. While no window is open (every step
outside one, every worker but the profiling one) those methods are the objects' own: no call and
no ``with`` on the step's path (a range that is not there costs nothing; a no-op one cost three
Python calls, ~27 of a null step's ~220). While a window is open each runs inside its range: an
instance attribute, made when the window opens (or when an object is followed during one) and
removed when it closes, shadows the method. Parts off the step's path (validation, callbacks,
uploads, metrics) keep ``with phases(NAME):``, which off returns one shared object whose
``__enter__`` and ``__exit__`` do nothing. On, each range is a ``torch.profiler.record_function``
(so the trace shows it) and its *exclusive* time (its own, less the ranges nested in it) adds to
a total per name, from which the summary is made.

Marking a range costs microseconds while the profiler records (its ``record_function`` and the
clock), paid where the range begins and ends, that is in its parent's time. :meth:`Phases.calibrate`
measures that cost once the profiler runs, and each range's share is taken out of its parent
and counted on its own (``INSTRUMENTATION``), so the framework's rows are not charged for the
profiling.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

# The ranges, as the trace and the summary name them. "user/": the user's code (through ours);
# "fabric_model/": the framework's own work.
STEP = "fabric_model/step"
DATA = "fabric_model/data"
SEED = "fabric_model/seed"
BUFFERS = "fabric_model/buffers"
STATS = "fabric_model/stats"
#: The step's one read of its results (the reduced tail): on a GPU the host waits here for the
#: step's queued kernels, as a plain loop does in ``loss.item()``; not the framework's time.
RESULTS = "fabric_model/results"
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


class _Timed:
    """A followed object's method while a window is open: the method, inside its range."""

    __slots__ = ("phases", "name", "method", "own")

    def __init__(self, phases: Phases, name: str, method: Callable[..., Any], own: bool) -> None:
        self.phases, self.name, self.method = phases, name, method
        self.own = own  # the method was an instance attribute (put back on close), not the class's

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _Range(self.phases, self.name):
            return self.method(*args, **kwargs)


def _nothing() -> None:
    return None


class Phases:
    """The loop's named ranges; ``phases(name)`` is a context manager, and the methods of the
    objects it follows (:meth:`follow`) run in theirs while a window is open (:meth:`open`)."""

    def __init__(self) -> None:
        self.on = False
        self.totals: defaultdict[str, float] = defaultdict(float)  # name -> exclusive seconds
        self._stack: list[_Range] = []
        self.overhead = 0.0  # seconds a range's marking costs outside its own time (calibrate)
        self.marked = 0  # ranges closed since open
        self._followed: list[tuple[Any, Mapping[str, str]]] = []  # (object, {method: range name})

    def __call__(self, name: str) -> Any:
        return _Range(self, name) if self.on else _OFF

    def follow(self, owner: Any, ranges: Mapping[str, str]) -> None:
        """While a window is open, each method of ``owner`` that ``ranges`` names (``{method:
        range name}``) runs inside its range; while none is, the methods are ``owner``'s own."""
        self._followed.append((owner, ranges))
        if self.on:
            self._time(owner, ranges)

    def unfollow(self, owner: Any) -> None:
        """``owner``'s methods are its own again, and stay so (a no-op for an object not followed)."""
        for i, (followed, ranges) in enumerate(self._followed):
            if followed is owner:
                del self._followed[i]
                if self.on:
                    _untime(owner, ranges)
                return

    def _time(self, owner: Any, ranges: Mapping[str, str]) -> None:
        own = vars(owner)
        for method, name in ranges.items():
            setattr(owner, method, _Timed(self, name, getattr(owner, method), method in own))

    def open(self) -> None:
        """Start timing (totals from zero): the followed methods run in their ranges."""
        self.totals.clear()
        self._stack.clear()
        self.marked = 0
        self.on = True
        for owner, ranges in self._followed:
            self._time(owner, ranges)

    def calibrate(self, rounds: int = 200) -> None:
        """Measure what marking a range costs now (the profiler running): the time ``rounds``
        empty ranges, each a followed method's, add to the one around them."""
        self.overhead = 0.0
        empty = _Timed(self, CALIBRATION, _nothing, False)
        with self(CALIBRATION):
            for _ in range(rounds):
                empty()
        self.overhead = self.totals.pop(CALIBRATION) / (rounds + 1)  # the outer range's own time, mostly
        self.marked = 0

    def close(self) -> dict[str, float]:
        """Stop timing (the followed methods are their objects' own again); the exclusive
        seconds per name since :meth:`open`, and under :data:`INSTRUMENTATION` what marking the
        ranges cost."""
        if self.on:
            for owner, ranges in self._followed:
                _untime(owner, ranges)
        self.on = False
        return {**self.totals, INSTRUMENTATION: self.marked * self.overhead}


def _untime(owner: Any, ranges: Mapping[str, str]) -> None:
    for method in ranges:
        timed = vars(owner)[method]
        if timed.own:
            setattr(owner, method, timed.method)
        else:
            delattr(owner, method)


class _Never(Phases):
    """Ranges no window opens: it follows nothing (so holds on to nothing)."""

    def follow(self, owner: Any, ranges: Mapping[str, str]) -> None:
        return None


#: What an adapter holds until a loop gives it its own: always off.
OFF = _Never()
