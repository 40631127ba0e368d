"""The newest committed snapshot on disk (state/durable.py), in-process: one file replaced
atomically, newest first; the job's frozen parameters left out with a sample each; a resume
makes it whole with the job's values and keeps it as the checkpoint of its unit, or sets it
aside where the model was built anew. The whole-job kill and resume run in tests/test_resume_auto.py."""

from __future__ import annotations

import torch

from fabric_model.state.checkpoint import (
    SNAPSHOT_NAME,
    encode_state,
    list_checkpoints,
    newest_resume_state,
    read_info,
    state_record,
    write_checkpoint,
)
from fabric_model.state.durable import BASE_SAMPLES, DurableSnapshot, adopt_snapshot
from fabric_model.state.frozen import BASE
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
