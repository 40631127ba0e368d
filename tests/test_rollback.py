"""No holder of the state left (docs/architecture.md, "Elasticity", "No holder left"): the run rolls
back to the newest checkpoint or in-memory snapshot, or to unit 0, and the result does not change.
The state that rank 0 uploads is fenced: only rank 0 of the driver's current generation is heard."""

from __future__ import annotations

import copy
import pickle
import struct
import types

import pytest
import torch
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.driver.book import StateBook
from fabric_model.setup.config import SnapshotCadence
from fabric_model.state import wire
from fabric_model.state.checkpoint import checkpoint_due, checkpoint_name, decode_state, state_record
from fabric_model.state.uploader import StateUploader
from fabric_model.state.writer import CheckpointBook
from fabric_model.step.plan import Plan, Schedule
from fabric_model.testing import FaultInjector, Hang, Kill
from fabric_model.transport import protocol as p

from .helpers import (
    final_train_records,
    fresh_model_and_optimizer,
    make_data,
    max_rel_diff,
    records,
    reference_train,
    sample_indices_of_steps,
)

SEED, EPOCHS, BATCH, GLOBAL = 5, 3, 8, 24
DATA = make_data(240)  # 10 steps an epoch, 30 in all
PLAN = Plan(len(DATA), BATCH, GLOBAL // BATCH, SEED)
SCHEDULE = Schedule(PLAN, EPOCHS, 1, True)  # 11 units an epoch: 10 steps and the validation slot


@pytest.fixture(scope="module")
def undisturbed():
    model, opt = fresh_model_and_optimizer()
    reference_train(model, opt, DATA, seed=SEED, epochs=EPOCHS, batch_size=BATCH, micro_batches=GLOBAL // BATCH)
    return copy.deepcopy(model.state_dict())


def train(run_dir, marker_dir, faults, workers=3, checkpoint_freq=1):
    model, opt = fresh_model_and_optimizer()
    injector = FaultInjector(faults, marker_dir)
    result = FabricModel(model, lambda: (DATA, DATA[:40]), F.cross_entropy, opt, worker_logger_callback=injector).train(
        EPOCHS, BATCH, workers, effective_batch_size=GLOBAL, seed=SEED, run_dir=run_dir, checkpoint_freq=checkpoint_freq
    )
    return model, result


def assert_invariants(run_dir, result, model, reference):
    final = final_train_records(run_dir)
    assert [(r["epoch"], r["step"]) for r in final] == [(e, s) for e in range(EPOCHS) for s in range(10)]
    used = sample_indices_of_steps(PLAN, final)
    for epoch in range(EPOCHS):
        assert sorted(used[epoch]) == list(range(len(DATA))), f"epoch {epoch}: not every sample exactly once"
    assert len(set(result.replica_digests.values())) == 1, result.replica_digests
    assert max_rel_diff(model.state_dict(), reference) <= 1e-5
    assert [h["epoch"] for h in result.history] == list(range(EPOCHS))
    assert [h["epoch"] for h in result.test_history] == list(range(EPOCHS))


def rollbacks(run_dir) -> list[dict]:
    return [g for g in records(run_dir, "generation") if "rolled_back_from" in g]


# -- whole jobs ------------------------------------------------------------------------------
@pytest.mark.processes
@pytest.mark.timeout(240)
def test_the_issue_schedule_kill_kill_then_freeze_the_last_survivor(undisturbed, run_dir, tmp_path, monkeypatch):
    """3 engines, per-epoch checkpoints, replacement on: SIGKILL at steps 9 and 23, SIGSTOP the
    last original worker at 26. Before rollback this failed with "every worker holding the
    training state was lost" whenever the frozen worker was the only holder left."""
    monkeypatch.setenv("EDT_HEARTBEAT_TIME_OUT", "3")
    model, result = train(run_dir, tmp_path, [Kill(0, 9), Kill(1, 23), Hang(2, 26)])
    assert_invariants(run_dir, result, model, undisturbed)
    for g in rollbacks(run_dir):  # when the frozen worker was the last holder, the run went back
        assert g["resume_unit"] <= g["rolled_back_from"] and g["restored"] in ("checkpoint", "snapshot")


@pytest.mark.processes
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "checkpoint_freq, snapshot_steps, restored",
    [(1, "100", "checkpoint"), (0, "4", "snapshot"), (0, "0", None)],
    ids=["checkpoint", "snapshot-only", "nothing-saved"],
)
def test_every_worker_killed_at_once_mid_epoch(
    undisturbed, run_dir, tmp_path, monkeypatch, checkpoint_freq, snapshot_steps, restored
):
    monkeypatch.setenv("FABRIC_MODEL_SNAPSHOT_STEPS", snapshot_steps)
    monkeypatch.setenv("FABRIC_MODEL_SNAPSHOT_SECONDS", "0")
    monkeypatch.setenv("FABRIC_MODEL_SNAPSHOT_SHARE", "0")  # every 4 steps exactly, however fast the steps
    killed_at = SCHEDULE.unit(1, 5)  # every worker dies in the allreduce of epoch 1, step 5
    # 2 workers accumulating the 3 micro-batches of a step: fewer processes to start, same steps.
    model, result = train(run_dir, tmp_path, [Kill(w, 15) for w in range(2)], 2, checkpoint_freq)
    assert_invariants(run_dir, result, model, undisturbed)
    (back,) = rollbacks(run_dir)
    assert back["rolled_back_from"] == killed_at and back.get("restored") == restored
    if restored == "checkpoint":
        assert (back["resume_unit"], back["checkpoint"]) == (SCHEDULE.unit(0, 10), checkpoint_name(10))
    elif restored == "snapshot":  # every 4 steps: the last one before the kill
        assert SCHEDULE.unit(1, 0) < back["resume_unit"] < killed_at and "checkpoint" not in back
    else:
        assert back["resume_unit"] == 0
    # The steps committed from the resume unit to the kill were redone: each has two records,
    # the later one (the replay) final.
    redone = SCHEDULE.steps_before(killed_at) - SCHEDULE.steps_before(back["resume_unit"])
    assert redone > 0 and len(records(run_dir, "train")) == EPOCHS * 10 + redone


# -- the fence and the driver's books, without processes -------------------------------------
def _state_bytes(unit: int) -> bytes:
    """A state record as rank 0 uploads it (state/wire.py)."""
    model, opt = fresh_model_and_optimizer()
    return wire.encode(state_record(SCHEDULE, unit, "torch", BATCH, model.state_dict(), opt.state_dict()))


def _same_record(a: dict, b: dict) -> bool:
    return (
        a.keys() == b.keys()
        and all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])
        and all(a[k] == b[k] for k in a if k not in ("model", "optimizer"))
    )


class _Metrics:
    def __init__(self) -> None:
        self.checkpoints: list[dict] = []

    def checkpoint(self, **record) -> None:
        self.checkpoints.append(record)


def _chunks(generation: int, unit: int, kind: str, data: bytes, size: int = 1000) -> list[p.StateChunk]:
    parts = [data[i : i + size] for i in range(0, len(data), size)]
    return [p.StateChunk(generation, unit, kind, i, part, last=i == len(parts) - 1) for i, part in enumerate(parts)]


def test_only_rank_0_of_the_current_generation_may_upload_state(tmp_path):
    metrics = _Metrics()
    checkpoints = CheckpointBook(tmp_path, "torch", 3, SCHEDULE.units_per_epoch, metrics)
    book = StateBook(checkpoints)
    data = _state_bytes(10)
    generation, members = 4, [7, 8, 9]  # worker 7 is rank 0
    for stale in _chunks(3, 10, "checkpoint", data):  # a zombie of generation 3 (it was rank 0 then)
        book.chunk(7, stale, generation, members)
    for chunk in _chunks(4, 10, "checkpoint", data):  # rank 1 of the current generation
        book.chunk(8, chunk, generation, members)
    chunks = _chunks(4, 10, "checkpoint", data)
    book.chunk(7, chunks[0], generation, members)
    book.chunk(9, chunks[1], generation, members)  # another worker cannot continue rank 0's upload
    checkpoints.close(10)
    assert book.held == [] and list(tmp_path.iterdir()) == [] and metrics.checkpoints == []
    assert book.refused == len(_chunks(3, 10, "checkpoint", data)) * 2 + 1

    for chunk in _chunks(4, 10, "checkpoint", data):
        book.chunk(7, chunk, generation, members)
    checkpoints.close(10)
    uploaded = wire.assemble(data)
    assert [s.unit for s in book.held] == [10] and _same_record(decode_state(book.held[0].data), uploaded)
    assert [q.name for q in tmp_path.iterdir()] == [checkpoint_name(10)]
    assert _same_record(decode_state((tmp_path / checkpoint_name(10)).read_bytes()), uploaded)
    assert metrics.checkpoints[0]["unit"] == 10 and metrics.checkpoints[0]["worker"] == 7


class _RunsCode:
    """A header value that would run code if unpickled with its names resolved."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_state_header_holds_plain_values_or_goes_as_torch_save_and_one_naming_code_is_refused(tmp_path):
    model, opt = fresh_model_and_optimizer()
    record = state_record(SCHEDULE, 10, "torch", BATCH, model.state_dict(), opt.state_dict())
    record["shapes"], record["kinds"] = torch.Size([2, 3]), {"a", "b"}
    data = wire.encode(record)
    assert data[8:9] == b"\x80"  # plain values: a pickle the driver reads without resolving code
    back = wire.assemble(data)
    assert _same_record(back, record) and type(back["shapes"]) is torch.Size and back["kinds"] == {"a", "b"}
    record["dtype"] = torch.float16  # a name besides plain values: torch.save's form, weights_only on reading
    data = wire.encode(record)
    assert data[8:10] == b"PK" and wire.assemble(data)["dtype"] is torch.float16

    # A header naming code (an injected upload; only rank 0's is heard, and only with the job's
    # secret): refused, nothing run, the last good state kept.
    marker = tmp_path / "ran"
    header = pickle.dumps({"skeleton": _RunsCode(marker), "specs": []}, protocol=pickle.HIGHEST_PROTOCOL)
    with pytest.raises(pickle.UnpicklingError, match="open is not a plain value"):
        wire.assemble(struct.pack("<Q", len(header)) + header)
    checkpoints = CheckpointBook(tmp_path / "checkpoints", "torch", 3, SCHEDULE.units_per_epoch, _Metrics())
    book = StateBook(checkpoints)
    for chunk in _chunks(0, 10, "snapshot", _state_bytes(10)):
        book.chunk(0, chunk, 0, [0])
    for chunk in _chunks(0, 12, "snapshot", struct.pack("<Q", len(header)) + header):
        book.chunk(0, chunk, 0, [0])
    checkpoints.close(10)
    assert not marker.exists() and book.refused == 1 and [s.unit for s in book.held] == [10]


def test_the_newest_state_at_or_below_the_committed_unit_is_restored(tmp_path):
    checkpoints = CheckpointBook(tmp_path, "torch", 3, SCHEDULE.units_per_epoch, _Metrics())
    book = StateBook(checkpoints)
    for unit, kind in ((10, "checkpoint"), (14, "snapshot"), (19, "snapshot")):
        for chunk in _chunks(0, unit, kind, _state_bytes(unit)):
            book.chunk(0, chunk, 0, [0, 1])
    checkpoints.close(10)
    book.committed(17)  # the snapshot of unit 19 is newer than what is committed: not a restore point yet
    assert [s.unit for s in book.held] == [14, 19]  # the newest committed one, and the newer one
    restore = book.restore_point(17)
    assert (restore.unit, restore.kind, restore.name) == (14, "snapshot", "snapshot of unit 14")
    assert decode_state(restore.data, PLAN)["unit"] == 14
    book.rolled_back(14)
    assert [s.unit for s in book.held] == [14]
    on_disk = book.restore_point(12)  # below every snapshot held: the checkpoint on disk
    assert (on_disk.unit, on_disk.kind, on_disk.name) == (10, "checkpoint", checkpoint_name(10))
    assert book.restore_point(9) is None  # nothing saved that early: the run would go back to unit 0


def test_rank_0_uploads_due_checkpoints_and_snapshots_every_n_steps():
    snapshots = SnapshotCadence(steps=4, seconds=0, share=0)
    config = types.SimpleNamespace(
        checkpoint_freq=1, checkpoint_steps=0, batch_size=BATCH, snapshots=snapshots, shard_optimizer_state=False
    )
    uploads = StateUploader(channel=None, schedule=SCHEDULE, config=config)  # type: ignore[arg-type]
    uploads.entered(p.CheckpointSettings("", "torch", written=-1), resume_unit=0)
    due = {}
    for unit in range(SCHEDULE.total_units):
        kind = uploads.kind_due(unit, rank=0)
        if kind:
            due[unit] = kind
            uploads.mark(kind, unit)  # as upload() does
        assert uploads.kind_due(unit, rank=1) is None  # only rank 0 uploads
    assert due == {
        4: "snapshot",  # after 4 steps
        8: "snapshot",
        10: "checkpoint",  # epoch 0's validation slot
        15: "snapshot",  # 4 steps after the checkpoint (unit 11 is epoch 1's step 0)
        19: "snapshot",
        21: "checkpoint",
        26: "snapshot",
        30: "snapshot",
        32: "checkpoint",
    }


@pytest.mark.parametrize(("freq", "checkpoint_steps"), [(0, 0), (1, 0), (3, 0), (0, 6), (1, 4)])
@pytest.mark.parametrize(("steps", "seconds", "share"), [(4, 0, 0), (7, 0, 0.01), (0, 0.5, 0), (3, 0.25, 0.5)])
def test_the_cheap_answer_of_kind_due_is_its_full_rule_s(monkeypatch, freq, checkpoint_steps, steps, seconds, share):
    """kind_due runs before every unit: its fast path (nothing due before the next checkpoint's
    unit and the unit the steps' rule reaches, unless by time) answers as the whole rule does."""
    clock = [100.0]
    monkeypatch.setattr("fabric_model.state.uploader.time.monotonic", lambda: clock[0])
    snapshots = SnapshotCadence(steps=steps, seconds=seconds, share=share)
    config = types.SimpleNamespace(
        checkpoint_freq=freq,
        checkpoint_steps=checkpoint_steps,
        batch_size=BATCH,
        snapshots=snapshots,
        shard_optimizer_state=False,
    )
    uploads = StateUploader(channel=None, schedule=SCHEDULE, config=config)  # type: ignore[arg-type]
    uploads.entered(p.CheckpointSettings("", "torch", written=-1), resume_unit=0)
    due, checkpoints = 0, []
    for unit in range(SCHEDULE.total_units):
        clock[0] += 0.1
        uploads.cost = 0.2 if unit % 5 else 0.0
        kind = uploads.kind_due(unit, rank=0)
        assert kind == (uploads._due(unit) if 0 < unit < SCHEDULE.total_units else None), unit
        if kind:
            due += 1
            checkpoints += [unit] if kind == "checkpoint" else []
            uploads.mark(kind, unit)
    assert due > 0
    # Every checkpoint the rule names is taken (train(checkpoint_steps=...) too), none other.
    rule = [u for u in range(SCHEDULE.total_units) if checkpoint_due(SCHEDULE, freq, u, checkpoint_steps)]
    assert checkpoints == rule


def test_snapshots_by_steps_wait_while_they_would_cost_more_than_their_share():
    snapshots = SnapshotCadence(steps=4, seconds=0, share=0.01)
    config = types.SimpleNamespace(
        checkpoint_freq=1, checkpoint_steps=0, batch_size=BATCH, snapshots=snapshots, shard_optimizer_state=False
    )
    uploads = StateUploader(channel=None, schedule=SCHEDULE, config=config)  # type: ignore[arg-type]
    uploads.entered(p.CheckpointSettings("", "torch", written=-1), resume_unit=0)
    uploads.cost = 10.0  # the last upload took 10 s: at 1%, the next waits 1000 s
    due = {}
    for unit in range(SCHEDULE.total_units):
        kind = uploads.kind_due(unit, rank=0)
        if kind:
            due[unit] = kind
            uploads.mark(kind, unit)
    assert due == {10: "checkpoint", 21: "checkpoint", 32: "checkpoint"}  # checkpoints never wait
    uploads.entered(p.CheckpointSettings("", "torch", written=32), resume_unit=SCHEDULE.unit(2, 0))
    assert uploads.kind_due(SCHEDULE.unit(2, 4), rank=0) is None  # 4 steps on, still too dear
    uploads.cost = 0.0  # a cheap state: every 4 steps again
    assert uploads.kind_due(SCHEDULE.unit(2, 4), rank=0) == "snapshot"


@pytest.mark.parametrize("slot", [False, True], ids=["steps", "a validation slot among its units"])
def test_an_uploads_cost_is_what_the_steps_beside_it_lost(monkeypatch, slot):
    """The share rule weighs what an upload cost the steps: the time its units took beyond the
    pace of the steps before it (on busy cores its own copy and send are a fraction of that).
    Where a validation slot falls among them, its own copy and send stand."""
    clock = [100.0]
    monkeypatch.setattr("fabric_model.state.uploader.time.monotonic", lambda: clock[0])
    snapshots = SnapshotCadence(steps=8 if slot else 6, seconds=0, share=0.01)
    config = types.SimpleNamespace(
        checkpoint_freq=0, checkpoint_steps=0, batch_size=BATCH, snapshots=snapshots, shard_optimizer_state=False
    )
    sent: list[p.StateChunk] = []
    uploads = StateUploader(channel=types.SimpleNamespace(send=sent.append), schedule=SCHEDULE, config=config)  # type: ignore[arg-type]
    uploads.entered(p.CheckpointSettings("", "torch", written=-1), resume_unit=0)
    due, costs = [], []
    for unit in range(SCHEDULE.total_units):
        kind = uploads.kind_due(unit, rank=0)
        costs.append(uploads.cost)
        if kind:
            due.append(unit)
            uploads.upload(kind, unit, 0, {"w": torch.ones(3)}, {"state": {}, "param_groups": []})
            uploads.flush()  # its thread sends it (no time passes on this clock)
        clock[0] += 0.1 + (0.4 if unit in due else 0.0)  # the step beside the send is 0.4 s slower
    assert sent and sent[-1].last
    if slot:  # units 8, 9, the slot, 11: its copy and send (no time on this clock) stand, until
        # the next one, at 17, is measured over steps alone
        assert costs[12] == 0.0 and due == [8, 17] and uploads.cost == pytest.approx(0.4)
    else:  # 0.4 s at 1%: the next 40 s away, past the run's end (its copy and send: every 6 steps)
        assert costs[9] == pytest.approx(0.4) and due == [6]


@pytest.mark.parametrize("raw", ["1", "-0.1", "nan", "a lot"])
def test_a_bad_snapshot_share_is_refused_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv("FABRIC_MODEL_SNAPSHOT_SHARE", raw)
    with pytest.raises(ValueError, match=r"FABRIC_MODEL_SNAPSHOT_SHARE.*fraction.*below 1.*Received"):
        SnapshotCadence.from_environment()
    monkeypatch.setenv("FABRIC_MODEL_SNAPSHOT_SHARE", "0.05")
    assert SnapshotCadence.from_environment().share == 0.05
