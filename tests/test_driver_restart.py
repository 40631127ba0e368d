"""A driver killed without notice, and the same call again (docs/elasticity.md, "A lost driver"):
its workers wait for it, holding the state (their slices of it where the optimizer state is
sharded); the restarted driver takes them back and goes on with no committed step redone, no
worker restarted, and the undisturbed run's weights, bitwise."""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Listener
from pathlib import Path

import psutil
import pytest
import torch

from fabric_model import FabricModel, worker_context
from fabric_model.run.rundir import RunDirectory

from .helpers import fresh_model_and_optimizer, make_data, records, run_script
from .load import scaled

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parents[1]
SEED, EPOCHS, BATCH, WORKERS = 5, 3, 8, 2
SAMPLES = 160  # 10 steps an epoch, 30 in all
TOTAL_STEPS = EPOCHS * SAMPLES // (BATCH * WORKERS)
#: How long the workers of a killed driver wait for it here (FABRIC_MODEL_DRIVER_WAIT).
WAIT = 120


class PacedLoss:
    """Cross-entropy that takes at least 20 ms a micro-batch (so that a killed driver's workers
    are mid-run, not done) and leaves the pid of each worker process that computes it in
    ``directory`` (not the driver's: it calls the loss once to check it, before any worker)."""

    def __init__(
        self, directory: Path, scale: float = 1.0, scale_from: int = 0, pace: float = 0.02, until_two: bool = False
    ) -> None:
        self.directory, self.pace = str(directory), pace
        self.until_two = until_two  # a lone worker waits (bounded) for a second one to be ready to join
        self.marked_by = -1
        self.scale, self.scale_from = scale, scale_from  # a changed script's loss: scaled from that step

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        context = worker_context()
        if self.marked_by != os.getpid() and context is not None:
            Path(self.directory, f"pid-{os.getpid()}").touch()
            self.marked_by = os.getpid()
        time.sleep(self.pace)
        if self.until_two and context is not None and context.world_size < 2:
            deadline = time.monotonic() + scaled(60)
            while not context.join_pending and time.monotonic() < deadline:
                time.sleep(0.05)
        loss = torch.nn.functional.cross_entropy(output, target)
        if context is None:
            return loss
        scale = self.scale if context.global_step >= self.scale_from else 1.0
        with open(Path(self.directory, f"steps-{os.getpid()}"), "a") as f:  # which code computed which step, when
            f.write(f"{time.time()} {context.global_step} {scale}\n")
        return loss * scale


def train(
    run_dir: Path,
    driver_logger=None,
    workers: int = WORKERS,
    batch: int = BATCH,
    loss_scale: float = 1.0,
    scale_from: int = 0,
    pace: float = 0.02,
    until_two: bool = False,
    **kwargs,
) -> dict[str, torch.Tensor]:
    """The paced run, deterministic, on ``workers`` in micro-batches of ``batch`` (the global batch
    is the same on any count, and so is the result); returns its final weights. ``loss_scale``:
    the loss is scaled by it from step ``scale_from`` on (a changed script)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    model, opt = fresh_model_and_optimizer()
    data = make_data(SAMPLES)
    loss = PacedLoss(run_dir, loss_scale, scale_from, pace, until_two)
    fm = FabricModel(model, lambda: (data, None), loss, opt, driver_logger_callback=driver_logger)
    fm.train(
        EPOCHS,
        batch,
        workers,
        effective_batch_size=BATCH * WORKERS,
        seed=SEED,
        run_dir=run_dir,
        deterministic=True,
        tensorboard=False,
        **kwargs,
    )
    return copy.deepcopy(model.state_dict())


KILLED = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {repo!r})
    torch.set_num_threads(1)
    from pathlib import Path
    from tests.helpers import KilledAt
    from tests.test_driver_restart import KilledWithTwo, KilledWritingCheckpoint, train

    train(Path({run_dir!r}), {logger}, resume="auto", **{kwargs!r})
""")


class KilledWritingCheckpoint:
    """A driver logger that SIGKILLs the driver as it starts writing its first checkpoint: the
    upload has arrived, and the file is never written."""

    def log_train_metrics(self, metrics, iteration, epoch, workers) -> None:
        pass

    def wrap_checkpoint_stream(self, stream, unit: int):
        os.kill(os.getpid(), signal.SIGKILL)
        return stream


class KilledWithTwo:
    """A driver logger that SIGKILLs the driver at the first step two workers committed."""

    def log_train_metrics(self, metrics, iteration, epoch, workers) -> None:
        if workers >= 2:
            os.kill(os.getpid(), signal.SIGKILL)


def run_killed(
    run_dir: Path, at: int, logger: str = "", env: dict[str, str] | None = None, **kwargs
) -> list[psutil.Process]:
    """The job in a process of its own, its driver SIGKILLed once step ``at`` is committed (or by
    ``logger``, an expression); returns the processes it started (the warm process and the
    workers, which stay)."""
    logger = logger or f"KilledAt({at})"
    script = KILLED.format(repo=str(REPO), run_dir=str(run_dir), logger=logger, kwargs=kwargs)
    env = dict(os.environ, FABRIC_MODEL_DRIVER_WAIT=str(WAIT), **(env or {}))
    code, out, started = run_script(script, scaled(120), env)
    if code != -signal.SIGKILL:
        assert_gone(started, within=10)
    assert code == -signal.SIGKILL, out[-3000:]
    return started


def assert_gone(processes: list[psutil.Process], within: float) -> None:
    _, alive = psutil.wait_procs(processes, timeout=within)
    for p in alive:
        p.kill()
    assert not alive, f"still running: {[p.pid for p in alive]}"


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> Callable[[int], dict[str, torch.Tensor]]:
    """The undisturbed run's weights for a micro-batch size (each made once, on 2 workers)."""
    runs: dict[int, dict[str, torch.Tensor]] = {}

    def of(batch: int) -> dict[str, torch.Tensor]:
        if batch not in runs:
            runs[batch] = train(tmp_path_factory.mktemp("undisturbed") / "run", batch=batch)
        return runs[batch]

    return of


def impostor(port: int, refused: threading.Event, stop: threading.Event) -> None:
    """Listens at the driver's port with a secret that is not the job's, until ``stop``."""
    with Listener(("127.0.0.1", port), family="AF_INET", authkey=b"not the job's secret") as listener:
        listener._listener._socket.settimeout(0.2)  # type: ignore[attr-defined]  # accept() wakes to see ``stop``
        while not stop.is_set():
            try:
                listener.accept().close()
            except AuthenticationError:
                refused.set()  # the worker's answer did not match: it holds another secret
            except OSError:
                pass


@pytest.mark.parametrize(("seed", "with_impostor", "sharded"), [(1, False, False), (2, True, True)])
def test_a_killed_driver_run_again_takes_its_workers_back(
    undisturbed, tmp_path, monkeypatch, seed, with_impostor, sharded
):
    """SIGKILL to the driver at a random committed step; the same call again (``resume="auto"``)
    takes back the workers that waited: every step committed exactly once in the record (none
    redone), the same worker processes trained throughout, and the weights are the
    undisturbed run's, bitwise. With an impostor at the driver's port meanwhile (a wrong
    secret), the workers refuse it and still come back to the real driver. ``sharded``: 3
    workers (in micro-batches of 4, so that each has one), each holding 2 of 3 slices of the
    optimizer state, which nobody else has while the driver is away."""
    run_dir = tmp_path / "run"
    at = random.Random(seed).randint(3, TOTAL_STEPS - 8)
    options = {"workers": 3, "batch": 4, "shard_optimizer_state": True} if sharded else {}
    workers = options.get("workers", WORKERS)
    started = run_killed(run_dir, at, **options)
    address, _ = RunDirectory(run_dir).read_join_info() or pytest.fail("the killed driver left no join.json")
    if with_impostor:
        refused, stop = threading.Event(), threading.Event()
        thread = threading.Thread(target=impostor, args=(address[1], refused, stop), daemon=True)
        thread.start()
        try:
            assert refused.wait(scaled(30)), "no worker tried the impostor"
        finally:
            stop.set()
            thread.join(timeout=10)

    monkeypatch.setenv("FABRIC_MODEL_DRIVER_WAIT", str(WAIT))
    state = train(run_dir, resume="auto", **options)  # the same call, as a requeued job makes it

    expected = undisturbed(options.get("batch", BATCH))
    differ = [k for k in expected if not torch.equal(state[k], expected[k])]
    assert not differ, f"not bitwise equal: {differ}"
    iterations = sorted(r["iteration"] for r in records(run_dir, "train"))
    assert iterations == list(range(1, TOTAL_STEPS + 1)), iterations  # each step committed once
    assert len(list(run_dir.glob("pid-*"))) == workers, list(run_dir.glob("pid-*"))  # the same ones trained
    names = sorted(p.name for p in (run_dir / "logs").glob("worker-*.log"))
    assert names == [f"worker-{w}.log" for w in range(workers)], names
    back = [g for g in records(run_dir, "generation") if g["reason"] == "the driver restarted"]
    assert len(back) == 1 and back[0]["members"] == list(range(workers)), records(run_dir, "generation")
    assert not records(run_dir, "resume")  # it went on from the workers' state, not a checkpoint
    logs = "".join((run_dir / "logs" / f"worker-{w}.log").read_text() for w in range(workers))
    assert logs.count("re-attached to the driver") == workers, logs[-3000:]
    if with_impostor:
        assert "refused a peer at" in logs, logs[-3000:]
    assert_gone(started, within=scaled(30))  # the old warm process ends once its workers did
    assert not (run_dir / "join.json").exists()


def steps_computed(run_dir: Path) -> list[tuple[float, int, float]]:
    """``(time, global step, loss scale)`` of every micro-batch loss the workers computed."""
    lines = [line.split() for f in run_dir.glob("steps-*") for line in f.read_text().splitlines()]
    return sorted((float(t), int(step), float(scale)) for t, step, scale in lines)


def test_a_changed_script_run_again_trains_the_new_code(tmp_path, monkeypatch, caplog):
    """SIGKILL to the driver; the script changed (its loss is scaled by 2) and run again with
    ``resume="auto"``: the workers that waited hand over their state and exit, so no step after
    the restart runs the old code; new workers go on from that state with no step redone, and
    the result is bitwise what the new script gives from there (the old loss before, the new
    after); the console says which parts changed and what happened."""
    run_dir = tmp_path / "run"
    started = run_killed(run_dir, at=random.Random(3).randint(3, TOTAL_STEPS - 8))
    monkeypatch.setenv("FABRIC_MODEL_DRIVER_WAIT", str(WAIT))
    with caplog.at_level("WARNING", logger="fabric_model.driver.driver"):
        state = train(run_dir, resume="auto", loss_scale=2.0)
    assert_gone(started, within=scaled(10))  # the old workers exited; their warm process with them

    said = [r for r in caplog.records if "the job changed since its driver vanished" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert "the model, loss, metrics and optimizer" in said[0].getMessage(), said[0].getMessage()
    assert "handed over" in said[0].getMessage(), said[0].getMessage()
    # The old workers' step under way when their driver died is undone; once they handed over
    # their state (before the line), every step computed ran the new code.
    after = [(step, scale) for t, step, scale in steps_computed(run_dir) if t > said[0].created]
    assert after and all(scale == 2.0 for _, scale in after), after
    lines = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    # The new workers' first generation loads the state handed over; the steps before it were recorded.
    handed = next(i for i, r in enumerate(lines) if r["type"] == "generation" and min(r["members"]) >= WORKERS)
    assert lines[handed].get("restored") == "snapshot", lines[handed]
    done = max(r["iteration"] for r in lines[:handed] if r["type"] == "train")
    assert min(step for step, _ in after) == done  # from the step after the state handed over: none redone
    iterations = sorted(r["iteration"] for r in records(run_dir, "train"))
    assert iterations == list(range(1, TOTAL_STEPS + 1)), iterations  # each step committed once

    expected = train(tmp_path / "reference", loss_scale=2.0, scale_from=done)
    differ = [k for k in expected if not torch.equal(state[k], expected[k])]
    assert not differ, f"not bitwise what the new script gives from step {done}: {differ}"


def test_a_fresh_run_ends_the_workers_that_wait(tmp_path, monkeypatch):
    """SIGKILL to the driver, then a new train() in the same folder without resume: the old
    workers, which would wait 120 s holding the state, are ended as it starts."""
    run_dir = tmp_path / "run"
    started = run_killed(run_dir, at=5)
    assert any(p.is_running() for p in started), "the workers did not wait"
    monkeypatch.setenv("FABRIC_MODEL_DRIVER_WAIT", "0")
    began = time.monotonic()
    train(tmp_path / "another")  # a run beside the killed one: the same runs root
    assert_gone(started, within=scaled(10))
    assert time.monotonic() - began < WAIT / 2
    assert not (run_dir / "join.json").exists()  # its secret does not outlive its workers


@pytest.mark.parametrize("changed", [False, True])
def test_a_checkpoint_lost_with_the_driver_is_written_after_the_restart(undisturbed, tmp_path, monkeypatch, changed):
    """SIGKILL to the driver as it starts writing the first epoch's checkpoint (its upload had
    arrived): after the restart, that checkpoint is on disk, sent again by the rank that kept
    it, whether the workers are taken back (the weights are then the undisturbed run's) or, the
    script having changed, hand over their state and exit."""
    run_dir = tmp_path / "run"
    started = run_killed(run_dir, at=-1, logger="KilledWritingCheckpoint()")
    assert not list((run_dir / "checkpoints").glob("ckpt-*.pt"))
    monkeypatch.setenv("FABRIC_MODEL_DRIVER_WAIT", str(WAIT))
    state = train(run_dir, resume="auto", keep_checkpoints=EPOCHS, loss_scale=2.0 if changed else 1.0)
    assert_gone(started, within=scaled(30))
    written = sorted(r["epoch"] for r in records(run_dir, "checkpoint") if r.get("path"))
    assert written == list(range(EPOCHS)), records(run_dir, "checkpoint")
    assert len(list((run_dir / "checkpoints").glob("ckpt-*.pt"))) == EPOCHS
    if not changed:
        expected = undisturbed(BATCH)
        assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_a_worker_started_by_hand_starts_again_for_a_changed_job(tmp_path, monkeypatch):
    """One local worker and one started by hand (``fabric-model worker --join``); SIGKILL to the
    driver, then a changed script with ``resume="auto"``: the local worker hands over its state
    and exits; the one started by hand runs its command line anew and joins the new job, so both
    hosts train again, every step committed once."""
    run_dir = tmp_path / "run"
    env = {"FABRIC_MODEL_CPU_WORKERS": "1"}  # one local slot: engines_number=2 leaves one to a hand
    log = open(tmp_path / "hand.log", "wb")  # noqa: SIM115  (the hand-started worker's, as its user's console)
    hand: list[subprocess.Popen] = []

    def start_by_hand() -> None:
        deadline = time.monotonic() + scaled(60)
        while not (run_dir / "join.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        command = [sys.executable, "-m", "fabric_model", "worker", "--join", str(run_dir / "join.json")]
        worker_env = dict(os.environ, FABRIC_MODEL_DRIVER_WAIT=str(WAIT), PYTHONPATH=str(REPO))
        hand.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=worker_env))

    thread = threading.Thread(target=start_by_hand)
    thread.start()
    try:
        started = run_killed(run_dir, at=-1, logger="KilledWithTwo()", env=env, pace=0.3)
        thread.join(timeout=scaled(60))
        assert hand and hand[0].poll() is None, "the worker started by hand did not wait"
        monkeypatch.setenv("FABRIC_MODEL_DRIVER_WAIT", str(WAIT))
        monkeypatch.setenv("FABRIC_MODEL_CPU_WORKERS", "1")
        train(run_dir, resume="auto", loss_scale=2.0, until_two=True)  # waits for the one started again
        assert_gone(started, within=scaled(10))
        assert hand[0].wait(timeout=scaled(30)) == 0  # it ended with the job (its Stop)
    finally:
        thread.join(timeout=scaled(60))
        for process in hand:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        log.close()
    said = (tmp_path / "hand.log").read_text()
    assert "starting again as a new worker of the restarted driver" in said, said[-3000:]
    generations = records(run_dir, "generation")
    assert generations[-1]["workers"] == 2, generations  # both hosts train again
    iterations = sorted(r["iteration"] for r in records(run_dir, "train"))
    assert iterations == list(range(1, TOTAL_STEPS + 1)), iterations  # each step committed once
