"""The launcher interface: how the driver starts, watches and stops worker processes.

The driver knows workers by id only; where their processes run is the launcher's business
(local processes today, Ray actors or hand-started workers on other hosts later). See
docs/architecture.md, "Processes".
"""

from __future__ import annotations

import abc
import sys
from collections.abc import Mapping


def module_command(module: str, *args: str) -> list[str]:
    """``python -m module args`` with the caller's interpreter, importing what the caller imports.

    A worker's ``sys.path`` is the caller's (``PYTHONPATH``, launchers/local.py), but ``-m`` would
    put the working directory before it: a ``fabric_model`` folder (or a module named like one
    of the user's) there would be what the worker imports. ``-P`` (Python 3.11+) leaves it out;
    unlike ``PYTHONSAFEPATH``, it is not inherited by the user's own subprocesses.
    """
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", module, *args]


class Launcher(abc.ABC):
    """Starts and supervises the worker processes of one job; ``stop_all`` leaves none running."""

    @abc.abstractmethod
    def start(self, worker_id: int, device: str | None) -> None:
        """Start worker ``worker_id`` on ``device``; it connects to the driver by itself."""

    @abc.abstractmethod
    def exited(self) -> Mapping[int, int]:
        """Worker ids whose process has ended, with their exit codes."""

    @abc.abstractmethod
    def kill(self, worker_id: int) -> None:
        """Kill worker ``worker_id`` at once (it may be frozen); no-op if it is not ours or already dead."""

    @abc.abstractmethod
    def wait_all(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every worker to exit by itself; whether all did."""

    @abc.abstractmethod
    def stop_all(self, timeout: float) -> None:
        """Stop every worker: ask, then kill those still alive after ``timeout`` seconds."""

    @abc.abstractmethod
    def log_tail(self, worker_id: int, lines: int = 30) -> str:
        """The last ``lines`` lines of the worker's output, for error messages."""

    def pending(self) -> frozenset[int]:
        """Started workers not yet placed anywhere (a cluster without room for them yet).

        A pending worker is no failure and counts against no start bound (docs/architecture.md,
        "Elasticity"); local processes are placed at once."""
        return frozenset()

    def host(self, worker_id: int) -> str | None:
        """Where the worker runs, when the launcher knows better than the worker's own Hello."""
        return None
