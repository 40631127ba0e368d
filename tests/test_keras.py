"""Keras models (DESIGN §2): the same FabricModel, the same guarantees as for PyTorch."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from fabric_model import FabricModel  # noqa: E402
from fabric_model.adapters.keras_adapter import collate_numpy  # noqa: E402
from fabric_model.plan import Plan, epoch_permutation  # noqa: E402
from fabric_model.testing import FaultInjector, HoldForJoin, Kill, WorkerStarter  # noqa: E402

from .helpers import IndexRecordingDataset, reads_by_pid, records, sample_indices_of_steps  # noqa: E402

SEED, EPOCHS, BATCH = 7, 2, 16


def make_samples(n: int = 250, features: int = 12, classes: int = 3, seed: int = 0) -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(np.float32)
    y = (x @ rng.normal(size=(features, classes))).argmax(1)
    return [(x[i], int(y[i])) for i in range(n)]


DATA = make_samples()


def mlp(dropout: float = 0.0, batchnorm: bool = False, seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((12,)), keras.layers.Dense(32, activation="relu")]
    if batchnorm:
        layers.append(keras.layers.BatchNormalization())
    if dropout:
        layers.append(keras.layers.Dropout(dropout))
    layers.append(keras.layers.Dense(3))
    return keras.Sequential(layers)


def max_rel_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert len(a) == len(b)
    return max(float(np.abs(x - y).max() / (np.abs(y).max() or 1.0)) for x, y in zip(a, b))


def trainable(model: keras.Model) -> list[np.ndarray]:
    return [v.numpy() for v in model.trainable_variables]


def gradient_tape_reference(model, optimizer, loss_fn, samples, *, epochs, batch_size, micro_batches, seed):
    """The plain single-process loop: one GradientTape over each global batch of the plan."""
    plan = Plan(len(samples), batch_size, micro_batches, seed)
    for epoch in range(epochs):
        perm = epoch_permutation(seed, epoch, len(samples))
        for step in range(plan.steps_per_epoch):
            idx = np.concatenate(
                [plan.micro_batch_indices(epoch, step, j, perm) for j in range(plan.num_micro_batches(epoch, step))]
            )
            x, y = collate_numpy([samples[int(i)] for i in idx])
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    return model


def sgd() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def tape_reference():
    model = mlp()
    gradient_tape_reference(model, sgd(), LOSS, DATA, epochs=EPOCHS, batch_size=BATCH, micro_batches=3, seed=SEED)
    return trainable(model)


@pytest.mark.parametrize(("workers", "batch"), [(1, 3 * BATCH), (1, BATCH), (2, BATCH), (3, BATCH)])
def test_same_weights_for_1_2_3_workers_as_a_gradient_tape_loop(workers, batch, tape_reference, run_dir, tmp_path):
    """(1, 48): one worker, one micro-batch a step, which runs the whole step in one function."""
    model = mlp()
    recording = IndexRecordingDataset(DATA, str(tmp_path))
    metrics = [
        "accuracy",
        keras.metrics.SparseCategoricalAccuracy(name="acc_obj"),
        keras.metrics.sparse_top_k_categorical_accuracy,
    ]
    result = FabricModel(model, lambda: (recording, DATA[:40]), LOSS, sgd(), metrics=metrics).train(
        EPOCHS, batch, workers, effective_batch_size=3 * BATCH, seed=SEED, run_dir=run_dir
    )
    assert max_rel_diff(trainable(model), tape_reference) < 1e-5
    assert len(result.replica_digests) == workers and len(set(result.replica_digests.values())) == 1
    # Exactly once: by the committed steps' reports and by what the workers actually read.
    plan = Plan(len(DATA), batch, 3 * BATCH // batch, SEED)
    used = sample_indices_of_steps(plan, records(run_dir, "train"))
    reads = sorted(i for pid, got in reads_by_pid(tmp_path).items() if pid != os.getpid() for i in got)
    for epoch in range(EPOCHS):
        assert sorted(used[epoch]) == list(range(len(DATA)))
    assert reads == sorted(list(range(len(DATA))) * EPOCHS)
    # "accuracy", the Metric object and the function measure the same thing.
    last = result.history[-1]
    assert last["accuracy"] == pytest.approx(last["acc_obj"], abs=1e-6)
    assert 0.0 < last["accuracy"] <= last["sparse_top_k_categorical_accuracy"] <= 1.0
    assert (run_dir / "model" / "model.keras").is_file()
    reloaded = keras.saving.load_model(run_dir / "model" / "model.keras")
    assert max_rel_diff(trainable(reloaded), trainable(model)) == 0.0


def keras_train(run_dir, marker_dir, faults=(), joins=(), workers=3):
    model = mlp(dropout=0.3, batchnorm=True)
    injector = FaultInjector(faults, marker_dir)
    starter = WorkerStarter(run_dir, joins)
    try:
        result = FabricModel(
            model,
            lambda: (DATA, None),
            LOSS,
            sgd(),
            worker_logger_callback=injector,
            driver_logger_callback=starter,
        ).train(EPOCHS, BATCH, workers, effective_batch_size=3 * BATCH, seed=SEED, run_dir=run_dir)
    finally:
        starter.close()
    return model, result


def test_kill_and_join_keep_the_result_for_a_keras_model(run_dir, tmp_path, monkeypatch):
    """Dropout and BatchNorm on: a kill re-divides micro-batches, a join pulls weights, the
    optimizer's momentum and BatchNorm statistics, and the result does not change."""
    monkeypatch.setenv("EDT_REPLACE_WORKERS", "0")
    reference, _ = keras_train(tmp_path / "undisturbed", tmp_path / "m0")
    model, result = keras_train(run_dir, tmp_path, [Kill(1, 3), HoldForJoin(6), Kill(2, 11, "after_step")], joins=[6])
    floats = [v.numpy() for v in model.variables if v.dtype == "float32"]  # weights and BatchNorm statistics
    assert max_rel_diff(floats, [v.numpy() for v in reference.variables if v.dtype == "float32"]) < 1e-5
    assert len(set(result.replica_digests.values())) == 1
    plan = Plan(len(DATA), BATCH, 3, SEED)
    train_records = records(run_dir, "train")
    assert sorted((r["epoch"], r["step"]) for r in train_records) == [
        (e, s) for e in range(EPOCHS) for s in range(plan.steps_per_epoch)
    ]
    used = sample_indices_of_steps(plan, train_records)
    for epoch in range(EPOCHS):
        assert sorted(used[epoch]) == list(range(len(DATA)))
    sizes = [g["workers"] for g in records(run_dir, "generation")]
    assert sizes[0] == 3 and 2 in sizes and sizes.count(3) >= 2, sizes
    assert any(g["source_rank"] >= 0 for g in records(run_dir, "generation"))  # the newcomer pulled state


@keras.saving.register_keras_serializable(package="fabric_tests")
class Registered(keras.layers.Layer):
    """Registered with Keras: found without keras_custom_objects."""

    def call(self, x):
        return x * 1.0


class Scale(keras.layers.Layer):
    """A custom layer with a weight and a constructor argument."""

    def __init__(self, init: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.init = init

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer=keras.initializers.Constant(self.init))

    def call(self, x):
        return x * self.scale

    def get_config(self):
        return {**super().get_config(), "init": self.init}


class Subclassed(keras.Model):
    def __init__(self, hidden: int = 16, **kwargs):
        super().__init__(**kwargs)
        self.hidden = hidden
        self.dense = keras.layers.Dense(hidden, activation="relu")
        self.scale = Scale(0.5)
        self.registered = Registered()
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.registered(self.scale(self.dense(x))))

    def get_config(self):
        return {**super().get_config(), "hidden": self.hidden}


def test_subclassed_model_with_custom_layer_needs_keras_custom_objects(run_dir):
    keras.utils.set_random_seed(1)
    model = Subclassed()
    fm = FabricModel(model, lambda: (DATA, None), "sparse_categorical_crossentropy", "sgd")
    with pytest.raises(TypeError, match="keras_custom_objects") as info:
        fm.train(1, BATCH, 2, seed=SEED, run_dir=run_dir)
    assert "Subclassed" in str(info.value) or "Scale" in str(info.value)

    # Names for the loss, optimizer and metric; the custom classes named: it trains.
    model = Subclassed()
    fm = FabricModel(
        model,
        lambda: (DATA, None),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "adam",
        metrics=["accuracy"],
        keras_custom_objects={"Subclassed": Subclassed, "Scale": Scale},
    )
    result = fm.train(3, BATCH, 2, seed=SEED, run_dir=run_dir)
    assert len(set(result.replica_digests.values())) == 1
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    assert not np.allclose(np.array(model.scale.scale), 0.5)  # the custom weight trained, in the caller's model


@pytest.mark.parametrize(
    ("kwargs", "argument", "suggestion"),
    [
        ({"loss_function": "sparse_categorical_crosentropy"}, "loss_function", "sparse_categorical_crossentropy"),
        ({"optimizer": "adamm"}, "optimizer", "adam"),
        ({"metrics": ["acuracy"]}, "metrics[0]", "accuracy"),
        ({"optimizer": "rms_prop"}, "optimizer", "rmsprop"),
    ],
)
def test_misspelled_names_fail_early_with_close_matches(kwargs, argument, suggestion):
    args = {"loss_function": "sparse_categorical_crossentropy", "optimizer": "sgd", **kwargs}
    with pytest.raises(ValueError) as info:
        FabricModel(mlp(), lambda: (DATA, None), args.pop("loss_function"), args.pop("optimizer"), **args)
    message = str(info.value)
    assert f"`{argument}`" in message and repr(suggestion) in message, message


def test_instances_are_checked_too():
    with pytest.raises(TypeError, match="optimizer"):
        FabricModel(mlp(), lambda: (DATA, None), "mse", keras.optimizers.SGD)
    with pytest.raises(TypeError, match="fn_step_train"):
        FabricModel(mlp(), lambda: (DATA, None), "mse", "sgd", fn_step_train=lambda *a: (0, 0))


class Batches(keras.utils.PyDataset):
    """A batch-level dataset, as ImageDataGenerator().flow() returns: item i is batch i."""

    def __init__(self, samples, batch_size, **kwargs):
        super().__init__(**kwargs)
        self.samples, self.batch_size = samples, batch_size

    def __len__(self):
        return -(-len(self.samples) // self.batch_size)

    def __getitem__(self, i):
        return collate_numpy(self.samples[i * self.batch_size : (i + 1) * self.batch_size])


def test_pydataset_batches_are_micro_batches(run_dir):
    model = mlp()
    data = DATA[:240]
    result = FabricModel(model, lambda: (Batches(data, BATCH), Batches(DATA[240:], 4)), LOSS, sgd()).train(
        1, BATCH, 2, seed=SEED, run_dir=run_dir
    )
    train_records = records(run_dir, "train")
    assert len(train_records) == 8  # 15 batches, two per step
    # The plan counts the dataset's batches: every batch exactly once.
    used = sample_indices_of_steps(Plan(15, 1, 2, SEED), train_records)
    assert sorted(used[0]) == list(range(15))
    assert len(set(result.replica_digests.values())) == 1
    assert result.test_history and np.isfinite(result.test_history[0]["loss"])
    with pytest.raises(ValueError, match="batch_size"):
        FabricModel(mlp(), lambda: (Batches(data, BATCH), None), LOSS, sgd()).train(1, 32, 2, run_dir=run_dir)


KERAS_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    from tests.test_keras import DATA, LOSS, mlp, sgd
    from fabric_model import FabricModel
    from fabric_model.testing import FaultInjector

    class Progress:
        def log_train_metrics(self, metrics, iteration, epoch, workers):
            with open({progress!r}, "w") as f:
                f.write(str(iteration))

    fm = FabricModel(mlp(), lambda: (DATA, None), LOSS, sgd(), driver_logger_callback=Progress(),
                     worker_logger_callback=FaultInjector([], {markers!r}, step_delay={delay}))
    fm.train({epochs}, {batch}, 2, effective_batch_size={global_batch}, seed={seed}, run_dir={run_dir!r},
             resume={resume})
""")


def run_keras_script(tmp_path, run_dir, name, *, resume, delay=0.0):
    progress = tmp_path / f"{name}.progress"
    script = tmp_path / f"{name}.py"
    script.write_text(
        KERAS_SCRIPT.format(
            repo=str(Path(__file__).resolve().parents[1]),
            progress=str(progress),
            markers=str(tmp_path),
            delay=delay,
            epochs=EPOCHS,
            batch=BATCH,
            global_batch=3 * BATCH,
            seed=SEED,
            run_dir=str(run_dir),
            resume=resume,
        )
    )
    out = open(tmp_path / f"{name}.out", "wb")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    out.close()
    return proc, progress


def test_keras_job_killed_whole_resumes_to_the_undisturbed_weights(tmp_path, tape_reference):
    """Driver and workers SIGKILLed mid-epoch after a checkpoint; a new job resumes from it (on 2
    workers, and on 1 accumulating the same global batch) and ends with the undisturbed weights."""
    run_dir = tmp_path / "run"
    steps_per_epoch = Plan(len(DATA), BATCH, 3, SEED).steps_per_epoch
    proc, progress = run_keras_script(tmp_path, run_dir, "first", resume=False, delay=0.3)
    try:
        deadline = time.monotonic() + 150
        while not (progress.exists() and int(progress.read_text() or 0) >= steps_per_epoch + 2):
            assert proc.poll() is None, (tmp_path / "first.out").read_text()
            assert time.monotonic() < deadline, "the job did not get 2 steps past its first checkpoint"
            time.sleep(0.05)
        workers = psutil.Process(proc.pid).children()
        proc.kill()
        proc.wait(timeout=10)
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, "workers outlived the driver"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert list((run_dir / "checkpoints").glob("ckpt-unit-*.pt")), "no checkpoint was written"
    assert not (run_dir / "model" / "model.keras").exists()
    copy_dir = tmp_path / "copy"
    shutil.copytree(run_dir, copy_dir)

    proc, _ = run_keras_script(tmp_path, run_dir, "resumed", resume=True)
    try:
        assert proc.wait(timeout=150) == 0, (tmp_path / "resumed.out").read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    resumed = keras.saving.load_model(run_dir / "model" / "model.keras")
    assert max_rel_diff(trainable(resumed), tape_reference) < 1e-5
    assert records(run_dir, "resume")

    model = mlp()
    FabricModel(model, lambda: (DATA, None), LOSS, sgd()).train(
        EPOCHS, BATCH, 1, effective_batch_size=3 * BATCH, seed=SEED, run_dir=copy_dir, resume=True
    )
    assert max_rel_diff(trainable(model), tape_reference) < 1e-5
