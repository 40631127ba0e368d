"""A hand-started worker's share of its own host (docs/clusters.md, "Workers on other hosts").

The driver sizes the threads of the workers it starts from its own host's cores. A worker
started by hand (``fabric-model worker``) is on a host the driver knows nothing of, so it
sizes itself: its usable cores (affinity and cgroup quota, setup/cores.py) shared with the
other workers of the same job on this host whose CPUs overlap its own. Each registers while it
lives in a directory per job (the driver's address) under the temp directory: a file named by
its pid, holding its CPUs. Workers bound to CPUs of their own (Slurm's ``--cpu-bind``) share
with nobody; a crashed worker's file is ignored once its pid is gone.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from ..setup.cores import affinity, usable_cores
from ..state.checkpoint import pid_alive


class HostShare:
    """This worker's registration among the job's workers on this host."""

    def __init__(self, job: str, directory: str | os.PathLike[str] | None = None) -> None:
        base = Path(directory or tempfile.gettempdir()) / f"fabric-model-{os.getuid()}"
        self.directory = base / re.sub(r"[^A-Za-z0-9_.-]", "_", job)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        base.chmod(0o700)
        self.cpus = affinity()
        self.path = self.directory / str(os.getpid())
        self.path.write_text(",".join(str(c) for c in sorted(self.cpus)))

    def sharing(self) -> int:
        """Workers of the job on this host (this one included) that may run on this one's CPUs."""
        count = 0
        for entry in self.directory.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cpus = {int(c) for c in entry.read_text().split(",") if c}
            except (OSError, ValueError):
                continue
            if entry != self.path and not pid_alive(int(entry.name)):
                entry.unlink(missing_ok=True)
                continue
            count += bool(cpus & self.cpus)
        return max(1, count)

    def threads(self) -> int:
        """Intra-op threads for this worker: its usable cores divided among those sharing them."""
        return max(1, usable_cores() // self.sharing())

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        for directory in (self.directory, self.directory.parent):  # the last worker here leaves none behind
            try:
                directory.rmdir()
            except OSError:
                break
