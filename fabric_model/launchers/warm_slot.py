"""The warm process a ``FabricModel`` starts when it is built, held until ``train()`` takes it.

Started in the constructor, it imports the framework while the caller's script goes on, which
is what bounds a job's start-up (docs/architecture.md, "Start-up"). Whatever happens, it is
ended: taken by a job (which closes it, or keeps it for the next: ``warm_spare``), dropped when
``train()`` fails or the job's workers are not local, or discarded when the ``FabricModel`` is
garbage collected; one taken from ``warm_spare`` goes back there instead.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

from .warm_client import WarmProcess


class WarmSlot:
    """At most one warm process, owned by one ``FabricModel``."""

    def __init__(self, warm: WarmProcess | None = None) -> None:
        self._warm = warm
        self._finalizer = weakref.finalize(self, _give_back, warm) if warm is not None else None

    @classmethod
    def prestart(cls, framework: str) -> WarmSlot:
        """A slot holding a warm process for a job of ``framework``, where the job's workers will be
        local and start from one (``launchers.local.prestart_warm_process``); else an empty slot."""
        from .local import prestart_warm_process

        return cls(prestart_warm_process(framework))

    def take(self, framework: str, log_path: Path) -> WarmProcess | None:
        """The warm process for a job starting now: the one held, if it is alive and has the
        environment workers get now (its output moved to ``log_path``), else a new one. Either way
        the slot is empty afterwards and the process is the job's alone."""
        from .local import start_warm_process, warm_environment
        from .warm_spare import fits

        warm = self._release()
        if warm is not None and fits(warm, framework, warm_environment()):
            warm.move_log(log_path)
            return warm
        if warm is not None:
            warm.discard()
        return start_warm_process(framework, log_path)

    def drop(self) -> None:
        """End the warm process held, if any (a failed ``train()``, a job whose workers are not local)."""
        warm = self._release()
        if warm is not None:
            _give_back(warm)

    def _release(self) -> WarmProcess | None:
        warm, self._warm = self._warm, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        return warm

    def __reduce__(self) -> tuple[Any, ...]:
        """A copy of the slot is empty: the process is this object's, and a process is not data."""
        return (WarmSlot, ())


def _give_back(warm: WarmProcess) -> None:
    """End a warm process no job used, or keep it again where it was kept before."""
    from .warm_spare import release

    release(warm)
