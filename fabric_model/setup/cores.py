"""The cores a process may use: its CPU affinity (taskset, cpusets, Slurm's binding) and its
cgroup's CPU quota (a container's ``--cpus``), not all the host has."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def affinity() -> set[int]:
    """The CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def cgroup_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPUs' worth of time this process's cgroup may use (``cpu.max``, or v1's
    ``cpu.cfs_quota_us / cpu.cfs_period_us``), or None where there is no limit."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        here = root / path.lstrip("/")
        if controllers == "":  # cgroup v2
            quota = _read(here / "cpu.max") or _read(root / "cpu.max")
            if quota:
                limit, _, period = quota.partition(" ")
                if limit != "max" and period:
                    return int(limit) / int(period)
        elif "cpu" in controllers.split(","):  # cgroup v1
            for base in (root / "cpu" / path.lstrip("/"), root / "cpu,cpuacct" / path.lstrip("/"), root / "cpu"):
                us, per = _read(base / "cpu.cfs_quota_us"), _read(base / "cpu.cfs_period_us")
                if us and per:
                    return int(us) / int(per) if int(us) > 0 else None
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def usable_cores() -> int:
    """The CPUs this process may run on, capped by its cgroup's quota (at least 1)."""
    cores = len(affinity())
    quota = cgroup_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)
