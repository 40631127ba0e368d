"""``deterministic=True`` for a Keras model (docs/architecture.md, "Deterministic mode"): the
fixed-point step sum and TensorFlow's op determinism make weights, BatchNorm statistics and
the optimizer's variables bitwise equal on 1 worker and on 3, 2 then 3 through a kill and a join."""

from __future__ import annotations

import os
import signal
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fabric_model import FabricModel
from fabric_model.testing import FaultInjector, HoldForJoin, Kill

from .helpers import Lazily, records, run_script
from .load import scaled

pytestmark = pytest.mark.processes

keras = Lazily("keras")  # at a test's first use: collecting this module imports no TensorFlow

SEED, EPOCHS, BATCH, GLOBAL = 3, 10, 16, 48  # 3 micro-batches a step, 3 steps an epoch, 30 steps


def samples(n: int = 144) -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 12)).astype(np.float32)
    y = (x @ rng.normal(size=(12, 3))).argmax(1)
    return [(x[i], int(y[i])) for i in range(n)]


DATA = samples()


def train(run_dir, workers, faults=(), marker_dir=None, driver_logger=None, **kwargs):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(3),
        ]
    )
    optimizer = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    injector = FaultInjector(list(faults), marker_dir) if faults else None
    loggers = {"worker_logger_callback": injector, "driver_logger_callback": driver_logger}
    fm = FabricModel(model, lambda: (DATA, None), loss, optimizer, **loggers)
    fm.train(
        EPOCHS, BATCH, workers, effective_batch_size=GLOBAL, seed=SEED, run_dir=run_dir, deterministic=True, **kwargs
    )
    # Weights, BatchNorm statistics, then the optimizer's iteration count and momenta.
    return [v.numpy() for v in model.variables] + [v.numpy() for v in optimizer.variables]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("reference") / "run", 1)


def assert_bitwise_equal(state, reference) -> None:
    assert len(state) == len(reference)
    differ = [i for i, (a, b) in enumerate(zip(state, reference)) if not np.array_equal(a, b)]
    assert not differ, f"not bitwise equal: variables {differ}"


def test_bitwise_equal_after_a_kill_and_a_replacement(reference, run_dir, tmp_path):
    """3 workers, then 2 after the kill (the micro-batches divided anew), then 3 again."""
    state = train(run_dir, 3, [Kill(1, 5), HoldForJoin(9)], tmp_path)
    assert_bitwise_equal(state, reference)
    sizes = [g["workers"] for g in records(run_dir, "generation")]
    assert sizes[:2] == [3, 2] and sizes[-1] == 3, sizes  # the kill happened, the replacement joined


KILLED = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    from pathlib import Path
    from tests.helpers import KilledAt
    from tests.test_deterministic_keras import train

    train(Path({run_dir!r}), 2, driver_logger=KilledAt({at}), resume="auto")
""")


def test_a_killed_driver_run_again_goes_on_bitwise(reference, tmp_path, monkeypatch):
    """SIGKILL to a Keras job's driver at step 12 of 30; the same call again takes its 2 workers'
    state back: every step committed once, and the weights and optimizer variables are the
    1-worker run's, bitwise."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, FABRIC_MODEL_DRIVER_WAIT="120")
    script = KILLED.format(repo=str(Path(__file__).resolve().parents[1]), run_dir=str(run_dir), at=12)
    code, out, started = run_script(script, scaled(180), env)
    try:
        assert code == -signal.SIGKILL, out[-3000:]
        monkeypatch.setenv("FABRIC_MODEL_DRIVER_WAIT", "120")
        state = train(run_dir, 2, resume="auto")
    finally:
        import psutil

        _, alive = psutil.wait_procs(started, timeout=scaled(30))
        for process in alive:
            process.kill()
    assert not alive, f"still running: {[p.pid for p in alive]}"
    assert_bitwise_equal(state, reference)
    iterations = sorted(r["iteration"] for r in records(run_dir, "train"))
    assert iterations == list(range(1, 31)), iterations  # each step committed once: none redone
    back = [g for g in records(run_dir, "generation") if g["reason"] == "the driver restarted"]
    assert len(back) == 1 and back[0]["members"] == [0, 1], records(run_dir, "generation")  # taken back
    assert not (run_dir / "join.json").exists()


def augmenting_train(run_dir, workers):
    """Preprocessing layers that augment inside the model, drawing as dropout does."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.RandomFlip("horizontal"),
            keras.layers.RandomRotation(0.1),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    rng = np.random.default_rng(1)
    x = rng.random((72, 8, 8, 1)).astype(np.float32)
    y = (x[:, :, :4].mean(axis=(1, 2, 3)) > 0.5).astype(int)
    data = [(x[i], int(y[i])) for i in range(72)]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    fm = FabricModel(model, lambda: (data, None), loss, keras.optimizers.SGD(learning_rate=0.05))
    fm.train(2, 8, workers, effective_batch_size=24, seed=SEED, run_dir=run_dir, deterministic=True)
    return [v.numpy() for v in model.variables]


def test_random_preprocessing_layers_train_bitwise_alike_on_1_and_2_workers(tmp_path):
    one, two = augmenting_train(tmp_path / "one", 1), augmenting_train(tmp_path / "two", 2)
    assert_bitwise_equal(two, one)
