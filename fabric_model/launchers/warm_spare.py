"""The warm process kept between the jobs of one caller (docs/architecture.md, "Start-up").

A warm process that is a fresh interpreter (the caller had threads or TensorFlow: a notebook's
kernel, a test runner) spent seconds importing torch. When its job ends with every worker
gone, it is kept, idle, for the next ``train()`` of the same caller with the same framework and
the same worker environment, for ``FABRIC_MODEL_WARM_KEEP`` seconds; then it ends by itself. At
most one is kept. It holds nothing of its job (its workers were its forks and have been reaped;
it never ran the job's code), and it ends with the caller, as every warm process does.
"""

from __future__ import annotations

import atexit
import threading

from ..settings.registry import WARM_KEEP
from .warm_client import WarmProcess

#: Variables that tell the caller's moment, not how an interpreter starts: a kept process whose
#: environment differs in these only still fits (each worker gets its whole environment with the
#: request that forks it; pytest names the running test in the first).
MOMENTARY = frozenset({"PYTEST_CURRENT_TEST", "_", "OLDPWD", "PWD"})

_lock = threading.Lock()
_kept: WarmProcess | None = None
_registered = False


def keep(warm: WarmProcess) -> bool:
    """Keep ``warm`` for a next job (True), or leave it to the caller to close (False): it is a
    fork of the caller (which holds the caller's state of that time), has a worker still running,
    or keeping is off (``FABRIC_MODEL_WARM_KEEP=0``). A process kept before it is ended."""
    global _kept, _registered
    idle = WARM_KEEP.get()
    if idle <= 0 or not warm.park(idle):
        return False
    with _lock:
        previous, _kept = _kept, warm
        if not _registered:
            atexit.register(end)
            _registered = True
    if previous is not None:
        previous.discard()
    return True


def take(framework: str, env: dict[str, str]) -> WarmProcess | None:
    """The kept process if it serves ``framework`` with workers' environment ``env`` and is alive;
    else None (and a kept one that does not fit is ended). The caller owns what it gets."""
    global _kept
    with _lock:
        warm, _kept = _kept, None
    if warm is None:
        return None
    if fits(warm, framework, env):
        warm.kept_before = True
        return warm
    warm.discard()  # it has no worker: nothing to wait for, and its interpreter's exit takes a while
    return None


def end() -> None:
    """End the kept process, if any (at the caller's exit, or for a caller that wants none)."""
    global _kept
    with _lock:
        warm, _kept = _kept, None
    if warm is not None:
        warm.discard()


def release(warm: WarmProcess) -> None:
    """End ``warm``, which no job used (a failed ``train()`` or constructor): a process kept
    before is kept again, any other ended."""
    if not (warm.kept_before and keep(warm)):
        warm.discard()


def kept_pid() -> int | None:
    """The kept process's pid (None when none is kept): tests tell it from a leaked one."""
    warm = _kept
    return warm.process.pid if warm is not None and warm.alive else None


def fits(warm: WarmProcess, framework: str, env: dict[str, str]) -> bool:
    """Whether ``warm`` can fork the workers of a job of ``framework`` whose workers' environment
    (but for what is per job or secret) is ``env``: alive, of that framework, started in ``env``
    but for :data:`MOMENTARY` variables."""

    def lasting(env: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if k not in MOMENTARY}

    return warm.alive and warm.framework == framework and lasting(warm.env) == lasting(env)
