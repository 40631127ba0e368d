"""A Keras model on a ``ShardedDataset`` (docs/data.md): JSON-lines shards of numpy samples, every
sample once per epoch, and with ``deterministic=True`` the same bits on 1 worker and on 2 after a kill."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fabric_model import FabricModel, ShardedDataset
from fabric_model.step.plan import Plan
from fabric_model.testing import FaultInjector, Kill

from .helpers import Lazily, records
from .test_sharded_runs import used_positions

pytestmark = pytest.mark.processes

keras = Lazily("keras")  # at a test's first use: collecting this module imports no TensorFlow

SEED, EPOCHS, BATCH, GLOBAL = 3, 3, 16, 32  # 2 streams
LENGTHS = [40, 0, 17, 33, 9, 25]  # 124 samples: 62 a stream, 4 steps an epoch


def write_shards(directory: Path) -> list[str]:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 3))
    paths = []
    for i, n in enumerate(LENGTHS):
        path = directory / f"part-{i}.jsonl"
        x = rng.normal(size=(n, 8)).astype(np.float32)
        with open(path, "w") as f:
            for row in x:
                f.write(json.dumps({"x": row.tolist(), "y": int((row @ w).argmax())}) + "\n")
        paths.append(str(path))
    return paths


def read_jsonl(path: str):
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            yield np.asarray(r["x"], dtype=np.float32), r["y"]


def train(run_dir, paths, workers, faults=(), marker_dir=None):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    optimizer = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    injector = FaultInjector(list(faults), marker_dir) if faults else None
    FabricModel(
        model,
        lambda: (ShardedDataset(paths, read_jsonl, shuffle_window=8), ShardedDataset(paths[:2], read_jsonl)),
        loss,
        optimizer,
        metrics=["accuracy"],
        worker_logger_callback=injector,
    ).train(EPOCHS, BATCH, workers, effective_batch_size=GLOBAL, seed=SEED, run_dir=run_dir, deterministic=True)
    return [v.numpy() for v in model.variables] + [v.numpy() for v in optimizer.variables]


def test_a_keras_model_trains_on_shards_exactly_once_and_alike_through_a_kill(tmp_path):
    paths = write_shards(tmp_path)
    one = train(tmp_path / "one", paths, 1)
    two = train(tmp_path / "two", paths, 2, [Kill(1, 5)], tmp_path)
    differ = [i for i, (a, b) in enumerate(zip(two, one)) if not np.array_equal(a, b)]
    assert len(two) == len(one) and not differ, f"not bitwise equal: variables {differ}"
    sizes = [g["workers"] for g in records(tmp_path / "two", "generation")]
    assert sizes[:2] == [2, 1], sizes  # the kill happened
    for run in ("one", "two"):
        plan = Plan(**json.loads((tmp_path / run / "run.json").read_text())["plan"])
        assert plan.shard_lengths == tuple(LENGTHS) and plan.steps_per_epoch == 4
        used = used_positions(tmp_path / run, plan, EPOCHS)
        assert all(sorted(u) == list(range(sum(LENGTHS))) for u in used.values())
    assert len(records(tmp_path / "two", "test")) == EPOCHS  # the sharded validation set ran
