"""Workers size themselves from their own host (docs/clusters.md, "Workers on other hosts"): a
hand-started worker takes its host's usable cores (affinity and cgroup quota) shared with the
job's other workers there, not the driver's share; a driver may start no local workers at all
(``FABRIC_MODEL_LOCAL_WORKERS=0``) and wait for workers started by hand."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.setup.cores import cgroup_quota, usable_cores
from fabric_model.testing import FaultInjector, HoldForJoin, WorkerStarter
from fabric_model.worker.host_share import HostShare

from .helpers import fresh_model_and_optimizer, make_data, records

DATA = make_data(192)


def fake_cgroup(tmp_path: Path, proc_line: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    proc = tmp_path / "proc-cgroup"
    proc.write_text(proc_line + "\n")
    return root, proc


@pytest.mark.parametrize(
    "proc_line,files,quota",
    [
        ("0::/job", {"job/cpu.max": "200000 100000"}, 2.0),  # v2: a container's --cpus=2
        ("0::/job", {"job/cpu.max": "max 100000"}, None),  # v2: no limit
        ("0::/", {"cpu.max": "150000 100000"}, 1.5),
        (
            "4:cpu,cpuacct:/slot",
            {"cpu,cpuacct/slot/cpu.cfs_quota_us": "300000", "cpu,cpuacct/slot/cpu.cfs_period_us": "100000"},
            3.0,
        ),
        ("4:cpu,cpuacct:/", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),  # v1: no limit
        ("0::/job", {}, None),  # nothing readable
    ],
)
def test_the_cgroup_cpu_quota_is_read_from_either_cgroup_version(tmp_path, proc_line, files, quota):
    root, proc = fake_cgroup(tmp_path, proc_line, files)
    assert cgroup_quota(root, proc) == quota


def test_workers_of_a_job_on_a_host_share_the_cpus_they_may_both_run_on(tmp_path):
    first = HostShare("10.0.0.1-4000", tmp_path)
    assert first.sharing() == 1 and first.threads() == usable_cores()
    other_cpus = ",".join(str(c) for c in sorted(first.cpus))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (first.directory / str(sleeper.pid)).write_text(other_cpus)  # a second worker, alive, on the same CPUs
        assert first.sharing() == 2 and first.threads() == max(1, usable_cores() // 2)
        (first.directory / str(sleeper.pid)).write_text("100000")  # bound to CPUs of its own: not shared
        assert first.sharing() == 1
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
    (first.directory / str(sleeper.pid)).write_text(other_cpus)  # a crashed worker's file: ignored and removed
    assert first.sharing() == 1 and not (first.directory / str(sleeper.pid)).exists()
    another_job = HostShare("10.0.0.1-4001", tmp_path)
    assert another_job.sharing() == 1  # another job's workers are another share
    another_job.close()
    first.close()
    assert not any(tmp_path.iterdir())  # the last worker leaves no directory behind


class RecordThreads:
    """A worker logger writing ``<pid> <torch threads>`` after each step: what a worker ends with,
    whichever order the workers came in (a worker alone in a first generation takes every core
    until another on its host joins)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def log_train_metrics(self, metrics, iteration, epoch, workers) -> None:  # noqa: ANN001
        Path(self.directory, str(os.getpid())).write_text(str(torch.get_num_threads()))


def threads_by_pid(directory: Path) -> dict[int, int]:
    return {int(f.name): int(f.read_text()) for f in directory.iterdir()}


def train(run_dir, record_dir, engines, starter, faults=(), **kwargs):
    model, opt = fresh_model_and_optimizer()
    logger = RecordThreads(str(record_dir))
    try:
        FabricModel(
            model,
            lambda: (DATA, None),
            F.cross_entropy,
            opt,
            worker_logger_callback=FaultInjector(list(faults), run_dir.parent, inner=logger) if faults else logger,
            driver_logger_callback=starter,
        ).train(2, 16, engines, seed=1, run_dir=run_dir, **kwargs)
    finally:
        starter.close()


@pytest.mark.processes
def test_a_hand_started_worker_takes_its_own_hosts_cores_not_the_drivers_share(tmp_path, monkeypatch):
    """The driver's host runs 2 local workers (each half its cores); the worker started by hand is
    alone of its kind on its host, so it takes all of them."""
    monkeypatch.setenv("FABRIC_MODEL_CPU_WORKERS", "2")
    monkeypatch.setenv("FABRIC_MODEL_SMALL_STEP_FLOPS", "0")  # the shares, whatever the step's size
    (tmp_path / "threads").mkdir()
    starter = WorkerStarter(tmp_path / "run", [], at_start=1)
    # The local two wait for it after step 1, unless it came in time for the first generation.
    train(tmp_path / "run", tmp_path / "threads", 3, starter, [HoldForJoin(1, workers=3)])
    threads = threads_by_pid(tmp_path / "threads")
    hand = starter.processes[0].pid
    assert threads[hand] == usable_cores(), threads
    assert sorted(n for pid, n in threads.items() if pid != hand) == [max(1, usable_cores() // 2)] * 2, threads


@pytest.mark.processes
def test_a_driver_with_no_local_workers_trains_with_workers_started_by_hand(tmp_path, monkeypatch):
    """``FABRIC_MODEL_LOCAL_WORKERS=0``: both workers come by hand, and share this host's cores;
    with ``deterministic=True`` they take the run's fixed thread count instead."""
    monkeypatch.setenv("FABRIC_MODEL_LOCAL_WORKERS", "0")
    monkeypatch.setenv("FABRIC_MODEL_DETERMINISTIC_THREADS", "3")
    # The workers' share of the host under this test's own temporary folder: another test's
    # workers (a parallel run of the suite) may hold theirs in the shared one meanwhile.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    for deterministic, expected in ((False, max(1, usable_cores() // 2)), (True, 3)):
        record = tmp_path / f"threads-{deterministic}"
        record.mkdir()
        starter = WorkerStarter(tmp_path / f"run-{deterministic}", [], at_start=2)
        train(tmp_path / f"run-{deterministic}", record, 2, starter, deterministic=deterministic)
        assert sorted(threads_by_pid(record).values()) == [expected, expected]
        assert sorted(threads_by_pid(record)) == sorted(p.pid for p in starter.processes)  # no local worker trained
        # Both in the first generation, or the second joined it: either way the run ends with both.
        assert [g["workers"] for g in records(tmp_path / f"run-{deterministic}", "generation")][-1] == 2
        assert not (tmp_path / f"fabric-model-{os.getuid()}").exists()
