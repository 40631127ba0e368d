"""A Keras job's workers are forks of a warm process that imported TensorFlow and ran none of it
(launchers/warm.py): they train the bits of workers that imported it themselves, the caller's
next train() forks them from the kept process at once, and where the warm process's imports left
a thread a fork breaks, its workers start as fresh interpreters instead."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from fabric_model import FabricModel
from fabric_model.launchers import warm_spare

from .helpers import Lazily

pytestmark = pytest.mark.processes

keras = Lazily("keras")  # at a test's first use: collecting this module imports no TensorFlow

WORKERS = 2


def samples(n: int = 96) -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 12)).astype(np.float32)
    y = (x @ rng.normal(size=(12, 3))).argmax(1)
    return [(x[i], int(y[i])) for i in range(n)]


DATA = samples()


class WorkerPids:
    """A worker logger: each worker writes its pid, its parent's and its command line to ``out`` once."""

    def __init__(self, out: Path) -> None:
        self.out = str(out)

    def log_train_metrics(self, metrics, iteration, epoch, workers):
        path = Path(self.out) / f"{os.getpid()}.json"
        if not path.exists():
            with open("/proc/self/cmdline", "rb") as f:
                argv = [a.decode() for a in f.read().split(b"\0") if a]
            path.write_text(json.dumps({"pid": os.getpid(), "parent": os.getppid(), "argv": argv}))


def train(run_dir: Path, pids: Path) -> tuple[list[np.ndarray], list[dict]]:
    """A deterministic 2-engine Keras job: the model's and the optimizer's variables after it, and
    what each worker said of itself."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((12,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dropout(0.2)]
        + [keras.layers.Dense(3)]
    )
    optimizer = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    pids.mkdir()
    fm = FabricModel(model, lambda: (DATA, None), loss, optimizer, worker_logger_callback=WorkerPids(pids))
    fm.train(1, 16, WORKERS, seed=3, run_dir=run_dir, deterministic=True)
    workers = [json.loads(p.read_text()) for p in pids.glob("*.json")]
    assert len(workers) == WORKERS, workers
    return [v.numpy() for v in model.variables] + [v.numpy() for v in optimizer.variables], workers


def forked(worker: dict) -> bool:
    """Whether a worker is a fork of the warm process (its command line is the warm process's),
    not a fresh interpreter (``python -m fabric_model worker ...``)."""
    return "fabric_model.launchers.warm" in worker["argv"]


def loads_tensorflow(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "_pywrap_tensorflow" in f.read()


@pytest.fixture
def kept_keras(monkeypatch):
    """A caller (this test process, with TensorFlow loaded: unfit to fork) whose warm process is
    kept between jobs; nothing kept before or after."""
    warm_spare.end()
    monkeypatch.setenv("FABRIC_MODEL_WARM_KEEP", "300")
    yield
    warm_spare.end()


def test_a_second_keras_train_forks_from_the_kept_warm_process_the_bits_of_fresh_workers(
    kept_keras, tmp_path, monkeypatch
):
    """Both jobs' workers are forks of one warm process, kept between them, which has TensorFlow
    loaded; the second job's weights are bitwise those of workers that are fresh interpreters,
    each importing TensorFlow itself (no warm process)."""
    _, first = train(tmp_path / "first", tmp_path / "pids-1")
    warm = warm_spare.kept_pid()
    assert warm is not None and loads_tensorflow(warm)
    assert {w["parent"] for w in first} == {warm} and all(map(forked, first)), first
    second, workers = train(tmp_path / "second", tmp_path / "pids-2")
    assert {w["parent"] for w in workers} == {warm} and all(map(forked, workers)), workers
    assert warm_spare.kept_pid() == warm

    warm_spare.end()
    monkeypatch.setenv("FABRIC_MODEL_WARM_START", "0")
    reference, fresh = train(tmp_path / "reference", tmp_path / "pids-3")
    assert not any(map(forked, fresh)), fresh
    assert len(second) == len(reference)
    for got, want in zip(second, reference):
        np.testing.assert_array_equal(got, want)


def test_a_warm_process_whose_imports_left_a_thread_starts_fresh_workers(kept_keras, tmp_path, monkeypatch):
    """An import that starts a thread (here the environment's ``sitecustomize``) makes the warm
    process unfit to fork: it says why in its log, and its workers are fresh interpreters that
    train all the same."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n"
    )
    monkeypatch.syspath_prepend(str(site))  # the workers' (and so the warm process's) PYTHONPATH
    _, workers = train(tmp_path / "run", tmp_path / "pids")
    assert not any(map(forked, workers)), workers
    warm_log = (tmp_path / "run" / "logs" / "warm.log").read_text()
    assert "workers start as fresh interpreters: 2 Python threads" in warm_log, warm_log
