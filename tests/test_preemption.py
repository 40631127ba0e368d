"""Preemption (docs/architecture.md, "Preemption"): a worker told to go leaves after its step; a
driver told to go saves the newest state, stops everything and says how to come back."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.state.checkpoint import list_checkpoints, load_checkpoint
from fabric_model.step.plan import Plan
from fabric_model.testing import FaultInjector, Preempt

from .helpers import (
    fresh_model_and_optimizer,
    make_data,
    max_rel_diff,
    records,
    reference_train,
    sample_indices_of_steps,
)
from .load import scaled

pytestmark = pytest.mark.processes

SEED, EPOCHS, BATCH, GLOBAL = 11, 2, 8, 24
DATA = make_data(240)  # 10 steps an epoch
PLAN = Plan(len(DATA), BATCH, GLOBAL // BATCH, SEED)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def undisturbed():
    model, opt = fresh_model_and_optimizer()
    reference_train(model, opt, DATA, seed=SEED, epochs=EPOCHS, batch_size=BATCH, micro_batches=GLOBAL // BATCH)
    return copy.deepcopy(model.state_dict())


class SleepAfter:
    """A worker logger: worker ``worker`` sleeps ``seconds`` after global step ``step`` (after
    the injector's faults of that step fired)."""

    def __init__(self, worker: int, step: int, seconds: float) -> None:
        self.worker, self.step, self.seconds = worker, step, seconds

    def log_train_metrics(self, metrics, iteration, epoch, workers) -> None:
        from fabric_model.context import worker_context

        ctx = worker_context()
        if ctx is not None and ctx.worker_id == self.worker and ctx.global_step == self.step:
            time.sleep(self.seconds)


def train(run_dir, marker_dir, faults, workers=3, inner=None):
    model, opt = fresh_model_and_optimizer()
    injector = FaultInjector(faults, marker_dir, inner=inner)
    fm = FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt, worker_logger_callback=injector)
    result = fm.train(EPOCHS, BATCH, workers, effective_batch_size=GLOBAL, seed=SEED, run_dir=run_dir)
    return model, result


def assert_every_step_once(run_dir, result, model, reference):
    train_records = records(run_dir, "train")
    steps = [(r["epoch"], r["step"]) for r in train_records]
    assert sorted(steps) == [(e, s) for e in range(EPOCHS) for s in range(PLAN.steps_per_epoch)]  # none redone
    used = sample_indices_of_steps(PLAN, train_records)
    for epoch in range(EPOCHS):
        assert sorted(used[epoch]) == list(range(len(DATA))), f"epoch {epoch}: not every sample exactly once"
    assert len(set(result.replica_digests.values())) == 1
    assert max_rel_diff(model.state_dict(), reference) <= 1e-5


def test_a_worker_told_to_go_leaves_after_its_step_and_the_others_go_on(undisturbed, run_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("EDT_REPLACE_WORKERS", "0")  # the slot stays empty: the leave is all there is
    model, result = train(run_dir, tmp_path, [Preempt(worker=2, step=4)])

    assert_every_step_once(run_dir, result, model, undisturbed)
    generations = records(run_dir, "generation")
    assert [g["workers"] for g in generations] == [3, 2]
    left = generations[1]
    assert left["reason"] == "worker 2 leaves (SIGTERM)", left
    assert left.get("rolled_back_from") is None and left["source_rank"] == -1  # nothing redone, nothing pulled
    # The survivors resumed right after the step it left at, and nobody's collective failed.
    assert 5 <= left["resume_unit"] <= 7
    driver_log = (run_dir / "logs" / "driver.log").read_text()
    assert "lost" not in driver_log and "failed" not in driver_log
    assert "exiting (0): leaves (SIGTERM)" in (run_dir / "logs" / "worker-2.log").read_text()


def test_a_step_longer_than_the_grace_leaves_as_a_lost_worker_does(undisturbed, run_dir, tmp_path, monkeypatch):
    """SIGUSR1 named as a preemption signal (Slurm's ``--signal=USR1@60``); a worker that gets it
    while its next step is slower than the grace dies with it, and the others recover as from a
    crash: the result is still the undisturbed one."""
    monkeypatch.setenv("EDT_REPLACE_WORKERS", "0")
    monkeypatch.setenv("FABRIC_MODEL_PREEMPT_SIGNALS", "SIGTERM,SIGUSR1")
    monkeypatch.setenv("FABRIC_MODEL_PREEMPT_GRACE", "1")
    # Told after step 3, the worker then spends 4 s before its next step: past the 1 s grace.
    faults = [Preempt(worker=1, step=3, signal_name="SIGUSR1")]
    model, result = train(run_dir, tmp_path, faults, inner=SleepAfter(1, 3, 4.0))

    assert_every_step_once(run_dir, result, model, undisturbed)
    start, after = records(run_dir, "generation")
    # A crash's generation change: the first to tell may be its end or a peer's failed allreduce.
    assert 1 in start["members"] and 1 not in after["members"] and "leaves" not in after["reason"], after
    said = (run_dir / "logs" / "worker-1.log").read_text()
    assert "exiting (138): SIGUSR1: the step did not end within 1 s (FABRIC_MODEL_PREEMPT_GRACE)" in said


# -- the driver -----------------------------------------------------------------------------
SCRIPT = """
import sys, time
from pathlib import Path
import torch
import torch.nn.functional as F
from fabric_model import FabricModel

run_dir, out, marker, resume, shard = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1", sys.argv[5] == "1"
g = torch.Generator().manual_seed(0)
x = torch.randn(240, 12, generator=g)
y = (x @ torch.randn(12, 3, generator=g)).argmax(1)
data = [(x[i].clone(), int(y[i])) for i in range(240)]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


class Mark:  # the driver's logger: says when training is well under way
    def log_train_metrics(self, metrics, iteration, epoch, workers):
        if iteration == 13 and marker != "-":
            Path(marker).write_text(str(iteration))


class Pace:  # the workers' logger: slow steps, so the signal lands mid-epoch
    def log_train_metrics(self, metrics, iteration, epoch, workers):
        if marker != "-":
            time.sleep(0.05)


fm = FabricModel(model, lambda: (data, None), F.cross_entropy, opt, driver_logger_callback=Mark(),
                 worker_logger_callback=Pace())
fm.train(3, 8, 3 if shard else 2, effective_batch_size=24, seed=3, run_dir=run_dir, deterministic=True, resume=resume,
         shard_optimizer_state=shard)
torch.save(model.state_dict(), out)
"""


def run_script(
    script: Path, run_dir: Path, out: Path, marker: str = "-", resume: bool = False, shard: bool = False
) -> subprocess.Popen:
    """The script in a session of its own: its process group is the job's processes only. ``shard``:
    on 3 workers with sharded optimizer state (the same weights: deterministic=True)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, str(script), str(run_dir), str(out), marker, "1" if resume else "0", "1" if shard else "0"]
    return subprocess.Popen(
        argv, env=env, cwd=script.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )


def finished(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the script did not end within {timeout:.0f} s:\n{err.decode()[-3000:]}") from None
    return proc.returncode, err.decode(errors="replace")


@pytest.fixture(scope="module")
def script_and_weights(tmp_path_factory):
    """The driver's script, and the weights of its undisturbed run."""
    folder = tmp_path_factory.mktemp("script")
    script = folder / "train.py"
    script.write_text(SCRIPT)
    code, err = finished(run_script(script, folder / "whole", folder / "whole.pt"), scaled(120))
    assert code == 0, err[-3000:]
    return script, torch.load(folder / "whole.pt")


@pytest.mark.parametrize(
    ("to", "shard"), [("the driver", False), ("the driver", True), ("every process of the job", False)]
)
def test_a_driver_told_to_go_saves_stops_everything_and_resumes_to_the_same_weights(
    script_and_weights, tmp_path, to, shard
):
    """SIGTERM to the script's process (Kubernetes signals a container's first process), or to
    every process of the job (Slurm signals them all, workers and the warm process included):
    either way exit 143 with every committed step saved, and a resume ends bitwise as the
    undisturbed run (deterministic=True). ``shard``: 3 workers holding slices of the optimizer
    state stop together, after the same step, and the checkpoint written holds it whole."""
    script, whole = script_and_weights
    run_dir, marker = tmp_path / "run", tmp_path / "marker"
    proc = run_script(script, run_dir, tmp_path / "resumed.pt", str(marker), shard=shard)
    deadline = time.monotonic() + scaled(120)
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert marker.exists(), proc.communicate()[1].decode()[-3000:]
    workers = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    signalled = time.monotonic()
    # Each process signalled has set its disposition: train() in the script, the warm process
    # (ignores it), the workers (their notice).
    if to == "the driver":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGTERM)
    code, err = finished(proc, scaled(30))
    took = time.monotonic() - signalled

    assert code == 143, err[-3000:]
    assert took < 20 + 5, took  # within the grace (FABRIC_MODEL_PREEMPT_GRACE, 20 s), with slack for exiting
    last = err.strip().splitlines()[-1]
    assert last.startswith("SIGTERM: preempted at epoch 2, step ") and last.endswith(", resume=True)"), err[-2000:]
    assert "Traceback" not in err and "warning" not in err
    assert not (run_dir / "join.json").exists()  # the secret is gone
    assert not [pid for pid in workers if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    # The checkpoint holds every step committed before the signal, and none after it.
    (unit, path), *_ = reversed(list_checkpoints(run_dir / "checkpoints"))
    assert load_checkpoint(path)["unit"] == unit
    units_done = {r["epoch"] * 11 + r["step"] for r in records(run_dir, "train")}  # 10 steps + a validation slot
    said = (run_dir / "logs" / "driver.log").read_text()[-4000:]  # which state was kept, and why
    assert len(units_done) >= 13 and unit == max(units_done) + 1, (unit, sorted(units_done), said)
    if shard:  # the members stopped together: rank 0's upload holds every member's slices
        optimizer = load_checkpoint(path)["optimizer"]
        assert len(optimizer["state"]) == 4 and all("momentum_buffer" in s for s in optimizer["state"].values())
    end = json.loads((run_dir / "run.json").read_text())["end"]
    assert end["state"] == "preempted" and end["checkpoint"] == path.name

    code, err = finished(run_script(script, run_dir, tmp_path / "resumed.pt", resume=True), scaled(120))
    assert code == 0, err[-3000:]
    resumed = torch.load(tmp_path / "resumed.pt")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)  # bitwise: deterministic=True


class EndsAt:
    """A driver logger: records join.json's mode while training runs, then ends the run at
    ``iteration`` with ``error`` (None: the run finishes)."""

    def __init__(self, run_dir: Path, iteration: int, error: BaseException | None) -> None:
        self.run_dir, self.iteration, self.error = run_dir, iteration, error
        self.modes: list[int] = []

    def log_train_metrics(self, metrics, iteration, epoch, workers) -> None:
        self.modes.append((self.run_dir / "join.json").stat().st_mode & 0o777)
        if iteration == self.iteration and self.error is not None:
            raise self.error


@pytest.mark.parametrize("error", [None, ValueError("the user's logger failed"), KeyboardInterrupt()])
def test_the_secret_is_removed_however_the_run_ends(run_dir, error):
    """join.json holds the job's secret: mode 0600 while the run lasts, gone after it, whether
    it finished, failed or was interrupted (preempted: the driver test above)."""
    model, opt = fresh_model_and_optimizer()
    logger = EndsAt(run_dir, 3, error)
    fm = FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt, driver_logger_callback=logger)
    try:
        fm.train(1, BATCH, 2, effective_batch_size=GLOBAL, seed=SEED, run_dir=run_dir)
    except (ValueError, SystemExit) as exc:  # Ctrl-C in a script: exit status 130
        assert error is not None and (isinstance(exc, ValueError) or exc.code == 130)
    assert logger.modes and set(logger.modes) == {0o600}
    assert not (run_dir / "join.json").exists()
    expected = {None: "finished", ValueError: "failed", KeyboardInterrupt: "interrupted"}[
        type(error) if error else None
    ]
    assert json.loads((run_dir / "run.json").read_text())["end"]["state"] == expected
