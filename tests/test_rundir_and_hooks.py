"""The run directory, the metrics log, the hooks dispatcher and the fault seams, in-process."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from fabric_model.callbacks import Callback
from fabric_model.context import WorkerContext
from fabric_model.run.hooks import Hooks, OldStyleLogger
from fabric_model.run.metrics_log import MetricsLog, epoch_so_far, read_records
from fabric_model.run.rundir import RunDirectory, atomic_write
from fabric_model.step.plan import Plan, Schedule
from fabric_model.testing import CheckpointFault, FailCollective, FaultInjector

PLAN = Plan(num_samples=40, items_per_micro_batch=4, micro_batches=2, seed=3)  # 5 steps an epoch
SCHEDULE = Schedule(PLAN, epochs=3, validation_freq=1, has_test=True)  # 6 units an epoch


# -- RunDirectory --------------------------------------------------------------------------
def test_run_directory_is_the_argument_then_result_dir_then_a_new_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RESULT_DIR", str(tmp_path / "results"))
    assert RunDirectory.resolve(tmp_path / "mine").path == (tmp_path / "mine").resolve()
    assert RunDirectory.resolve(None).path == (tmp_path / "results").resolve()
    assert RunDirectory.resolve(None, for_resume=True).path == (tmp_path / "results").resolve()
    monkeypatch.delenv("RESULT_DIR")
    fresh = RunDirectory.resolve(None)
    assert fresh.path.parent == (tmp_path / "fabric_runs").resolve() and not fresh.path.exists()
    assert RunDirectory.resolve(None).path != fresh.path
    with pytest.raises(ValueError, match=r"Expected `run_dir` .* Received: run_dir=None"):
        RunDirectory.resolve(None, for_resume=True)
    run = fresh.create()
    assert run.logs.is_dir() and run.metrics == run.path / "logs" / "metrics.jsonl"
    assert run.worker_log(3).name == "worker-3.log" and run.joined_log(0).name == "joined-0.log"
    assert (run.checkpoints, run.model) == (run.path / "checkpoints", run.path / "model")


def test_run_record_and_join_info(tmp_path):
    run = RunDirectory(tmp_path).create()
    assert run.recorded_seed() is None
    run.write_run_record({"framework": "torch", "plan": {"seed": 42}})
    assert run.recorded_seed() == 42
    run.write_join_info(("127.0.0.1", 5000), b"\x01\x02")
    assert json.loads(run.join_json.read_text()) == {"driver": "127.0.0.1:5000", "secret": "0102"}
    assert stat.S_IMODE(run.join_json.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["join.json", "logs", "run.json"]  # no temporary left
    run.remove_join_info()
    run.remove_join_info()  # twice is fine
    assert not run.join_json.exists()


def test_atomic_write_leaves_the_old_file_when_the_writer_fails(tmp_path):
    path = tmp_path / "f"
    atomic_write(path, lambda f: f.write(b"old"))

    def fail(f):
        f.write(b"part")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, fail)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f"]


# -- MetricsLog ----------------------------------------------------------------------------
def _train(log: MetricsLog, epoch: int, step: int, loss: float) -> None:
    log.train(
        epoch=epoch,
        step=step,
        iteration=epoch * 5 + step + 1,
        generation=0,
        workers=2,
        metrics={"loss": loss},
        epoch_metrics={"loss": loss},
        micro_batches={1: [1], 0: [0]},
    )


def test_metrics_log_records_keep_their_shape(tmp_path):
    path = tmp_path / "logs" / "metrics.jsonl"
    with MetricsLog(path) as log:
        _train(log, 0, 0, 1.0)
        log.generation(generation=1, members=[0, 2], reason="start", resume_unit=0, source_rank=-1)
        log.checkpoint(unit=5, epoch=0, worker=0, generation=1, path="checkpoints/x.pt", seconds=0.5, removed=[])
        log.checkpoint(unit=11, epoch=1, worker=0, generation=1, error="full")
        log.end(iteration=3, replica_digests={1: "b", 0: "a"})
        log.onnx(path=None, error="no onnx")
    train, gen, ok, failed, end, onnx = read_records(path)
    assert list(train) == [
        "type", "time", "epoch", "step", "iteration", "generation", "workers", "metrics", "epoch_metrics",
        "micro_batches",
    ]  # fmt: skip
    assert train["micro_batches"] == {"0": [0], "1": [1]} and "inferred" not in train
    assert gen["workers"] == 2 and "checkpoint" not in gen
    assert list(ok)[-3:] == ["path", "seconds", "removed"] and "error" not in ok
    assert failed["error"] == "full" and "path" not in failed
    assert list(end["replica_digests"]) == ["0", "1"]
    assert list(onnx) == ["type", "path", "error", "time"]


def test_a_train_record_is_the_line_json_dumps_makes_nan_and_infinities_in_its_words(tmp_path):
    """The driver makes a step's line by hand (run/metrics_log.py): readers get the same JSON."""
    path = tmp_path / "metrics.jsonl"
    metrics = {"loss": 0.1, "acc": float("nan"), "up": float("inf"), "down": -float("inf"), "count": 3, 'a "b"': -0.0}
    with MetricsLog(path) as log:
        log.train(epoch=1, step=2, iteration=7, generation=3, workers=2, metrics=metrics, epoch_metrics={"loss": 0.2},
                  micro_batches={1: [1], 0: [0]}, inferred=True)  # fmt: skip
        assert len(read_records(path)) == 1  # written at once: a driver killed next leaves it
    line = path.read_text().splitlines()[0]
    expected = {"type": "train", "time": json.loads(line)["time"], "epoch": 1, "step": 2, "iteration": 7}
    expected.update(generation=3, workers=2, metrics=metrics, epoch_metrics={"loss": 0.2}, inferred=True)
    expected["micro_batches"] = {"0": [0], "1": [1]}
    assert line == json.dumps(expected)


def test_resumed_log_appends_after_cutting_a_partial_line_and_replays_the_latest_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path) as log:
        for step in range(5):
            _train(log, 0, step, 1.0)
        log.test(epoch=0, iteration=5, workers=2, metrics={"loss": 2.0})
        _train(log, 1, 4, 9.0)  # past the resume unit: redone, left out
        _train(log, 0, 4, 0.5)  # the same step again, later (redone after a failure): it wins
    with open(path, "a") as f:
        f.write('{"type": "train", "ep')  # the driver died mid-line
    train_history, test_history = MetricsLog.replay(path, SCHEDULE, unit=SCHEDULE.unit(1, 0))
    assert train_history == [{"epoch": 0, "loss": 0.5}]
    assert test_history == [{"epoch": 0, "loss": 2.0}]
    assert MetricsLog.replay(path, SCHEDULE, unit=SCHEDULE.unit(0, 5)) == (train_history, [])  # before validation
    with MetricsLog(path, append=True) as log:
        log.resume(checkpoint="ckpt-unit-00000006.pt", resume_unit=6, epoch=0, iteration=5)
    lines = path.read_text().splitlines()
    assert len(lines) == 9 and all(json.loads(line) for line in lines)
    assert json.loads(lines[-1])["type"] == "resume"
    assert MetricsLog.replay(tmp_path / "absent.jsonl", SCHEDULE, 6) == ([], [])


def test_a_resume_inside_an_epoch_gets_that_epoch_s_steps_before_it_the_latest_record_of_each(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path) as log:
        for step in range(5):
            _train(log, 0, step, 1.0)
        for step in range(4):
            _train(log, 1, step, 2.0 + step)
        _train(log, 1, 1, 7.0)  # redone after a failure: the later record
    assert epoch_so_far(path, SCHEDULE, SCHEDULE.unit(1, 3)) == [
        (1, 0, {"loss": 2.0}),
        (1, 1, {"loss": 7.0}),
        (1, 2, {"loss": 4.0}),
    ]
    assert epoch_so_far(path, SCHEDULE, SCHEDULE.unit(1, 0)) == []  # at an epoch's start: nothing before it


# -- Hooks ---------------------------------------------------------------------------------
class NewLogger:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def on_train_begin(self) -> None:
        self.calls.append("logger.begin")

    def on_train_end(self) -> None:
        self.calls.append("logger.end")

    def log_train_metrics(self, metrics, iteration, epoch, workers) -> None:
        self.calls.append(("logger.train", metrics, iteration, epoch, workers))


class OldLogger:
    """IBM's signature; no on_train_begin, no log_test_metrics."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def log_train_metrics(self, loss, acc, completed_batch, worker=0) -> None:
        self.calls.append(("old.train", loss, "nan" if acc != acc else acc, completed_batch, worker))

    def on_train_end(self) -> None:
        self.calls.append("old.end")


class Recorder(Callback):
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def on_train_begin(self) -> None:
        self.calls.append("callback.begin")

    def on_train_end(self) -> None:
        self.calls.append("callback.end")

    def on_epoch_end(self, epoch: int) -> None:
        self.calls.append(("callback.epoch_end", epoch))


def test_worker_hooks_call_the_logger_around_the_callbacks():
    calls: list = []
    hooks = Hooks.for_worker(NewLogger(calls), [Recorder(calls)])
    hooks.set_context("model", {"epochs": 1})
    assert hooks.callbacks[0].model == "model" and hooks.callbacks[0].params == {"epochs": 1}
    hooks.on_train_begin()
    hooks.on_epoch_begin(0)  # nobody defines more than the base class's no-op: skipped
    hooks.log_train_metrics({"loss": 1.0}, 1, 0, 2)
    hooks.log_test_metrics({"loss": 1.0}, 1, 0)  # the logger lacks it: skipped
    hooks.on_epoch_end(0)
    hooks.on_train_end()
    assert calls == [
        "logger.begin",
        "callback.begin",
        ("logger.train", {"loss": 1.0}, 1, 0, 2),
        ("callback.epoch_end", 0),
        "callback.end",
        "logger.end",
    ]
    assert hooks.defines("log_train_metrics") and not Hooks.for_worker(None, []).defines("log_train_metrics")


def test_old_signature_loggers_get_loss_first_metric_and_rank_or_workers(monkeypatch):
    calls: list = []
    worker = Hooks.for_worker(OldLogger(calls), [Recorder(calls)])
    assert isinstance(worker.loggers[0], OldStyleLogger)
    monkeypatch.setattr("fabric_model.context._current", WorkerContext(worker_id=5, rank=1, world_size=2))
    worker.on_train_begin()  # the old logger lacks it
    worker.log_train_metrics({"loss": 0.5, "acc": 0.9, "top5": 1.0}, 7, 0, 2)
    worker.log_test_metrics({"loss": 0.5}, 7, 0)  # lacks it too
    worker.on_train_end()
    monkeypatch.undo()
    # The user's logger(s) come first, the default display stays (a list is accepted).
    driver = Hooks.for_driver([OldLogger(calls)], NewLogger(calls), None)
    driver.log_train_metrics({"loss": 0.25}, 8, 0, 3)
    driver.on_train_end()
    assert calls == [
        "callback.begin",
        ("old.train", 0.5, 0.9, 7, 1),
        "callback.end",
        "old.end",
        ("old.train", 0.25, "nan", 8, 3),  # no metric: NaN, which IBM's `acc / 100.0` takes (None would fail)
        ("logger.train", {"loss": 0.25}, 8, 0, 3),
        "old.end",
        "logger.end",
    ]


def test_notes_reach_the_progress_display_and_seams_default_to_identity():
    lines: list[str] = []

    class Progress:
        def note(self, line: str) -> None:
            lines.append(line)

    hooks = Hooks.for_driver(None, Progress())
    hooks.note("model/model.onnx written")
    assert lines == ["model/model.onnx written"]
    stream, collective = object(), object()
    assert hooks.wrap_checkpoint_stream(stream, 3) is stream and hooks.wrap_collective(collective) is collective


# -- fault seams -----------------------------------------------------------------------------
class FakeCollective:
    def __init__(self) -> None:
        self.world_size, self.started = 2, []

    def all_reduce_start(self, tensor):
        self.started.append(tensor)
        return "work"


def test_wrapped_collective_fires_a_collective_failure_once(tmp_path, monkeypatch):
    from fabric_model.transport.collective import CollectiveError

    real = FakeCollective()
    collective = Hooks.for_worker(FaultInjector([FailCollective(worker=5, step=3)], tmp_path)).wrap_collective(real)
    assert collective.world_size == 2  # everything else is the real collective's
    context = WorkerContext(worker_id=5, global_step=2)
    monkeypatch.setattr("fabric_model.context._current", context)
    assert collective.all_reduce_start("t2") == "work"
    context.global_step = 3
    with pytest.raises(CollectiveError, match="injected collective failure at step 3"):
        collective.all_reduce_start("t3")
    assert collective.all_reduce_start("t3") == "work"  # the step redone runs clean
    assert real.started == ["t2", "t3"] and (tmp_path / "fault-0").exists()


def test_checkpoint_fault_fails_writes_from_its_unit_on(tmp_path):
    faults = FaultInjector([CheckpointFault("enospc", 21)], tmp_path)
    target = tmp_path / "ckpt"
    with open(target, "wb") as raw:
        assert faults.wrap_checkpoint_stream(raw, 10) is raw
        stream = faults.wrap_checkpoint_stream(raw, 21)
        stream.write(b"x" * 1000)
        with pytest.raises(OSError, match="No space left"):
            stream.write(b"y" * 100)
        assert faults.wrap_checkpoint_stream(raw, 32) is not raw  # every write from the unit on
    assert Path(target).stat().st_size == 1024  # what was written before the failure is on disk
    with pytest.raises(ValueError, match="mode"):
        CheckpointFault("full", 1)  # type: ignore[arg-type]
