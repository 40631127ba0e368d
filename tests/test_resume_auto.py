"""``train(resume="auto")`` and the end state in ``run.json`` (docs/run-directory.md, "Resume"):
a requeued job runs the same call and goes on with an unfinished run, or starts afresh."""

from __future__ import annotations

import copy
import json
import logging
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.run.rundir import RunDirectory
from fabric_model.run.status import status_table, summarize
from fabric_model.state.checkpoint import (
    choose_resume,
    encode_state,
    list_checkpoints,
    state_record,
    write_checkpoint,
)
from fabric_model.step.plan import Plan, Schedule

from .helpers import fresh_model_and_optimizer, make_data, records, run_script_and_its_tree

SEED, EPOCHS, BATCH, GLOBAL = 5, 3, 8, 16
DATA = make_data(96)  # 6 steps an epoch
STEPS = len(DATA) // GLOBAL


def train(run_dir: Path, workers: int = 1, driver_logger=None, **kwargs) -> dict[str, torch.Tensor]:
    """A deterministic run of the tiny MLP; returns its final weights."""
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt, driver_logger_callback=driver_logger)
    fm.train(
        EPOCHS,
        BATCH,
        workers,
        effective_batch_size=GLOBAL,
        seed=SEED,
        run_dir=run_dir,
        deterministic=True,
        tensorboard=False,
        **kwargs,
    )
    return copy.deepcopy(model.state_dict())


def driver_log(run_dir: Path) -> str:
    return (run_dir / "logs" / "driver.log").read_text()


def assert_equal_weights(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    differ = [k for k in reference if not torch.equal(state[k], reference[k])]
    assert not differ, f"not bitwise equal: {differ}"


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """``resume="auto"`` on a directory that does not exist yet: a new run, which finishes."""
    run_dir = tmp_path_factory.mktemp("undisturbed") / "run"
    return run_dir, train(run_dir, resume="auto")


# -- the decision and the record on their own -------------------------------------------------
def _run(path: Path, end: str | None, checkpoint: bool) -> RunDirectory:
    """A run directory as a run leaves it: run.json (with ``end`` if given), a checkpoint if asked."""
    run = RunDirectory(path).create()
    run.write_run_record({"framework": "torch", "plan": {"seed": SEED}, "started": 0.0})
    if end is not None:
        assert run.record_end(end, error="ValueError") if end == "failed" else run.record_end(end)
    if checkpoint:
        model, opt = fresh_model_and_optimizer()
        schedule = Schedule(Plan(len(DATA), BATCH, GLOBAL // BATCH, SEED), EPOCHS, 1, True)
        unit = schedule.units_per_epoch - 1  # after epoch 0
        data = encode_state(state_record(schedule, unit, "torch", BATCH, model.state_dict(), opt.state_dict()))
        write_checkpoint(run.checkpoints, unit, data)
    return run


@pytest.mark.parametrize(
    ("end", "checkpoint", "resumes", "said"),
    [
        ("preempted", True, True, "ended preempted; resuming from ckpt-unit-"),
        ("interrupted", True, True, "ended interrupted; resuming from ckpt-unit-"),
        ("failed", True, True, "ended failed; resuming from ckpt-unit-"),
        (None, True, True, "recorded no end (its process was killed); resuming from ckpt-unit-"),
        ("finished", True, False, "finished; starting afresh"),
        ("preempted", False, False, "holds no checkpoint to resume from; starting afresh"),
        (None, False, False, "holds no checkpoint to resume from; starting afresh"),
    ],
)
def test_auto_resumes_an_unfinished_run_with_a_checkpoint_only(tmp_path, end, checkpoint, resumes, said):
    run = _run(tmp_path / "run", end, checkpoint)
    choice = choose_resume("auto", run.path)
    assert choice.resume is resumes
    assert choice.said is not None and said in choice.said and str(run.path) in choice.said


@pytest.mark.parametrize(
    ("end", "checkpoint", "resumes", "said"),
    [
        (None, False, True, "the driver of the run in {path} vanished; going on with it"),
        (
            None,
            True,
            True,
            "recorded no end (its process was killed); resuming from the workers that wait for it, else",
        ),
        ("failed", False, False, "holds no checkpoint to resume from; starting afresh"),
    ],
)
def test_auto_goes_on_with_a_run_whose_driver_vanished(tmp_path, end, checkpoint, resumes, said):
    """A ``join.json`` left behind (only a driver killed without notice leaves it): its workers
    may wait to be taken back, with or without a checkpoint; a run that recorded its end has none."""
    run = _run(tmp_path / "run", end, checkpoint)
    run.write_join_info(("127.0.0.1", 5), b"\x01" * 32)
    choice = choose_resume("auto", run.path)
    assert choice.resume is resumes
    assert choice.said is not None and said.format(path=run.path) in choice.said, choice.said


def test_auto_without_a_run_starts_afresh_and_true_false_are_unchanged(tmp_path, monkeypatch):
    assert (
        choose_resume("auto", tmp_path / "none").said
        == f'resume="auto": {RunDirectory(tmp_path / "none").path} holds no run; starting afresh'
    )
    monkeypatch.delenv("RESULT_DIR", raising=False)
    assert not choose_resume("auto", None).resume  # every run gets a new directory: nothing to go on with
    run = _run(tmp_path / "result", "preempted", True)
    monkeypatch.setenv("RESULT_DIR", str(run.path))
    assert choose_resume("auto", None).resume  # $RESULT_DIR names the run, as for resume=True
    assert [(c.resume, c.said) for c in (choose_resume(True, None), choose_resume(False, run.path))] == [
        (True, None),
        (False, None),
    ]


def test_the_first_end_recorded_stands(tmp_path):
    run = _run(tmp_path / "run", None, False)
    assert run.end_state() is None
    assert run.record_end("preempted", checkpoint=run.checkpoints / "ckpt-unit-00000006.pt", unit=6)
    assert not run.record_end("failed", error="Preempted")  # the preemption's exception, reaching train()
    end = run.end_state()
    assert end is not None and (end["state"], end["unit"]) == ("preempted", 6)
    assert end["checkpoint"].endswith("ckpt-unit-00000006.pt") and end["time"].endswith("+00:00")
    assert json.loads(run.run_json.read_text())["plan"] == {"seed": SEED}  # the rest of the record kept
    with pytest.raises(ValueError, match="end state"):
        run.record_end("done")
    assert not RunDirectory(tmp_path / "missing").record_end("finished")  # no run.json: logged, not raised


# -- real runs -------------------------------------------------------------------------------
@pytest.mark.processes
def test_bad_values_fail_in_the_caller_naming_resume(tmp_path):
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt)
    for value, shown in (("yes", "'yes'"), (1, "1"), (None, "None")):
        with pytest.raises(
            TypeError, match=rf'Expected `resume` to be True, False or "auto"\. Received: resume={shown}'
        ):
            fm.train(1, BATCH, 1, run_dir=tmp_path / "run", resume=value)
    assert not (tmp_path / "run").exists()  # nothing started


@pytest.mark.processes
def test_auto_on_an_empty_directory_starts_afresh_and_records_finished(undisturbed):
    run_dir, _ = undisturbed
    assert 'resume="auto": ' in driver_log(run_dir) and "holds no run; starting afresh" in driver_log(run_dir)
    assert not records(run_dir, "resume")
    end = RunDirectory(run_dir).end_state()
    assert end is not None and end["state"] == "finished"
    table = status_table(summarize(run_dir))
    assert "state       finished" in table and "ended       finished at " in table


@pytest.mark.processes
def test_auto_after_an_interrupt_resumes_to_the_undisturbed_weights(undisturbed, tmp_path):
    """Ctrl-C (a KeyboardInterrupt in the driver's loop) in the first step after a checkpoint
    is on disk; the same call again resumes from it and ends with the undisturbed weights."""
    run_dir = tmp_path / "run"

    class InterruptAfterACheckpoint:
        def log_train_metrics(self, metrics, iteration, epoch, workers):
            if epoch >= 1 and iteration < EPOCHS * STEPS and list_checkpoints(run_dir / "checkpoints"):
                raise KeyboardInterrupt

    with pytest.raises((KeyboardInterrupt, SystemExit)):  # SystemExit(130) outside an interactive session
        train(run_dir, 2, driver_logger=InterruptAfterACheckpoint(), resume="auto")
    saved = list_checkpoints(run_dir / "checkpoints")
    assert saved, "interrupted before any checkpoint was on disk"
    end = RunDirectory(run_dir).end_state()
    assert end is not None and end["state"] == "interrupted", end

    state = train(run_dir, 1, resume="auto")  # the requeued job: the same call, on another worker count
    resumed = records(run_dir, "resume")
    assert resumed and resumed[-1]["resume_unit"] == saved[-1][0], resumed
    assert f"ended interrupted; resuming from {saved[-1][1].name}" in driver_log(run_dir)
    assert_equal_weights(state, undisturbed[1])
    end = RunDirectory(run_dir).end_state()
    assert end is not None and end["state"] == "finished"


@pytest.mark.processes
def test_auto_on_a_finished_run_starts_afresh(undisturbed, caplog):
    run_dir, weights = undisturbed
    with caplog.at_level(logging.INFO, logger="fabric_model"):
        state = train(run_dir, resume="auto")
    assert f'resume="auto": the run in {RunDirectory(run_dir).path} finished; starting afresh' in caplog.messages
    assert not records(run_dir, "resume")  # a new log: the earlier run's is not appended to
    assert_equal_weights(state, weights)


@pytest.mark.processes
def test_a_user_error_records_failed(tmp_path):
    run_dir = tmp_path / "run"

    class Broken:
        def log_train_metrics(self, metrics, iteration, epoch, workers):
            if iteration == 2:
                raise ValueError("the logger is broken")

    with pytest.raises(ValueError, match="the logger is broken"):
        train(run_dir, driver_logger=Broken())
    end = RunDirectory(run_dir).end_state()
    assert end is not None and (end["state"], end["error"]) == ("failed", "ValueError")
    table = status_table(summarize(run_dir))
    assert "failed (resume=True goes on)" in table and "(error=ValueError)" in table


# -- a whole job lost: the snapshot on disk ----------------------------------------------------
SNAPSHOT_STEPS = 2
KILLED_JOB = """
import os, signal, sys, time
sys.path.insert(0, {repo!r})
from pathlib import Path
from fabric_model.state import durable
from fabric_model.state.checkpoint import SNAPSHOT_NAME, list_checkpoints, read_info
from tests.test_resume_auto import train

durable.WRITE_SHARE = 1.0  # every committed snapshot written once the one before is (the bound below)

run_dir = Path({run_dir!r})


class KilledOnceASnapshotIsOnDisk:
    '''SIGKILL to the driver (its workers die with it) in epoch 2, once a snapshot newer than the
    epoch's checkpoint is on disk (its writer is a thread of its own: waited for, bounded).'''

    def log_train_metrics(self, metrics, iteration, epoch, workers):
        if iteration < {at}:
            return
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            saved = list_checkpoints(run_dir / "checkpoints")
            try:
                unit = read_info(run_dir / "checkpoints" / SNAPSHOT_NAME).unit
            except (OSError, ValueError):
                unit = -1
            if saved and unit > saved[-1][0]:
                print("killed at", iteration, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.01)


train(run_dir, 2, driver_logger=KilledOnceASnapshotIsOnDisk(), resume="auto")
"""


@pytest.mark.processes
def test_a_job_killed_whole_resumes_from_its_snapshot_on_disk(undisturbed, tmp_path, monkeypatch):
    """Driver and workers SIGKILLed mid-epoch, a checkpoint behind: the same call again resumes
    from the newest committed snapshot on disk, not the checkpoint, redoes at most two snapshot
    intervals (the interval, and the write under way: the writes' share is lifted, so each
    committed snapshot is written once the one before is), and ends with the undisturbed weights.
    Its workers died with the driver: the restarted driver waits for them in vain, then resumes."""
    run_dir, at = tmp_path / "run", STEPS + 3  # in epoch 2, after its checkpoint
    env = dict(os.environ, FABRIC_MODEL_SNAPSHOT_STEPS=str(SNAPSHOT_STEPS), FABRIC_MODEL_SNAPSHOT_SHARE="0")
    script = KILLED_JOB.format(repo=str(Path(__file__).resolve().parents[1]), run_dir=str(run_dir), at=at)
    code, out = run_script_and_its_tree(script, within=180, env=env)
    assert code == -signal.SIGKILL, out[-3000:]
    killed_at = int(out.split("killed at ")[1].split()[0])
    epoch_checkpoint = list_checkpoints(run_dir / "checkpoints")[-1][0]

    # The requeued job: the same call. It looks for workers that wait for the killed driver
    # (FABRIC_MODEL_DRIVER_WAIT here), finds none (they died with it), and resumes from the disk.
    monkeypatch.setenv("FABRIC_MODEL_DRIVER_WAIT", "60")
    state = train(run_dir, 1, resume="auto")
    assert "took back" not in driver_log(run_dir)
    (resumed,) = records(run_dir, "resume")
    assert resumed["resume_unit"] > epoch_checkpoint, (resumed, epoch_checkpoint)
    schedule = Schedule(Plan(len(DATA), BATCH, GLOBAL // BATCH, SEED), EPOCHS, 1, False)
    redone = killed_at - schedule.steps_before(resumed["resume_unit"])
    assert 0 <= redone <= 2 * SNAPSHOT_STEPS, (killed_at, resumed)
    assert_equal_weights(state, undisturbed[1])
    assert not (run_dir / "checkpoints" / "snapshot.pt").exists()  # finished: the checkpoints hold the result
    # The resumed epoch's average goes on from its steps before the snapshot, as if never stopped.
    for epoch, expected in epoch_averages(undisturbed[0]).items():
        got = epoch_averages(run_dir)[epoch]
        assert got.keys() == expected.keys()
        assert all(abs(got[k] - expected[k]) <= 1e-6 * abs(expected[k]) for k in expected), (epoch, got, expected)


def epoch_averages(run_dir: Path) -> dict[int, dict[str, float]]:
    """Each epoch's training averages as its last step's record gives them (a redone step's later record)."""
    final = {(r["epoch"], r["step"]): r for r in records(run_dir, "train")}
    return {e: final[(e, STEPS - 1)]["epoch_metrics"] for e in range(EPOCHS)}
