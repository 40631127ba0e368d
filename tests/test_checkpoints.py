"""Checkpoints and resume (docs/architecture.md, "Run directory"): atomic writes, keep-last-K, the newest complete one,
whole-job kills, interrupted writes, and resuming on another number of workers."""

from __future__ import annotations

import copy
import json
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F

from fabric_model import BestCheckpoints, FabricModel
from fabric_model.state.checkpoint import (
    FORMAT,
    checkpoint_due,
    checkpoint_name,
    encode_state,
    list_checkpoints,
    load_checkpoint,
    newest_checkpoint,
    next_checkpoint_unit,
    prune,
    read_info,
    state_record,
    step_checkpoint_unit,
    write_checkpoint,
)
from fabric_model.state.writer import CheckpointBook
from fabric_model.step.plan import Plan, Schedule
from fabric_model.testing import CheckpointFault, FaultInjector, Kill
from fabric_model.transport import control
from fabric_model.transport import protocol as p

from .helpers import (
    fresh_model_and_optimizer,
    make_data,
    max_rel_diff,
    records,
    reference_train,
    run_script_and_its_tree,
)

SEED, EPOCHS, BATCH, GLOBAL = 7, 3, 8, 24
DATA = make_data(240)  # 10 steps an epoch
TEST = DATA[:40]
PLAN = Plan(len(DATA), BATCH, GLOBAL // BATCH, SEED)
SCHEDULE = Schedule(PLAN, EPOCHS, 1, True)
UNITS = SCHEDULE.units_per_epoch  # 10 steps and the validation slot
REPO = Path(__file__).resolve().parents[1]


def ckpt_unit(epoch: int) -> int:
    """The unit a checkpoint taken after ``epoch`` resumes at: that epoch's validation slot."""
    return (epoch + 1) * UNITS - 1


@pytest.fixture(scope="module")
def reference():
    model, opt = fresh_model_and_optimizer()
    reference_train(model, opt, DATA, seed=SEED, epochs=EPOCHS, batch_size=BATCH, micro_batches=GLOBAL // BATCH)
    return copy.deepcopy(model.state_dict())


def train(run_dir, workers, worker_logger=None, driver_logger=None, **kwargs):
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(
        model,
        lambda: (DATA, TEST),
        F.cross_entropy,
        opt,
        worker_logger_callback=worker_logger,
        driver_logger_callback=driver_logger,
    )
    result = fm.train(EPOCHS, BATCH, workers, effective_batch_size=GLOBAL, run_dir=run_dir, **kwargs)
    return model, result


def units_in(directory: Path) -> list[int]:
    return [u for u, _ in list_checkpoints(directory)]


# -- checkpoint.py on its own ----------------------------------------------------------------
def _state():
    model, opt = fresh_model_and_optimizer()
    F.cross_entropy(model(DATA[0][0][None]), torch.tensor([DATA[0][1]])).backward()
    opt.step()  # momentum buffers: the optimizer state is not empty
    return model.state_dict(), opt.state_dict()


def _write(directory: Path, unit: int, wrap_stream=None) -> Path:
    """What the driver does with the bytes rank 0 uploads (driver/checkpoints.py)."""
    data = encode_state(state_record(SCHEDULE, unit, "torch", BATCH, *_state()))
    return write_checkpoint(directory, unit, data, wrap_stream)


def test_checkpoint_due_after_every_freq_th_epoch():
    assert [u for u in range(SCHEDULE.total_units) if checkpoint_due(SCHEDULE, 1, u)] == [10, 21, 32]
    assert [u for u in range(SCHEDULE.total_units) if checkpoint_due(SCHEDULE, 2, u)] == [21]
    assert not any(checkpoint_due(SCHEDULE, 0, u) for u in range(SCHEDULE.total_units))


def test_checkpoint_due_by_epochs_by_steps_and_both():
    """``checkpoint_steps=k``: before the unit after every k-th global step (over epochs); where
    that step ends an epoch, the validation slot, one checkpoint with the epoch's own."""

    def due(freq: int, steps: int) -> list[int]:
        return [u for u in range(SCHEDULE.total_units) if checkpoint_due(SCHEDULE, freq, u, steps)]

    assert due(1, 0) == [10, 21, 32]  # epochs only (10 steps an epoch, then the validation slot)
    # Steps only: after steps 4, 8 (units 4, 8), 12 (epoch 1, step 1: unit 13), 16, 20 (epoch 1's
    # last: its validation slot), 24, 28; never before the first step of an epoch.
    assert due(0, 4) == [4, 8, 13, 17, 21, 26, 30]
    assert [step_checkpoint_unit(SCHEDULE, n) for n in (4, 8, 12, 16, 20, 24, 28)] == due(0, 4)
    assert due(1, 4) == [4, 8, 10, 13, 17, 21, 26, 30, 32]  # both; at step 20 they coincide: unit 21 once
    assert due(2, 10) == due(0, 10) == due(1, 0)  # every epoch's last step: the epoch ends' units
    assert due(0, 1) == [u for u in range(1, SCHEDULE.total_units) if u % UNITS != 0]  # after every step
    assert due(3, 7) == [7, 15, 23, 30, 32]  # steps 7, 14, 21, 28; epoch 2's end (freq 3)
    assert due(0, 0) == [] and due(0, 31) == []  # none; the run has 30 steps
    for freq, steps in [(1, 0), (0, 4), (1, 4), (2, 10), (0, 1), (3, 7), (0, 0)]:
        for after in range(-1, SCHEDULE.total_units):  # the uploader's threshold: the next due unit
            expected = min((u for u in due(freq, steps) if u > after), default=SCHEDULE.total_units)
            assert next_checkpoint_unit(SCHEDULE, freq, steps, after) == expected, (freq, steps, after)


def test_best_checkpoints_score_only_those_at_an_epoch_end(tmp_path):
    """A checkpoint inside an epoch (checkpoint_steps) holds other weights than the epoch's
    metrics measured: BestCheckpoints never scores it nor waits for its score; it is kept as one
    of the newest keep_checkpoints only."""
    for unit in [4, 8, 10, 13, 17, 21, 26, 30]:  # checkpoint_steps=4, up to step 28
        _write(tmp_path, unit)
    logs = {0: {"val_loss": 0.5}, 1: {"val_loss": 0.9}, 2: {"val_loss": 0.1}}  # epoch 2's end: no checkpoint yet
    best = BestCheckpoints("val_loss", keep=1)
    book = CheckpointBook(tmp_path, "torch", 2, UNITS, None, best=best, epoch_logs=lambda e: logs.get(e, {}))
    book.by_unit = dict(list_checkpoints(tmp_path))
    book._prune()
    assert units_in(tmp_path) == [10, 26, 30]  # epoch 0's end scored best; the newest two
    assert [b["unit"] for b in json.loads((tmp_path / "best.json").read_text())["best"]] == [10]

    # No checkpoint at an epoch's end (checkpoint_freq=0): none waits for a score that never comes.
    for path in tmp_path.iterdir():
        path.unlink()
    for unit in [4, 8, 13, 17]:
        _write(tmp_path, unit)
    book.by_unit = dict(list_checkpoints(tmp_path))
    book._prune()
    assert units_in(tmp_path) == [13, 17]


def test_checkpoint_is_written_atomically_and_reads_back(tmp_path):
    assert _write(tmp_path, 21) == tmp_path / checkpoint_name(21)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-unit-00000021.pt"]  # no temporary file left
    model_state, optimizer_state = _state()
    state = load_checkpoint(tmp_path / checkpoint_name(21), PLAN)
    assert max_rel_diff(state["model"], model_state) == 0
    assert state["optimizer"]["state"][0]["momentum_buffer"].equal(optimizer_state["state"][0]["momentum_buffer"])
    info = read_info(tmp_path / checkpoint_name(21))
    assert (info.unit, info.epoch, info.steps_done, info.framework, info.plan) == (21, 1, 20, "torch", PLAN)
    with pytest.raises(ValueError, match="another plan"):
        load_checkpoint(tmp_path / checkpoint_name(21), Plan(200, BATCH, 3, SEED))


class Payload:
    """Not a tensor, nor a plain value: a weights_only load must refuse it."""


def test_loading_never_unpickles_arbitrary_objects(tmp_path):
    path = tmp_path / checkpoint_name(10)
    torch.save({"format": FORMAT, "unit": 10, "model": {"w": Payload()}}, path)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_checkpoint(path)
    assert newest_checkpoint(tmp_path) is None


@pytest.mark.processes
def test_prune_keeps_the_newest_k_and_removes_dead_writers_leftovers(tmp_path):
    for unit in (10, 21, 32, 43):
        _write(tmp_path, unit)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    (tmp_path / f".ckpt-unit-00000054.pt.{dead.pid}.tmp").write_bytes(b"partial")
    live = tmp_path / f".ckpt-unit-00000054.pt.{os.getpid()}.tmp"  # a writer still writing
    live.write_bytes(b"partial")
    removed = prune(tmp_path, 2)
    assert [p.name for p in removed] == [checkpoint_name(10), checkpoint_name(21)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, checkpoint_name(32), checkpoint_name(43)]


def test_newest_complete_checkpoint_skips_temporary_and_corrupt_files(tmp_path, caplog):
    _write(tmp_path, 10)
    _write(tmp_path, 21)
    whole = (tmp_path / checkpoint_name(21)).read_bytes()
    (tmp_path / checkpoint_name(32)).write_bytes(whole[: len(whole) // 2])  # truncated
    (tmp_path / checkpoint_name(43)).write_bytes(b"not a checkpoint")
    (tmp_path / f".{checkpoint_name(54)}.1.tmp").write_bytes(whole)  # complete bytes, but never renamed
    with caplog.at_level(logging.WARNING, logger="fabric_model.state.checkpoint"):
        info = newest_checkpoint(tmp_path)
    assert info is not None and info.unit == 21
    assert "skipping checkpoint" in caplog.text and checkpoint_name(32) in caplog.text


def test_full_disk_mid_write_keeps_the_previous_checkpoint(tmp_path):
    _write(tmp_path, 10)
    full_disk = FaultInjector([CheckpointFault("enospc", 21)], tmp_path / "markers").wrap_checkpoint_stream
    with pytest.raises(OSError, match="No space left on device"):
        _write(tmp_path, 21, full_disk)
    assert [p.name for p in tmp_path.iterdir()] == [checkpoint_name(10)]  # temp removed, previous intact
    load_checkpoint(tmp_path / checkpoint_name(10), PLAN)


@pytest.mark.processes
def test_resume_refuses_what_it_cannot_continue(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    _write(run_dir / "checkpoints", 21)  # epoch 1 done
    model, opt = fresh_model_and_optimizer()

    def attempt(epochs=EPOCHS, batch=BATCH, workers=2, data=DATA, **kw):
        fm = FabricModel(model, lambda: (data, None), F.cross_entropy, opt)
        kw.setdefault("effective_batch_size", GLOBAL)
        kw.setdefault("run_dir", run_dir)
        return fm.train(epochs, batch, workers, resume=True, **kw)

    cases = [
        ({"batch": 4}, r"Expected `batch_size` to be 8.*Received: batch_size=4"),
        ({"data": DATA[:200]}, r"training dataset .* 240 items.*Received: 200"),
        ({"effective_batch_size": None}, r"global batch to be 24 .*Received: 16 .*effective_batch_size=24"),
        ({"seed": 1}, r"Expected `seed` to be None or 7.*Received: seed=1"),
        ({"epochs": 1}, r"`epoch_number` to be at least 2.*Received: epoch_number=1"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            attempt(**kwargs)
    monkeypatch.delenv("RESULT_DIR", raising=False)
    with pytest.raises(ValueError, match=r"Expected `run_dir` .* Received: run_dir=None"):
        attempt(run_dir=None)
    with pytest.raises(TypeError, match="resume"):
        FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt).train(1, BATCH, resume="yes")


# -- whole jobs ------------------------------------------------------------------------------
SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {repo!r})
    import torch.nn.functional as F
    from tests.helpers import fresh_model_and_optimizer, make_data
    from fabric_model import FabricModel
    from fabric_model.testing import CheckpointFault, FaultInjector

    disk_faults = FaultInjector({driver_faults}, {markers!r})  # the driver writes the checkpoints

    class Progress:
        def log_train_metrics(self, metrics, iteration, epoch, workers):
            with open({progress!r}, "w") as f:
                f.write(str(iteration))

        def wrap_checkpoint_stream(self, stream, unit):
            return disk_faults.wrap_checkpoint_stream(stream, unit)

    data = make_data(240)
    model, opt = fresh_model_and_optimizer()
    pace = FaultInjector([], {markers!r}, step_delay={delay})
    fm = FabricModel(model, lambda: (data, data[:40]), F.cross_entropy, opt, worker_logger_callback=pace,
                     driver_logger_callback=Progress())
    result = fm.train({epochs}, {batch}, {workers}, effective_batch_size={global_batch}, seed={seed},
                      run_dir={run_dir!r}, resume={resume})
    print(json.dumps({{"history": len(result.history), "tests": len(result.test_history), "seed": result.seed}}))
""")


def start_script(
    tmp_path: Path, run_dir: Path, name: str, *, workers: int, resume: bool, delay: float = 0.0, driver_faults="[]"
):
    progress = tmp_path / f"{name}.progress"
    script = SCRIPT.format(
        driver_faults=driver_faults,
        repo=str(REPO),
        progress=str(progress),
        markers=str(tmp_path),
        delay=delay,
        epochs=EPOCHS,
        batch=BATCH,
        workers=workers,
        global_batch=GLOBAL,
        seed=SEED,
        run_dir=str(run_dir),
        resume=resume,
    )
    path = tmp_path / f"{name}.py"
    path.write_text(script)
    out = open(tmp_path / f"{name}.out", "wb")
    # Its own session: the test can kill the whole job without touching pytest.
    proc = subprocess.Popen([sys.executable, str(path)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    out.close()
    return proc, progress


def output(tmp_path: Path, name: str) -> str:
    return (tmp_path / f"{name}.out").read_text(errors="replace")


def wait_until(condition, timeout: float, proc: subprocess.Popen, what: str, tmp_path: Path, name: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the job ended before {what}:\n{output(tmp_path, name)}"
        assert time.monotonic() < deadline, f"not {what} within {timeout} s:\n{output(tmp_path, name)}"
        time.sleep(0.05)


def kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def steps_after_last_resume(run_dir: Path) -> list[tuple[int, int]]:
    lines = [json.loads(x) for x in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    last = max(i for i, r in enumerate(lines) if r["type"] == "resume")
    return sorted((r["epoch"], r["step"]) for r in lines[last:] if r["type"] == "train")


@pytest.mark.processes
def test_whole_job_killed_mid_epoch_resumes_to_the_undisturbed_weights(tmp_path, reference):
    run_dir = tmp_path / "run"
    ckpt_dir = run_dir / "checkpoints"
    proc, progress = start_script(tmp_path, run_dir, "first", workers=2, resume=False, delay=0.15)
    done = 0  # steps committed, as the driver's logger last wrote
    try:

        def past_a_checkpoint() -> bool:
            nonlocal done
            done = max(done, int(progress.read_text() or 0) if progress.exists() else 0)
            return bool(units_in(ckpt_dir)) and done >= 13  # epoch 1, step 2 committed

        wait_until(past_a_checkpoint, 120, proc, "3 steps past the first checkpoint", tmp_path, "first")
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert len(workers) == 3  # the warm process and the 2 workers it forked
        proc.kill()  # the driver; the warm process and its workers die with it (PR_SET_PDEATHSIG)
        proc.wait(timeout=10)
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"workers outlived the driver: {[p.pid for p in alive]}"
    finally:
        kill_session(proc)
    info = newest_checkpoint(ckpt_dir)
    assert info is not None and info.steps_done < done, "no work lost past the checkpoint"
    copy_dir = tmp_path / "copy"
    shutil.copytree(run_dir, copy_dir)

    proc, _ = start_script(tmp_path, run_dir, "resumed", workers=2, resume=True)
    try:
        proc.wait(timeout=150)
    finally:
        kill_session(proc)
    assert proc.returncode == 0, output(tmp_path, "resumed")
    summary = json.loads(output(tmp_path, "resumed").strip().splitlines()[-1])
    assert summary == {"history": EPOCHS, "tests": EPOCHS, "seed": SEED}
    final = torch.load(run_dir / "model" / "model.pt", weights_only=True)
    assert max_rel_diff(final, reference) < 1e-5
    resumed = records(run_dir, "resume")[-1]
    assert resumed["resume_unit"] == info.unit
    steps = [(e, s) for e in range(info.epoch + 1, EPOCHS) for s in range(PLAN.steps_per_epoch)]
    assert steps_after_last_resume(run_dir) == steps  # each step after the checkpoint once, in the same log

    # The same checkpoint, resumed on one worker accumulating the 3 micro-batches of a step.
    model, result = train(copy_dir, 1, resume=True)
    assert result.seed == SEED
    assert max_rel_diff(model.state_dict(), reference) < 1e-5


@pytest.mark.processes
def test_writer_killed_mid_write_leaves_the_previous_checkpoint(run_dir, tmp_path, reference):
    # The driver writes the checkpoints that rank 0 uploads: it dies writing epoch 1's.
    fault = f'[CheckpointFault("kill", {ckpt_unit(1)})]'
    proc, _ = start_script(tmp_path, run_dir, "killed", workers=1, resume=False, driver_faults=fault)
    try:
        proc.wait(timeout=120)
    finally:
        kill_session(proc)
    assert proc.returncode == -signal.SIGKILL, output(tmp_path, "killed")
    ckpt_dir = run_dir / "checkpoints"
    assert units_in(ckpt_dir) == [ckpt_unit(0)]
    partial = [p for p in ckpt_dir.iterdir() if p.name.startswith(f".{checkpoint_name(ckpt_unit(1))}.")]
    assert len(partial) == 1 and 0 < partial[0].stat().st_size < (ckpt_dir / checkpoint_name(10)).stat().st_size
    assert newest_checkpoint(ckpt_dir).unit == ckpt_unit(0)

    model, result = train(run_dir, 2, resume=True)
    assert max_rel_diff(model.state_dict(), reference) < 1e-5
    assert [h["epoch"] for h in result.history] == list(range(EPOCHS))
    assert not partial[0].exists()
    assert units_in(ckpt_dir) == [ckpt_unit(e) for e in range(EPOCHS)]


@pytest.mark.processes
def test_resume_with_nothing_to_resume_from_says_so_on_screen_as_the_display_does(tmp_path):
    """A script run as is (no handler of its own on the root logger): the warning is the
    display's line, not a bare one on stderr before the run's log is open."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        import torch.nn.functional as F
        from fabric_model import FabricModel
        from tests.helpers import fresh_model_and_optimizer, make_data
        model, opt = fresh_model_and_optimizer()
        data = make_data(48)
        FabricModel(model, lambda: (data, None), F.cross_entropy, opt).train(
            1, 16, 1, run_dir={str(tmp_path / "run")!r}, resume=True)
    """)
    code, out = run_script_and_its_tree(script, 120)
    assert code == 0, out[-3000:]
    lines = out.splitlines()
    assert any(line.startswith("[fabric-model] warning: resume=True: ") for line in lines), out[-3000:]
    assert not any(line.startswith("resume=True") for line in lines), out[-3000:]


@pytest.mark.processes
def test_full_disk_keeps_training_and_resume_uses_the_last_good_checkpoint(run_dir, tmp_path, caplog, reference):
    full_disk = FaultInjector([CheckpointFault("enospc", 21)], tmp_path)  # every checkpoint from epoch 1's on fails
    with caplog.at_level(logging.WARNING, logger="fabric_model"):
        # The driver writes the files: its disk is the one that is full.
        model, _ = train(run_dir, 2, driver_logger=full_disk, resume=True, seed=SEED)  # nothing to resume: afresh
    assert "holds no complete checkpoint" in caplog.text
    assert max_rel_diff(model.state_dict(), reference) < 1e-5
    ckpt_dir = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [checkpoint_name(ckpt_unit(0))]
    failed = [r for r in records(run_dir, "checkpoint") if "error" in r]
    assert [r["unit"] for r in failed] == [ckpt_unit(1), ckpt_unit(2)]
    assert all("No space left" in r["error"] for r in failed)

    model, result = train(run_dir, 1, resume=True, keep_checkpoints=2)
    assert max_rel_diff(model.state_dict(), reference) < 1e-5
    assert records(run_dir, "resume")[-1]["resume_unit"] == ckpt_unit(0)
    assert units_in(ckpt_dir) == [ckpt_unit(1), ckpt_unit(2)]  # keep_checkpoints=2
    assert len(result.history) == EPOCHS and len(result.test_history) == EPOCHS


@pytest.mark.processes
def test_losing_every_worker_right_after_a_checkpoint_goes_on_from_it(run_dir, tmp_path, reference, monkeypatch):
    """The only worker dies a few steps after epoch 0's checkpoint (its upload, from a thread,
    is sent by then); its replacement loads that checkpoint. The driver reads step reports
    slowly here, as a driver starved of CPU does: the worker's last reports and the
    checkpoint are still unread when its exit is seen, and still count (CI once rolled back
    to unit 0 when the exit was acted on first)."""
    recv = control.Channel.recv

    def slow_recv(self, timeout=None):
        message = recv(self, timeout)
        if isinstance(message, (p.StepDone, p.Batch)):
            time.sleep(0.1)  # in the driver's reader thread only: workers never receive these
        return message

    monkeypatch.setattr(control.Channel, "recv", slow_recv)
    model, opt = fresh_model_and_optimizer()
    killed_at = PLAN.steps_per_epoch + 4
    faults = FaultInjector([Kill(0, killed_at)], tmp_path)
    fm = FabricModel(model, lambda: (DATA, TEST), F.cross_entropy, opt, worker_logger_callback=faults)
    result = fm.train(EPOCHS, BATCH, 1, effective_batch_size=GLOBAL, seed=SEED, run_dir=run_dir)
    last = records(run_dir, "generation")[-1]
    assert (last["checkpoint"], last["resume_unit"]) == (checkpoint_name(ckpt_unit(0)), ckpt_unit(0))
    # Rolled back from no further than the kill: the reports a lone worker holds back for a few
    # ms (docs/architecture.md, "What a step costs beyond the math") die with it.
    assert ckpt_unit(0) <= last.get("rolled_back_from", ckpt_unit(0)) <= SCHEDULE.unit(1, 4)
    assert max_rel_diff(model.state_dict(), reference) < 1e-5
    assert len(result.history) == EPOCHS


@pytest.mark.processes
def test_result_dir_holds_the_run_and_the_newest_three_checkpoints_by_default(tmp_path, monkeypatch):
    """Without run_dir, RESULT_DIR is the run directory (docs/architecture.md, "Run directory");
    keep_checkpoints defaults to 3."""
    result_dir = tmp_path / "results"
    monkeypatch.setenv("RESULT_DIR", str(result_dir))
    data, epochs = make_data(48), 5  # 2 steps an epoch
    model, opt = fresh_model_and_optimizer()
    result = FabricModel(model, lambda: (data, data[:8]), F.cross_entropy, opt).train(
        epochs, BATCH, 1, effective_batch_size=GLOBAL, seed=SEED
    )
    assert result.run_dir == result_dir.resolve()
    assert {p.name for p in result_dir.iterdir()} >= {"run.json", "logs", "checkpoints", "model"}
    assert (result_dir / "model" / "model.pt").is_file() and (result_dir / "logs" / "metrics.jsonl").is_file()
    units_per_epoch = Schedule(Plan(len(data), BATCH, GLOBAL // BATCH, SEED), epochs, 1, True).units_per_epoch
    assert units_in(result_dir / "checkpoints") == [(e + 1) * units_per_epoch - 1 for e in (2, 3, 4)]

    # resume=True finds the run through RESULT_DIR too; a finished run has nothing left to do.
    trained = copy.deepcopy(model.state_dict())
    again, opt = fresh_model_and_optimizer()
    FabricModel(again, lambda: (data, data[:8]), F.cross_entropy, opt).train(
        epochs, BATCH, 1, effective_batch_size=GLOBAL, resume=True
    )
    assert max_rel_diff(again.state_dict(), trained) == 0


class CheckpointLog:
    """A driver logger: what ``on_checkpoint`` and ``on_step_checkpoint`` were told."""

    def __init__(self) -> None:
        self.epochs: list[tuple[int, str]] = []
        self.steps: list[tuple[int, str]] = []

    def on_checkpoint(self, epoch, name):
        self.epochs.append((epoch, name))

    def on_step_checkpoint(self, iteration, name):
        self.steps.append((iteration, name))


@pytest.mark.processes
def test_checkpoint_steps_writes_mid_epoch_checkpoints_and_a_resume_from_one_is_bitwise(tmp_path):
    """``checkpoint_steps=4`` over 3 epochs of 10 steps: a checkpoint after global steps 4, 8, 12,
    ..., 28 and at every epoch's end (step 20 ends epoch 1: one file); the driver logger hears of
    each; a resume from the one inside epoch 1 ends with the uninterrupted run's bits."""
    run_dir, copy_dir = tmp_path / "run", tmp_path / "copy"
    told = CheckpointLog()
    options = dict(seed=SEED, deterministic=True, checkpoint_steps=4)
    model, result = train(run_dir, 1, driver_logger=told, keep_checkpoints=20, **options)
    assert len(result.history) == EPOCHS
    iterations = [4, 8, 10, 12, 16, 20, 24, 28, 30]
    units = [4, 8, 10, 13, 17, 21, 26, 30, 32]
    assert units_in(run_dir / "checkpoints") == units
    assert [r["unit"] for r in records(run_dir, "checkpoint")] == units
    assert [read_info(run_dir / "checkpoints" / checkpoint_name(u)).steps_done for u in units] == iterations
    assert told.steps == [(n, checkpoint_name(u)) for n, u in zip(iterations, units)]
    assert told.epochs == [(e, checkpoint_name(ckpt_unit(e))) for e in range(EPOCHS)]  # epoch ends only
    uninterrupted = copy.deepcopy(model.state_dict())

    # Resume from the checkpoint after step 16 (epoch 1, step 6 next): the later ones gone.
    shutil.copytree(run_dir, copy_dir)
    for unit, path in list_checkpoints(copy_dir / "checkpoints"):
        if unit > 17:
            path.unlink()
    (copy_dir / "checkpoints" / "snapshot.pt").unlink(missing_ok=True)
    told = CheckpointLog()
    model, result = train(copy_dir, 1, driver_logger=told, resume=True, keep_checkpoints=3, **options)
    assert records(copy_dir, "resume")[-1]["resume_unit"] == 17
    assert steps_after_last_resume(copy_dir) == [(1, s) for s in range(6, 10)] + [(2, s) for s in range(10)]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in uninterrupted.items())
    assert len(result.history) == EPOCHS
    assert told.steps == [(n, checkpoint_name(u)) for n, u in zip(iterations[5:], units[5:])]
    assert told.epochs == [(1, checkpoint_name(21)), (2, checkpoint_name(32))]
    assert units_in(copy_dir / "checkpoints") == [26, 30, 32]  # step checkpoints count in keep_checkpoints
