"""The newest committed snapshot on disk (state/durable.py), in-process: one file replaced
atomically, newest first; the job's frozen parameters left out with a sample each; a resume
makes it whole with the job's values and keeps it as the checkpoint of its unit, or sets it
aside where the model was built anew; its samples exact past float32's integers. A failure of a
driver writer's thread (this one's, the checkpoints') is reported once (run/background.py). The
whole-job kill and resume run in tests/test_resume_auto.py."""

from __future__ import annotations

import json
import logging
import time

import torch

from fabric_model.run import console
from fabric_model.run.background import BackgroundFailures
from fabric_model.run.rundir import RunDirectory
from fabric_model.state import durable as durable_module
from fabric_model.state import writer as writer_module
from fabric_model.state.checkpoint import (
    SNAPSHOT_NAME,
    encode_state,
    list_checkpoints,
    newest_resume_state,
    read_info,
    state_record,
    write_checkpoint,
)
from fabric_model.state.durable import BASE_SAMPLES, DurableSnapshot, _sample, _sample_index, adopt_snapshot
from fabric_model.state.frozen import BASE
from fabric_model.state.writer import CheckpointBook
from fabric_model.step.plan import Plan, Schedule

SCHEDULE = Schedule(Plan(96, 8, 2, 5), 3, 1, False)  # 6 steps an epoch


def lora_shaped() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 32), torch.nn.Linear(32, 4))
    model[0].weight.requires_grad_(False)
    return model


def record_of(model: torch.nn.Module, unit: int, frozen: bool = True) -> dict:
    """A snapshot's record as the driver holds it: complete, ``base`` naming the frozen part."""
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    record = state_record(SCHEDULE, unit, "torch", 8, dict(model.state_dict()), optimizer.state_dict())
    if frozen:
        record[BASE] = ["0.weight"]
    return record


def test_the_newest_snapshot_offered_is_on_disk_without_the_frozen_part(tmp_path):
    model = lora_shaped()
    durable = DurableSnapshot(tmp_path)
    for unit in (3, 5, 4):  # an older offer after a newer one is ignored
        durable.offer(unit, record_of(model, unit))
    durable.close(10)
    assert durable.written_unit == 5 and read_info(tmp_path / SNAPSHOT_NAME).unit == 5
    saved = torch.load(tmp_path / SNAPSHOT_NAME, weights_only=True)
    assert "0.weight" not in saved["model"] and torch.equal(saved["model"]["1.weight"], model[1].weight)
    assert saved[BASE] == ["0.weight"] and list(saved[BASE_SAMPLES]["0.weight"][0]) == [1000, 32]
    assert (tmp_path / SNAPSHOT_NAME).stat().st_size < 32_000 * 4 / 2  # the 128 kB embedding is not there
    assert [p.name for p in tmp_path.iterdir()] == [SNAPSHOT_NAME]  # no temporary file left


def test_a_resume_takes_the_snapshot_when_newer_than_every_checkpoint(tmp_path):
    model = lora_shaped()
    write_checkpoint(tmp_path, 7, encode_state(record_of(model, 7, frozen=False)))
    durable = DurableSnapshot(tmp_path)
    durable.offer(5, record_of(model, 5))
    durable.close(10)
    assert newest_resume_state(tmp_path).unit == 7  # older than the checkpoint: the checkpoint
    durable = DurableSnapshot(tmp_path)
    durable.offer(10, record_of(model, 10))
    durable.close(10)
    info = newest_resume_state(tmp_path)
    assert info.unit == 10 and info.path.name == SNAPSHOT_NAME


def test_a_snapshot_adopted_is_a_complete_checkpoint_with_the_job_s_frozen_values(tmp_path):
    model = lora_shaped()
    durable = DurableSnapshot(tmp_path)
    durable.offer(10, record_of(model, 10))
    durable.close(10)
    again = lora_shaped()  # the same script run again: the same frozen values
    state = again.state_dict()
    frozen = {"0.weight": state["0.weight"]}
    info = adopt_snapshot(read_info(tmp_path / SNAPSHOT_NAME), frozen, list(state))
    assert info is not None and info.unit == 10 and info.path.name == "ckpt-unit-00000010.pt"
    assert not (tmp_path / SNAPSHOT_NAME).exists() and [u for u, _ in list_checkpoints(tmp_path)] == [10]
    saved = torch.load(info.path, weights_only=True)  # loadable without fabric_model, whole
    assert list(saved["model"]) == list(state) and BASE_SAMPLES not in saved
    assert all(torch.equal(saved["model"][k], v) for k, v in model.state_dict().items())


def test_a_snapshot_of_other_frozen_values_is_set_aside(tmp_path):
    durable = DurableSnapshot(tmp_path)
    durable.offer(10, record_of(lora_shaped(), 10))
    durable.close(10)
    torch.manual_seed(1)
    anew = torch.nn.Sequential(torch.nn.Embedding(1000, 32), torch.nn.Linear(32, 4))  # another draw
    state = anew.state_dict()
    assert adopt_snapshot(read_info(tmp_path / SNAPSHOT_NAME), {"0.weight": state["0.weight"]}, list(state)) is None
    assert (tmp_path / (SNAPSHOT_NAME + ".unusable")).exists() and newest_resume_state(tmp_path) is None


def test_writes_take_at_most_their_share_and_a_flush_writes_the_newest_at_once(tmp_path, monkeypatch):
    import time

    from fabric_model.state import durable as module

    monkeypatch.setattr(module, "WRITE_SHARE", 1e-6)  # after any write, the next waits for ages
    model = lora_shaped()
    writer = DurableSnapshot(tmp_path)
    writer.offer(3, record_of(model, 3))
    writer.flush(10)
    writer.offer(4, record_of(model, 4))
    writer.offer(5, record_of(model, 5))
    time.sleep(0.1)
    assert writer.written_unit == 3  # waiting its turn; the newest replaced the one before
    writer.close(10)  # flushes: the newest goes now
    assert writer.written_unit == 5 and read_info(tmp_path / SNAPSHOT_NAME).unit == 5


# -- large frozen tensors: the sample's index in integers ---------------------------------------
PAST_FLOAT32 = 2**24 + 4  # a float32 linspace rounds its last index, 2**24 + 3, up to 2**24 + 4: past the end


def test_the_sample_index_is_exact_at_any_size():
    assert _sample_index(0).tolist() == [] and _sample_index(1).tolist() == [0]
    assert _sample_index(4096).tolist() == list(range(4096))
    for n in (4097, PAST_FLOAT32, 64_000_000, 2**40):
        index = _sample_index(n)
        assert index.dtype == torch.int64
        assert index.tolist() == [i * (n - 1) // 4095 for i in range(4096)]  # Python's exact integers
        assert index[0] == 0 and index[-1] == n - 1


def test_a_frozen_tensor_past_2_24_elements_is_sampled_at_the_exact_elements():
    values = torch.arange(PAST_FLOAT32, dtype=torch.int32).reshape(-1, 4)  # each element its own index
    shape, sample = _sample(values)
    assert shape == [PAST_FLOAT32 // 4, 4]
    assert sample.tolist() == [i * (PAST_FLOAT32 - 1) // 4095 for i in range(4096)]


def test_the_lora_frozen_benchmark_s_embedding_is_written_and_adopted(tmp_path):
    """benchmarks/bench_models.py's ``lora_frozen``: a frozen 500,000 x 128 embedding (64,000,000
    elements), whose sample crashed the writer's thread (index 64,000,000 out of bounds)."""
    failures = BackgroundFailures()
    embedding = torch.arange(64_000_000, dtype=torch.float32).reshape(500_000, 128)
    head = torch.nn.Linear(128, 10)
    state = {"0.weight": embedding, "1.weight": head.weight.detach(), "1.bias": head.bias.detach()}
    optimizer = torch.optim.AdamW(head.parameters())
    record = state_record(SCHEDULE, 5, "torch", 8, state, optimizer.state_dict())
    record[BASE] = ["0.weight"]
    durable = DurableSnapshot(tmp_path, failures)
    durable.offer(5, record)
    durable.close(60)
    assert failures.failures == [] and not durable.failed and durable.written_unit == 5
    shape, sample = torch.load(tmp_path / SNAPSHOT_NAME, weights_only=True)[BASE_SAMPLES]["0.weight"]
    assert list(shape) == [500_000, 128] and sample[-1] == embedding[-1, -1]
    info = adopt_snapshot(read_info(tmp_path / SNAPSHOT_NAME), {"0.weight": embedding}, list(state))
    assert info is not None and info.unit == 5  # the samples match the job's values: not set aside


# -- a failing writer thread: one line, the traceback in the log file, a record in run.json ----------
def test_a_failing_snapshot_writer_is_reported_once_and_recorded_in_run_json(tmp_path, capfd, monkeypatch):
    run_dir = RunDirectory(tmp_path).create()
    run_dir.write_run_record({"framework": "torch"})

    def out_of_bounds(record):
        raise IndexError("index 64000000 is out of bounds for dimension 0 with size 64000000")

    monkeypatch.setattr(durable_module, "encode_state", out_of_bounds)
    monkeypatch.setattr(console, "user_configured_logging", lambda: False)  # pytest's own handlers aside
    monkeypatch.setenv("COLUMNS", "200")  # a terminal wide enough for what failed and what it costs
    detach = console.attach(1, run_dir.logs / "driver.log")  # the screen and the log file, as in a run
    try:
        failures = BackgroundFailures(run_dir)
        writer = DurableSnapshot(run_dir.checkpoints, failures)
        writer.offer(3, record_of(lora_shaped(), 3))
        writer.flush(30)  # returns once the thread has failed: nothing is left waiting
        writer.offer(4, record_of(lora_shaped(), 4))  # dropped: the thread is gone
        began = time.monotonic()
        writer.close(30)
        assert time.monotonic() - began < 10  # no wait for a write that cannot come (else 30 s)
    finally:
        detach()
    failures.record()
    failures.record()  # nothing new: nothing added twice
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if "failed" in line]
    assert len(said) == 1, err  # one line, cut to the terminal's width: what failed and what it costs first
    shown = f"[fabric-model] warning: the durable snapshot writer failed: {durable_module.FAILURE_COST} (IndexError"
    assert said[0].startswith(shown)
    assert "Traceback" not in err
    logged = (run_dir.logs / "driver.log").read_text()
    assert logged.count("the durable snapshot writer failed") == 1 and "Traceback" in logged
    assert "in out_of_bounds" in logged  # where it failed, for whoever reads the log
    recorded = json.loads(run_dir.run_json.read_text())
    assert recorded["framework"] == "torch" and len(recorded["background_failures"]) == 1
    entry = recorded["background_failures"][0]
    assert entry["thread"] == "the durable snapshot writer"
    assert entry["error"] == "IndexError: index 64000000 is out of bounds for dimension 0 with size 64000000"
    assert entry["cost"] == durable_module.FAILURE_COST and entry["time"]
    assert writer.failed and writer.written_unit == -1 and not writer.path.exists()


class _Metrics:
    def checkpoint(self, **record) -> None:
        pass


def test_a_failing_checkpoint_writer_is_reported_once_and_nothing_waits_for_it(tmp_path, caplog):
    def broken_stream(raw, unit):
        raise RuntimeError(f"no stream for unit {unit}")

    failures = BackgroundFailures()
    book = CheckpointBook(tmp_path, "torch", 3, SCHEDULE.units_per_epoch, _Metrics(), broken_stream, failures=failures)
    with caplog.at_level(logging.WARNING, logger="fabric_model"):
        book.store(0, 1, 6, b"bytes")
        began = time.monotonic()
        book.finish_writes(30)  # returns once the thread has failed
        assert time.monotonic() - began < 10
        book.store(0, 1, 12, b"bytes")  # dropped: not accepted
        book.finish_writes(30)
        book.close(30)
    assert book.failed and book.accepted == 6 and list_checkpoints(tmp_path) == []
    reported = [r for r in caplog.records if "checkpoint writer failed" in r.getMessage()]
    assert len(reported) == 1 and reported[0].exc_info is not None
    assert [f.error for f in failures.failures] == ["RuntimeError: no stream for unit 6"]
    assert failures.failures[0].cost == writer_module.FAILURE_COST
