"""Ray's reports to the driver's console, into the run directory (docs/clusters.md, "On a Ray cluster").

When a node's raylet dies, Ray publishes a report (a paragraph and the raylet's last log lines,
a native stack trace among them) to every driver, which prints it from a thread of its own: in
a run, a lost worker that the driver already says in one line. While the job runs, such a
report goes to ``logs/ray.log`` and the console gets one line of ours. Ray keeps that printing
in a private function (``ray._private.worker.print_to_stdstream``), replaced here while the job
runs and put back after; where a Ray version lacks it, nothing is replaced and Ray prints.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def said(report: str) -> str:
    """A raylet report in a few words: the node Ray marked dead, or a raylet that ended."""
    address = re.search(r"address: ([0-9A-Fa-f.:]+)", report)
    if "marked dead" in report:
        return f"Ray: node {address.group(1) if address else '?'} marked dead"
    if "Raylet is terminated" in report:
        return "Ray: a raylet ended"
    return "Ray: " + report.split(". ")[0].strip()[:50]


class RayConsole:
    """Sends Ray's raylet reports to ``path``, saying each in one line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._module: Any = None
        self._original: Any = None

    def install(self, module: Any = None) -> None:
        """Replace Ray's printing (``module``: Ray's ``_private.worker``, a test's stand-in)."""
        if module is None:
            try:
                module = importlib.import_module("ray._private.worker")
            except ImportError:
                return
        original = getattr(module, "print_to_stdstream", None)
        if callable(original) and self._original is None:
            self._module, self._original = module, original
            module.print_to_stdstream = self._print

    def _print(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        if not (isinstance(data, dict) and data.get("pid") == "raylet"):
            return self._original(data, *args, **kwargs)
        lines = [str(line) for line in data.get("lines", [])]
        with self._lock, open(self.path, "a", encoding="utf-8") as out:
            out.write("".join(line if line.endswith("\n") else line + "\n" for line in lines))
        # Short: a warning is cut to the terminal's width (80 columns leave 56 after our prefix).
        log.warning("%s (logs/%s)", said(lines[0] if lines else ""), self.path.name)
        return None

    def close(self) -> None:
        if self._module is not None and self._module.print_to_stdstream == self._print:  # a bound method: ==
            self._module.print_to_stdstream = self._original
        self._module = self._original = None
