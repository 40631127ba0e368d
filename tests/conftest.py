"""Every test must leave no child process, environment variable or process group behind."""

from __future__ import annotations

import os
import time

import psutil
import pytest

# The elastic tests run more workers than this host has cores; the cap on CPU workers
# (fabric_model/devices.py) is tested on its own, with this variable removed.
os.environ.setdefault("FABRIC_MODEL_CPU_WORKERS", "16")

# Variables that pytest and torch set for themselves on first use.
_OWN_VARIABLES = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_")


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(_OWN_VARIABLES)}


@pytest.fixture(autouse=True)
def no_leaks():
    env_before = _environment()
    yield
    me = psutil.Process()
    deadline = time.monotonic() + 5.0
    children = me.children(recursive=True)
    while children and time.monotonic() < deadline:
        time.sleep(0.05)
        children = [c for c in me.children(recursive=True) if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
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
