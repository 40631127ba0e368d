"""Every test must leave no child process, environment variable or process group behind."""

from __future__ import annotations

import os
import time

import psutil
import pytest


@pytest.fixture(autouse=True)
def no_leaks():
    env_before = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
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
    env_after = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    assert env_after == env_before, "the test changed os.environ"
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized()), "the test left a process group initialized"


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"
