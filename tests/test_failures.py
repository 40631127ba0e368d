"""Failures: user errors come back with the worker's traceback; no exit path leaves a process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.errors import RemoteTraceback

from .helpers import fresh_model_and_optimizer, interruptible, make_data, run_script_and_its_tree
from .load import scaled

pytestmark = pytest.mark.processes

DATA = make_data(200)
REPO = Path(__file__).resolve().parents[1]


class BadLabels(Exception):
    pass


def loss_that_fails_on_a_large_batch(output, target):
    # Fails in the worker only: the caller's early check runs the loss on two samples.
    if output.shape[0] > 2:
        raise BadLabels(f"labels out of range: {int(target.max())} (model has {output.shape[1]} outputs)")
    return F.cross_entropy(output, target)


class MissingShard(Exception):
    pass


def datasets_missing_in_workers():
    # The caller's check passes; every worker fails while setting up, before its first step.
    from fabric_model import worker_context

    if worker_context() is not None:
        raise MissingShard("/data/shard-0 not found on this host")
    return DATA, None


def test_error_while_a_worker_sets_up_fails_the_job_instead_of_restarting_it(run_dir):
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(model, datasets_missing_in_workers, F.cross_entropy, opt)
    with pytest.raises(MissingShard, match="shard-0") as info:
        fm.train(1, 8, 2, run_dir=run_dir)
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "datasets_missing_in_workers" in str(info.value.__cause__)
    started = len(list((run_dir / "logs").glob("worker-*.log")))
    assert started == 2, f"{started} workers started for an error in the user's set-up code"


def test_user_exception_returns_with_worker_traceback(run_dir):
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(model, lambda: (DATA, None), loss_that_fails_on_a_large_batch, opt)
    start = time.monotonic()
    with pytest.raises(BadLabels, match="labels out of range") as info:
        fm.train(1, 16, 2, run_dir=run_dir)
    assert time.monotonic() - start < 60  # a bound on hanging, not a speed claim
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "loss_that_fails_on_a_large_batch" in cause.text  # the user's frame, from the worker
    assert "worker" in cause.text


FAILING_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.nn.functional as F
    sys.path.insert(0, {repo!r})
    from tests.helpers import fresh_model_and_optimizer, make_data
    from fabric_model import FabricModel, worker_context
    def loss_broken_in_workers(output, target):
        if worker_context() is not None:
            raise ValueError("the loss is broken")
        return F.cross_entropy(output, target)
    data = make_data(40)
    model, opt = fresh_model_and_optimizer()
    FabricModel(model, lambda: (data, None), loss_broken_in_workers, opt).train(1, 8, 2, run_dir={run_dir!r})
""")


def test_worker_error_prints_once_with_the_users_frame_first(run_dir, tmp_path):
    script = tmp_path / "train_script.py"  # a file, so tracebacks show its source lines
    script.write_text(FAILING_SCRIPT.format(repo=str(REPO), run_dir=str(run_dir)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    err = proc.stderr
    assert err.count('raise ValueError("the loss is broken")') == 1, err
    assert err.count("ValueError: the loss is broken") == 1, err
    remote = err[err.index("failed:") :]
    frames = [line for line in remote.splitlines() if line.lstrip().startswith("File ")]
    assert "loss_broken_in_workers" in frames[0], err  # the user's frame, not the worker's loop
    assert "worker/loop.py" not in err and "driver/" not in err, err


DRIVER_SCRIPT = textwrap.dedent("""
    import json, sys, torch, torch.nn.functional as F
    sys.path.insert(0, {repo!r})
    {prelude}
    from tests.helpers import fresh_model_and_optimizer, make_data
    from fabric_model import FabricModel
    from fabric_model.launchers.fork_safety import fork_blockers
    data = make_data(4000)
    with open({blockers!r}, "w") as f:  # what FabricModel(...) finds: fork, or start a fresh interpreter
        json.dump(fork_blockers(), f)
    model, opt = fresh_model_and_optimizer()
    FabricModel(model, lambda: (data, None), F.cross_entropy, opt).train(1000, 4, 2, run_dir={run_dir!r})
""")

#: How the script begins: whether the job's warm process can be a fork of it depends on what ran
#: before FabricModel(...) (docs/architecture.md, "Start-up"), and on a given CPU any torch
#: operation may start OpenMP's threads. Both ways are run, each made certain.
PRELUDES = {
    # One intra-op thread: no torch operation starts OpenMP's pool, so the script can be forked.
    "fork-safe": "torch.set_num_threads(1)",
    # A parallel operation on two threads: OpenMP's pool runs, so the warm process starts fresh.
    "openmp-started": "torch.set_num_threads(2); torch.ones(1 << 22).add_(1.0)",
}


def _start_driver(
    run_dir: Path, prelude: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """The driver script training (a step committed), its warm process and workers: on any
    failure here, all ended and reaped."""
    blockers = run_dir.parent / "fork_blockers.json"
    script = DRIVER_SCRIPT.format(
        repo=str(REPO), run_dir=str(run_dir), prelude=PRELUDES[prelude], blockers=str(blockers)
    )
    # SIGINT as a terminal leaves it (the test sends it), whatever this process inherited.
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=interruptible,
        env=dict(os.environ, **(env or {})),
    )
    try:
        metrics = run_dir / "logs" / "metrics.jsonl"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and b'"type": "train"' not in _read(metrics):
            assert proc.poll() is None, proc.stdout.read().decode()
            time.sleep(0.1)
        assert metrics.exists(), "training did not start within 60 s"
        # The warm process and the two workers it forked: a fork of the script where nothing
        # stood in the way, else a fresh interpreter (docs/architecture.md, "Start-up").
        why_not = json.loads(blockers.read_text())
        assert bool(why_not) == (prelude == "openmp-started"), why_not
        (warm,) = psutil.Process(proc.pid).children()
        if why_not:
            assert warm.cmdline()[-2:] == ["fabric_model.launchers.warm", "torch"], warm.cmdline()
        else:
            assert warm.cmdline() == psutil.Process(proc.pid).cmdline()
        processes = [warm, *warm.children()]
        assert len(processes) == 3, [c.cmdline() for c in processes]
    except BaseException:
        proc.kill()  # the warm process and its workers die with it (PR_SET_PDEATHSIG)
        proc.communicate(timeout=10)
        raise
    return proc, processes


def _read(path: Path) -> bytes:
    return path.read_bytes() if path.exists() else b""


def _assert_gone(workers: list[psutil.Process], within: float) -> None:
    _, alive = psutil.wait_procs(workers, timeout=within)
    for p in alive:
        p.kill()
    assert not alive, f"workers still running: {[p.pid for p in alive]}"


@pytest.mark.parametrize("prelude", PRELUDES)
def test_ctrl_c_stops_everything(run_dir, prelude):
    proc, workers = _start_driver(run_dir, prelude)
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait(timeout=10)  # reaped, whatever happened
    # A script stopped with Ctrl-C says how to resume and exits 130, without a traceback.
    assert proc.returncode == 130, out.decode(errors="replace")[-2000:]
    assert b"resume=True" in out and b"Traceback" not in out
    _assert_gone(workers, within=10)


@pytest.mark.parametrize("prelude", PRELUDES)
def test_killed_driver_takes_its_workers_along_when_they_may_not_wait(run_dir, prelude):
    """``FABRIC_MODEL_DRIVER_WAIT=0``: a driver SIGKILLed takes its warm process and workers along."""
    proc, workers = _start_driver(run_dir, prelude, {"FABRIC_MODEL_DRIVER_WAIT": "0"})
    proc.kill()
    proc.communicate(timeout=10)  # reaped, its pipe read and closed
    _assert_gone(workers, within=10)


@pytest.mark.parametrize("prelude", PRELUDES)
def test_a_killed_driver_s_workers_wait_for_it_then_exit_leaving_nothing(run_dir, prelude):
    """A driver SIGKILLed that never comes back: its workers hold the state and wait
    ``FABRIC_MODEL_DRIVER_WAIT`` (3 s here) for a driver at its address, then exit, and the
    warm process with them; no process is left, nor ``join.json`` (the job's secret)."""
    wait = 3
    proc, processes = _start_driver(run_dir, prelude, {"FABRIC_MODEL_DRIVER_WAIT": str(wait)})
    proc.kill()
    proc.communicate(timeout=10)
    killed = time.monotonic()
    time.sleep(1)
    waiting = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert waiting == processes, "the workers did not wait for their driver"
    _assert_gone(processes, within=scaled(wait + 30))
    assert time.monotonic() - killed >= wait  # not before the wait was over
    assert not (run_dir / "join.json").exists()
    for worker in (0, 1):
        log = (run_dir / "logs" / f"worker-{worker}.log").read_text()
        assert f"no driver came back within {wait} s (FABRIC_MODEL_DRIVER_WAIT)" in log, log[-2000:]


KILLED_AT_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch, torch.nn.functional as F
    sys.path.insert(0, {repo!r})
    torch.set_num_threads(1)
    from tests.helpers import KilledAt, fresh_model_and_optimizer, make_data
    from fabric_model import FabricModel

    model, opt = fresh_model_and_optimizer()
    data = make_data(400)
    FabricModel(model, lambda: (data, None), F.cross_entropy, opt, driver_logger_callback=KilledAt({at})).train(
        50, 4, 2, run_dir={run_dir!r}
    )
""")


def test_a_driver_killed_without_notice_leaves_every_committed_step_s_record(run_dir):
    """SIGKILL to the driver right after step 30 commits (its own logger sends it, after the
    step's record is made): ``logs/metrics.jsonl`` holds steps 1 to 30, none lost in a buffer."""
    at = 30
    script = KILLED_AT_SCRIPT.format(repo=str(REPO), run_dir=str(run_dir), at=at)
    code, out = run_script_and_its_tree(script, within=120)
    assert code == -signal.SIGKILL, out[-2000:]
    records = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    iterations = sorted(r["iteration"] for r in records if r["type"] == "train")
    assert iterations == list(range(1, at + 1)), iterations
