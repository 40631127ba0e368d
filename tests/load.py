"""How busy this machine is, so the tests' bounds stretch with it.

A bound in a test is there to turn a hang into a failure, not to time anything: a Ray cluster
of four nodes that starts its actors in 40 s on a quiet 2-core machine takes two to three
times that beside two CPU-bound processes. :func:`scale` is measured once, when the suite starts,
from the tasks the kernel counts as runnable besides this one, and every bound that waits
on other processes' progress is multiplied by it: ``pytest-timeout``'s (tests/conftest.py),
the Ray tests' start bound, the multi-host tests' waits. ``FABRIC_MODEL_TEST_TIME_SCALE``
sets it instead (a machine that gets busy only after the suite started).
"""

from __future__ import annotations

import functools
import os
import time

#: The most a bound is stretched: a machine busier than this is not one to run the suite on.
MOST = 4.0


def runnable_besides_me(samples: int = 20, interval: float = 0.01) -> float:
    """The mean count of other runnable tasks (the fourth field of ``/proc/loadavg`` counts the
    reader too); 0 where the kernel does not say (not Linux)."""
    counts = []
    for _ in range(samples):
        try:
            with open("/proc/loadavg") as f:
                running = int(f.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return 0.0
        counts.append(max(0, running - 1))
        time.sleep(interval)
    return sum(counts) / len(counts)


@functools.cache
def scale() -> float:
    """``FABRIC_MODEL_TEST_TIME_SCALE``, else (cores + other runnable tasks) / cores, within [1, MOST];
    measured on first use (the suite's collection), then the same for the whole session."""
    named = os.environ.get("FABRIC_MODEL_TEST_TIME_SCALE")  # settings.py reads only the package's own
    if named:
        return min(MOST, max(1.0, float(named)))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(MOST, max(1.0, (cores + runnable_besides_me()) / cores))


def scaled(seconds: float) -> float:
    """``seconds`` stretched by how busy the machine was when the suite started."""
    return seconds * scale()
