"""A Keras caller's next train() starts its workers from *spares*: children of the kept warm
process that imported TensorFlow before the job came (launchers/warm.py), trained with the same
bits as fresh forks, replaced when one dies unused, and ended with the warm process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
import pytest  # noqa: E402

from fabric_model import FabricModel  # noqa: E402
from fabric_model.launchers import warm_spare  # noqa: E402

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]
WORKERS = 2


def samples(n: int = 96) -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 12)).astype(np.float32)
    y = (x @ rng.normal(size=(12, 3))).argmax(1)
    return [(x[i], int(y[i])) for i in range(n)]


DATA = samples()


class WorkerPids:
    """A worker logger: each worker writes its pid and its parent's to ``out`` once."""

    def __init__(self, out: Path) -> None:
        self.out = str(out)

    def log_train_metrics(self, metrics, iteration, epoch, workers):
        path = Path(self.out) / f"{os.getpid()}.json"
        if not path.exists():
            path.write_text(json.dumps({"pid": os.getpid(), "parent": os.getppid()}))


def train(run_dir: Path, pids: Path | None = None) -> list[np.ndarray]:
    """A deterministic 2-engine Keras job; the model's and the optimizer's variables after it."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((12,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dropout(0.2)]
        + [keras.layers.Dense(3)]
    )
    optimizer = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if pids is not None:
        pids.mkdir()
    logger = WorkerPids(pids) if pids is not None else None
    fm = FabricModel(model, lambda: (DATA, None), loss, optimizer, worker_logger_callback=logger)
    fm.train(1, 16, WORKERS, seed=3, run_dir=run_dir, deterministic=True)
    return [v.numpy() for v in model.variables] + [v.numpy() for v in optimizer.variables]


def notes(run_dir: Path) -> dict[str, str]:
    return json.loads((run_dir / "run.json").read_text())["startup"]["notes"]


def from_spares(run_dir: Path) -> int:
    """How many of the run's workers run.json says started from a spare (done importing or not)."""
    text = notes(run_dir)["spares"]
    ready, importing = int(text.split()[0]), int(text.split(", ")[1].split()[0])
    return ready + importing


def kept_spares() -> set[int]:
    pid = warm_spare.kept_pid()
    return warm_spare.kept_pids() - {pid}


def _gone(pids: set[int], timeout: float) -> set[int]:
    """Those of ``pids`` still there (not reaped) after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (left := {p for p in pids if psutil.pid_exists(p)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture
def kept_keras(monkeypatch):
    """A caller (this test process, with TensorFlow loaded: unfit to fork) whose warm process is
    kept between jobs; nothing kept before or after."""
    warm_spare.end()
    monkeypatch.setenv("FABRIC_MODEL_WARM_KEEP", "300")
    yield
    warm_spare.end()


def test_a_second_keras_train_starts_from_spares_and_trains_the_same_bits(kept_keras, tmp_path, monkeypatch):
    """The first job leaves its warm process kept with one spare per local worker; the second
    job's workers are those spares (children of the same warm process, pids the spares had), and
    its weights are bitwise those of a job whose workers were forked anew with nothing kept."""
    train(tmp_path / "first")
    warm = warm_spare.kept_pid()
    spares = kept_spares()
    assert warm is not None and len(spares) == WORKERS, notes(tmp_path / "first")
    assert {p.pid for p in psutil.Process(warm).children()} == spares  # idle spares, no worker

    second = train(tmp_path / "second", pids=tmp_path / "pids")
    workers = [json.loads(p.read_text()) for p in (tmp_path / "pids").glob("*.json")]
    assert {w["pid"] for w in workers} == spares and {w["parent"] for w in workers} == {warm}
    assert from_spares(tmp_path / "second") == WORKERS, notes(tmp_path / "second")
    assert warm_spare.kept_pid() == warm and len(kept_spares()) == WORKERS
    assert not kept_spares() & spares  # a worker that trained is never kept as a spare

    warm_spare.end()
    monkeypatch.setenv("FABRIC_MODEL_WARM_KEEP", "0")  # no warm process kept, so no spare: fresh forks
    reference = train(tmp_path / "reference")
    assert "spares" not in notes(tmp_path / "reference") and warm_spare.kept_pid() is None
    assert len(second) == len(reference)
    for got, want in zip(second, reference):
        np.testing.assert_array_equal(got, want)


def test_a_spare_killed_before_it_is_used_does_not_break_the_next_job(kept_keras, tmp_path):
    """A spare that dies unused is dropped (and replaced); the next job's workers start anyway."""
    train(tmp_path / "first")
    victim, *others = sorted(kept_spares())
    os.kill(victim, signal.SIGKILL)
    assert not _gone({victim}, 10), "the warm process did not reap its dead spare"
    train(tmp_path / "second", pids=tmp_path / "pids")
    workers = {json.loads(p.read_text())["pid"] for p in (tmp_path / "pids").glob("*.json")}
    assert len(workers) == WORKERS and victim not in workers
    assert set(others) <= workers  # the live spare was used; the other worker is a replacement or a fork
    assert len(kept_spares()) == WORKERS


def test_the_kept_spares_end_with_the_warm_process(kept_keras, tmp_path, monkeypatch):
    """Idle spares end with their warm process: when the caller ends it, and at its idle timeout."""
    train(tmp_path / "first")
    kept = warm_spare.kept_pids()
    assert len(kept) == WORKERS + 1
    warm_spare.end()
    assert not _gone(kept, 20), "a spare or the warm process outlived warm_spare.end()"

    monkeypatch.setenv("FABRIC_MODEL_WARM_KEEP", "2")
    train(tmp_path / "second")
    kept = warm_spare.kept_pids()
    assert len(kept) == WORKERS + 1
    # It ends 2 s after its last wake-up (a spare done importing is one): far less than this bound.
    assert not _gone(kept, 120), "a kept warm process or its spares outlived its idle time"
    assert warm_spare.kept_pid() is None


def test_the_kept_spares_end_when_the_caller_is_killed(tmp_path):
    """A Keras script SIGKILLed with its warm process kept leaves neither it nor its spares."""
    script = (
        "import os, signal\n"
        "from tests.test_keras_start import train, kept_spares\n"
        "from fabric_model.launchers import warm_spare\n"
        "from pathlib import Path\n"
        f"train(Path({str(tmp_path / 'run')!r}))\n"
        "print('kept', *sorted(warm_spare.kept_pids()), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "FABRIC_MODEL_WARM_KEEP": "300"}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    kept = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("kept ")]
    assert kept and len(kept[0]) == WORKERS + 1, done.stdout + done.stderr[-3000:]
    assert not _gone({int(p) for p in kept[0]}, 20), "the kept warm process or a spare outlived its caller"
