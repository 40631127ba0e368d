"""A driver killed without notice, and the same call again (docs/elasticity.md, "A lost driver"):
its workers wait for it, holding the state (their slices of it where the optimizer state is
sharded); the restarted driver takes them back and goes on with no committed step redone, no
worker restarted, and the undisturbed run's weights, bitwise."""

from __future__ import annotations

import copy
import os
import random
import signal
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

    def __init__(self, directory: Path) -> None:
        self.directory = str(directory)
        self.marked_by = -1

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.marked_by != os.getpid() and worker_context() is not None:
            Path(self.directory, f"pid-{os.getpid()}").touch()
            self.marked_by = os.getpid()
        time.sleep(0.02)
        return torch.nn.functional.cross_entropy(output, target)


def train(
    run_dir: Path, driver_logger=None, workers: int = WORKERS, batch: int = BATCH, **kwargs
) -> dict[str, torch.Tensor]:
    """The paced run, deterministic, on ``workers`` in micro-batches of ``batch`` (the global batch
    is the same on any count, and so is the result); returns its final weights."""
    run_dir.mkdir(parents=True, exist_ok=True)
    model, opt = fresh_model_and_optimizer()
    data = make_data(SAMPLES)
    fm = FabricModel(model, lambda: (data, None), PacedLoss(run_dir), opt, driver_logger_callback=driver_logger)
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
    from tests.test_driver_restart import train

    train(Path({run_dir!r}), KilledAt({at}), resume="auto", **{kwargs!r})
""")


def run_killed(run_dir: Path, at: int, **kwargs) -> list[psutil.Process]:
    """The job in a process of its own, its driver SIGKILLed once step ``at`` is committed;
    returns the processes it started (the warm process and the workers, which stay)."""
    script = KILLED.format(repo=str(REPO), run_dir=str(run_dir), at=at, kwargs=kwargs)
    code, out, started = run_script(script, scaled(120), dict(os.environ, FABRIC_MODEL_DRIVER_WAIT=str(WAIT)))
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
