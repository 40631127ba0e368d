"""Every test must leave no child process, environment variable or process group behind."""

from __future__ import annotations

import gc
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from .load import scale

# The elastic tests run more workers than this host has cores; the cap on CPU workers
# (fabric_model/devices.py) is tested on its own, with this variable removed.
os.environ.setdefault("FABRIC_MODEL_CPU_WORKERS", "16")
# Workers of a driver killed without notice exit at once, as they did before they could wait for
# it to come back: the tests of that wait (test_driver_restart.py) give theirs.
os.environ.setdefault("FABRIC_MODEL_DRIVER_WAIT", "0")

# TensorFlow's log level, as quiet_tensorflow() sets it when it loads TensorFlow. TensorFlow loads
# in the first test that uses it (tests/helpers.py, Lazily), not at collection: set before any test.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# Variables that pytest, torch and TensorFlow set for themselves on first use (TensorFlow's on import:
# its Python side, its TPU module, its Keras 2 saving and its OpenMP runtime).
_OWN_VARIABLES = (
    "PYTEST_CURRENT_TEST",
    "TORCHINDUCTOR_",
    "_TORCHINDUCTOR_",
    "TF2_BEHAVIOR",
    "ENABLE_RUNTIME_UPTIME_TELEMETRY",
    "TPU_ML_PLATFORM",
    "HDF5_PLUGIN_PATH",
    "KMP_DUPLICATE_LIB_OK",
    "KMP_INIT_AT_FORK",
)


def pytest_report_header(config) -> str:
    return f"fabric-model: bounds stretched x{scale():.2f} for this machine's load (tests/load.py)"


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """The test process ends next: ``gc.freeze()`` spares its exit the collections over every object
    that torch and TensorFlow made, which the interpreter runs as it finalizes (2-3 s, while
    pytest-xdist's main process waits for it)."""
    gc.freeze()


#: A test module marked ``processes`` as a whole, by its source (its own line, at its top level).
_PROCESSES_MODULE = re.compile(r"^pytestmark = pytest\.mark\.processes$", re.M)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m "not processes"`` (the fast tier), a module marked ``processes`` as a whole is not
    imported: every test in it would be deselected, and its import and the rewriting of its asserts
    cost each test process (about 2 s for the 30 of them). Named on the command line, it is collected
    as any other."""
    if " ".join(config.option.markexpr.split()) != "not processes":
        return None
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    return True if _PROCESSES_MODULE.search(collection_path.read_text()) else None


#: The files that take longest (a quiet 2-core machine, `--durations`), longest first. They are
#: collected first, so that two test processes do not end with one of them alone on a long file:
#: `-n 2` hands tests out in collection order. (tox's `--dist loadfile` hands out whole files, which
#: pytest-xdist 3.6 and later sort by their number of tests unless `--no-loadscope-reorder`: this
#: order only breaks their ties, and the files' measured times end the same either way, within
#: 0.5%.) A file left out or out of date costs only that balance.
LONGEST_FIRST = (
    "test_tf_keras.py",
    "test_keras.py",
    "test_recipes.py",
    "models/test_keras_models.py",
    "test_warm_start.py",
    "test_ibm_runtime.py",
    "test_elastic.py",
    "test_ray.py",
    "test_ibm_scripts.py",
    "test_failures.py",
    "test_driver_restart.py",
    "test_deterministic_keras.py",
    "test_multihost_ray.py",
    "test_preemption.py",
)


def _longest_first(item: pytest.Item) -> int:
    path = item.path.as_posix()
    return next((i for i, name in enumerate(LONGEST_FIRST) if path.endswith("tests/" + name)), len(LONGEST_FIRST))


def _order(item: pytest.Item) -> tuple[bool, int]:
    """The in-process tests that load TensorFlow (marked ``tensorflow``) first, then the longest files
    first. With ``-n 2`` (pytest-xdist's default ``--dist load``), one test process gets the first
    eighth of the tests as its first batch, so all of the two dozen TensorFlow ones: it alone pays
    TensorFlow's import (about 8 s), while the other starts on the rest. (pytest-xdist's
    ``--dist loadgroup`` would say it with ``xdist_group``, but pytest 9.2's node ids no longer
    carry the group: pytest-xdist issue 1386.)"""
    return item.get_closest_marker("tensorflow") is None, _longest_first(item)


def pytest_collection_modifyitems(config, items) -> None:
    """The order of :func:`_order` (the order within each file kept), and every test's
    pytest-timeout bound (its marker's, else the configured one) stretched by how busy the machine
    is (tests/load.py)."""
    items.sort(key=_order)  # stable
    factor = scale()
    if factor == 1.0:
        return
    default = float(config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        seconds = float(marker.args[0]) if marker and marker.args else default
        if seconds > 0:
            item.add_marker(pytest.mark.timeout(seconds * factor), append=False)


#: Module-scoped fixtures that own long-lived processes (a Ray cluster) register a callable
#: returning their pids here; those processes and their idle descendants are no test's leak.
FIXTURE_PROCESSES: list[Callable[[], set[int]]] = []


def _kept_warm_process() -> set[int]:
    """The warm process kept for the next job (launchers/warm_spare.py): it outlives its job by
    design; a worker it still has is a leak all the same."""
    from fabric_model.launchers import warm_spare

    pid = warm_spare.kept_pid()
    return set() if pid is None else {pid}


FIXTURE_PROCESSES.append(_kept_warm_process)


def _owned_by_fixture(proc: psutil.Process, roots: set[int]) -> bool:
    """A fixture's own process, or one of its descendants that no test started: not a worker
    or a worker's actor (pool workers and Ray's agents are the cluster's)."""
    if proc.pid in roots:
        return True
    if not roots:
        return False
    try:
        ancestors = {p.pid for p in proc.parents()}
        cmd = "" if proc.status() == psutil.STATUS_ZOMBIE else " ".join(proc.cmdline())
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
        alive = [p for p in alive if _running(p)]
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


def _children_of_test(me: psutil.Process, roots: set[int]) -> list[psutil.Process]:
    return [c for c in me.children(recursive=True) if not _owned_by_fixture(c, roots)]


def _describe(proc: psutil.Process) -> str:
    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            return f"pid {proc.pid}: ended, never waited for (a zombie)"
        return f"pid {proc.pid}: {' '.join(proc.cmdline()[:6])}"
    except psutil.Error:
        return f"pid {proc.pid}: gone"


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _end_and_reap(procs: list[psutil.Process]) -> None:
    """SIGKILL ``procs``, wait for them, and reap those that are this process's own children (a
    ``Popen`` of theirs then reads status 0): what one test left must not fail the next ones."""
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)
    for proc in procs:
        try:
            os.waitpid(proc.pid, os.WNOHANG)
        except ChildProcessError:
            pass  # not ours (a grandchild: its parent or init reaps it) or reaped already


@pytest.fixture(autouse=True)
def no_leaks():
    """Fails the teardown of the test that left a child process (running, or ended and never waited
    for), a changed os.environ or an initialized process group, once: what it left is ended, reaped
    or restored, and a process that was there before a test is no leak of that test."""
    me = psutil.Process()
    before = {c.pid for c in me.children(recursive=True)}
    env_before = _environment()
    yield
    roots = set().union(*(owned() for owned in FIXTURE_PROCESSES))

    def new_children() -> list[psutil.Process]:
        return [c for c in _children_of_test(me, roots) if c.pid not in before]

    # Up to 5 s for processes the test stopped to end; a zombie of ours ends nothing more by waiting.
    deadline = time.monotonic() + 5.0
    children = new_children()
    while any(map(_running, children)) and time.monotonic() < deadline:
        time.sleep(0.05)
        children = new_children()
    leaked = [_describe(c) for c in children]
    _end_and_reap(children)
    env_after = _environment()
    if env_after != env_before:
        for name in env_after.keys() - env_before.keys():
            del os.environ[name]
        os.environ.update({k: v for k, v in env_before.items() if env_after.get(k) != v})
    import torch.distributed as dist

    group_left = dist.is_available() and dist.is_initialized()
    if group_left:
        dist.destroy_process_group()
    assert not leaked, f"the test left child processes: {leaked}"
    assert env_after == env_before, "the test changed os.environ"
    assert not group_left, "the test left a process group initialized"


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"
