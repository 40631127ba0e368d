"""``deterministic=True`` for a Keras model (docs/architecture.md, "Deterministic mode"): the
fixed-point step sum and TensorFlow's op determinism make weights, BatchNorm statistics and
the optimizer's variables bitwise equal on 1 worker and on 3, 2 then 3 through a kill and a join."""

from __future__ import annotations

import numpy as np
import pytest

from fabric_model import FabricModel, quiet_tensorflow
from fabric_model.testing import FaultInjector, HoldForJoin, Kill

from .helpers import records

pytestmark = pytest.mark.processes

with quiet_tensorflow():
    import keras

SEED, EPOCHS, BATCH, GLOBAL = 3, 10, 16, 48  # 3 micro-batches a step, 3 steps an epoch, 30 steps


def samples(n: int = 144) -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 12)).astype(np.float32)
    y = (x @ rng.normal(size=(12, 3))).argmax(1)
    return [(x[i], int(y[i])) for i in range(n)]


DATA = samples()


def train(run_dir, workers, faults=(), marker_dir=None):
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
    FabricModel(model, lambda: (DATA, None), loss, optimizer, worker_logger_callback=injector).train(
        EPOCHS, BATCH, workers, effective_batch_size=GLOBAL, seed=SEED, run_dir=run_dir, deterministic=True
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
