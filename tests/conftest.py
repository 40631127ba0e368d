"""Every test must leave no child process, environment variable or process group behind."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import psutil
import pytest

# The elastic tests run more workers than this host has cores; the cap on CPU workers
# (fabric_model/devices.py) is tested on its own, with this variable removed.
os.environ.setdefault("FABRIC_MODEL_CPU_WORKERS", "16")

# Variables that pytest and torch set for themselves on first use.
_OWN_VARIABLES = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_", "_TORCHINDUCTOR_")


#: Module-scoped fixtures that own long-lived processes (a Ray cluster) register a callable
#: returning their pids here; those processes and their idle descendants are no test's leak.
FIXTURE_PROCESSES: list[Callable[[], set[int]]] = []


def _owned_by_fixture(proc: psutil.Process, roots: set[int]) -> bool:
    """A fixture's own process, or one of its descendants that no test started: not a worker
    or a worker's actor (pool workers and Ray's agents are the cluster's)."""
    if proc.pid in roots:
        return True
    try:
        cmd = " ".join(proc.cmdline())
        ancestors = {p.pid for p in proc.parents()}
    except psutil.Error:
        return True  # gone
    ours = "fabric_model" in cmd or cmd.startswith("ray::WorkerHost")
    return bool(ancestors & roots) and not ours


def wait_gone(pids: set[int], timeout: float) -> list[str]:
    """Wait up to ``timeout`` s for ``pids`` to end; SIGKILL and name those still running."""
    deadline = time.monotonic() + timeout
    alive = [p for p in map(_process, pids) if p is not None]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    left = []
    for proc in alive:
        try:
            left.append(f"pid {proc.pid}: {' '.join(proc.cmdline()[:4])}")
            proc.kill()
        except psutil.Error:
            pass
    return left


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(_OWN_VARIABLES)}


@pytest.fixture(autouse=True)
def no_leaks():
    env_before = _environment()
    yield
    me = psutil.Process()
    roots = set().union(*(owned() for owned in FIXTURE_PROCESSES))

    def test_children() -> list[psutil.Process]:
        return [c for c in me.children(recursive=True) if not _owned_by_fixture(c, roots)]

    deadline = time.monotonic() + 5.0
    children = test_children()
    while children and time.monotonic() < deadline:
        time.sleep(0.05)
        children = [c for c in test_children() if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    leaked = [f"pid {c.pid}: {' '.join(c.cmdline()[:6])}" for c in children if c.is_running()]
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    assert not leaked, f"the test left child processes running: {leaked}"
    assert _environment() == env_before, "the test changed os.environ"
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized()), "the test left a process group initialized"


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"
