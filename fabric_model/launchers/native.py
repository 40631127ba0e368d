"""The C library, for the few process-level calls Python does not wrap (Linux only).

One handle, opened once: ``prctl`` for the processes that must die with their parent
(warm process, workers) and ``mallopt``/``malloc_trim`` for a worker's memory
(:mod:`fabric_model.worker.allocator`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


@functools.cache
def libc() -> ctypes.CDLL | None:
    """glibc's handle, or None off Linux or where there is no ``libc.so.6`` (musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Send this process ``sig`` (SIGKILL: it dies) when its parent dies (Linux); exit at once
    if it already has."""
    parent = os.getppid()
    library = libc()
    if library is not None:
        library.prctl(_PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != parent or parent == 1:  # it died before prctl took effect
        os._exit(1)
