"""Keras models (docs/architecture.md, "Frameworks"): the same FabricModel, the same guarantees as for PyTorch."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from fabric_model import FabricModel
from fabric_model.frameworks.keras.adapter import collate_numpy
from fabric_model.step.plan import Plan, epoch_permutation
from fabric_model.testing import FaultInjector, HoldForJoin, Kill, Preempt, WorkerStarter

from .helpers import (
    IndexRecordingDataset,
    Lazily,
    assert_each_sample_once_per_epoch,
    reads_by_pid,
    records,
    sample_indices_of_steps,
    started_processes,
)

# TensorFlow at a test's first use, not at collection; the loss, custom layers and models with it.
keras, tf = Lazily("keras"), Lazily("tensorflow")
parts = Lazily(".keras_parts", __package__)

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


@pytest.fixture(scope="module")
def tape_reference():
    model = mlp()
    gradient_tape_reference(model, sgd(), parts.LOSS, DATA, epochs=EPOCHS, batch_size=BATCH, micro_batches=3, seed=SEED)
    return trainable(model)


@pytest.mark.processes
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
    result = FabricModel(model, lambda: (recording, DATA[:40]), parts.LOSS, sgd(), metrics=metrics).train(
        EPOCHS, batch, workers, effective_batch_size=3 * BATCH, seed=SEED, run_dir=run_dir
    )
    assert max_rel_diff(trainable(model), tape_reference) < 1e-5
    assert len(result.replica_digests) == workers and len(set(result.replica_digests.values())) == 1
    assert_each_sample_once_per_epoch(run_dir, tmp_path, Plan(len(DATA), batch, 3 * BATCH // batch, SEED), EPOCHS)
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
            parts.LOSS,
            sgd(),
            worker_logger_callback=injector,
            driver_logger_callback=starter,
        ).train(EPOCHS, BATCH, workers, effective_batch_size=3 * BATCH, seed=SEED, run_dir=run_dir)
    finally:
        starter.close()
    return model, result


def floats(model: keras.Model) -> list[np.ndarray]:
    """Weights and BatchNorm statistics."""
    return [v.numpy() for v in model.variables if v.dtype == "float32"]


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    """mlp(dropout, BatchNorm) trained by FabricModel on 3 workers without faults."""
    tmp = tmp_path_factory.mktemp("undisturbed")
    model, _ = keras_train(tmp / "run", tmp / "markers")
    return floats(model)


@pytest.mark.processes
def test_kill_and_join_keep_the_result_for_a_keras_model(run_dir, tmp_path, monkeypatch, undisturbed):
    """Dropout and BatchNorm on: a kill re-divides micro-batches, a join pulls weights, the
    optimizer's momentum and BatchNorm statistics, and the result does not change."""
    monkeypatch.setenv("EDT_REPLACE_WORKERS", "0")
    model, result = keras_train(run_dir, tmp_path, [Kill(1, 3), HoldForJoin(6), Kill(2, 11, "after_step")], joins=[6])
    assert max_rel_diff(floats(model), undisturbed) < 1e-5
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


@pytest.mark.processes
def test_a_keras_worker_told_to_go_leaves_after_its_step(run_dir, tmp_path, monkeypatch, undisturbed):
    """A preemption signal (docs/architecture.md, "Preemption") in a Keras worker: it leaves after
    its step, the others go on with nothing redone, and the result does not change."""
    monkeypatch.setenv("EDT_REPLACE_WORKERS", "0")
    model, result = keras_train(run_dir, tmp_path, [Preempt(2, 4)])
    assert max_rel_diff(floats(model), undisturbed) < 1e-5
    steps = [(r["epoch"], r["step"]) for r in records(run_dir, "train")]
    assert sorted(steps) == [
        (e, s) for e in range(EPOCHS) for s in range(Plan(len(DATA), BATCH, 3, SEED).steps_per_epoch)
    ]
    generations = records(run_dir, "generation")
    assert [g["workers"] for g in generations] == [3, 2] and generations[1]["reason"] == "worker 2 leaves (SIGTERM)"


@pytest.mark.processes
def test_subclassed_model_with_custom_layer_needs_keras_custom_objects(run_dir):
    keras.utils.set_random_seed(1)
    model = parts.Subclassed()
    fm = FabricModel(model, lambda: (DATA, None), "sparse_categorical_crossentropy", "sgd")
    with pytest.raises(TypeError, match="keras_custom_objects") as info:
        fm.train(1, BATCH, 2, seed=SEED, run_dir=run_dir)
    assert "Subclassed" in str(info.value) or "Scale" in str(info.value)
    assert not run_dir.exists() and not started_processes()  # before any worker or run directory

    # Names for the loss, optimizer and metric; the custom classes named: it trains.
    model = parts.Subclassed()
    fm = FabricModel(
        model,
        lambda: (DATA, None),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "adam",
        metrics=["accuracy"],
        keras_custom_objects={"Subclassed": parts.Subclassed, "Scale": parts.Scale},
    )
    result = fm.train(3, BATCH, 2, seed=SEED, run_dir=run_dir)
    assert len(set(result.replica_digests.values())) == 1
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    assert not np.allclose(np.array(model.scale.scale), 0.5)  # the custom weight trained, in the caller's model


@pytest.mark.processes
def test_a_model_rebuilt_into_another_function_fails_early(run_dir):
    """Same weights, other outputs: the workers would train another model, so it fails in the caller."""
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(8), parts.Forgetful(3.0), keras.layers.Dense(3)])
    fm = FabricModel(
        model, lambda: (DATA, None), parts.LOSS, "sgd", keras_custom_objects={"Forgetful": parts.Forgetful}
    )
    with pytest.raises(TypeError, match=r"(?s)computes other outputs.*get_config\(\).*keras_custom_objects"):
        fm.train(1, BATCH, 2, seed=SEED, run_dir=run_dir)
    assert not run_dir.exists()


@pytest.mark.processes
def test_samples_the_model_cannot_take_fail_early_naming_get_datasets(run_dir):
    samples = [((x[:6], x[6:]), y) for x, y in DATA]  # two inputs for a one-input model
    with pytest.raises(ValueError, match=r"(?s)fails on the first training batch.*tuple of 2.*`datasets_function`"):
        FabricModel(mlp(), lambda: (samples, None), parts.LOSS, "sgd").train(1, BATCH, 2, seed=SEED, run_dir=run_dir)
    assert not run_dir.exists()


def test_list_valued_features_are_arrays():
    x, y = collate_numpy([([0.5, 1.5, 2.5], 1), ([3.0, 4.0, 5.0], 0)])
    assert x.shape == (2, 3) and x.dtype == np.float32 and y.tolist() == [1, 0]
    (a, b), _ = collate_numpy([((np.zeros(2), np.ones(3)), 0)] * 4)  # a tuple of arrays: two inputs
    assert a.shape == (4, 2) and b.shape == (4, 3)


@pytest.mark.tensorflow
def test_keras_set_random_seed_fixes_the_drawn_seed():
    """keras.utils.set_random_seed(s) at the top of a script makes the run reproducible, the seed
    included (Keras on TensorFlow does not seed torch); see docs/architecture.md, "Frameworks"."""
    from fabric_model.frameworks import framework_named

    def _draw_seed(name):
        return framework_named(name).draw_seed()

    keras.utils.set_random_seed(11)
    first = _draw_seed("keras")
    keras.utils.set_random_seed(11)
    assert _draw_seed("keras") == first
    keras.utils.set_random_seed(12)
    assert _draw_seed("keras") != first


@pytest.mark.processes
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


@pytest.mark.processes
def test_instances_are_checked_too():
    with pytest.raises(TypeError, match="optimizer"):
        FabricModel(mlp(), lambda: (DATA, None), "mse", keras.optimizers.SGD)
    with pytest.raises(TypeError, match="fn_step_train"):  # a Keras custom step: docs/keras.md, "Custom steps"
        FabricModel(mlp(), lambda: (DATA, None), "mse", "sgd", fn_step_train="train_step")


@pytest.mark.tensorflow
def test_metrics_are_labelled_as_given(run_dir):
    from fabric_model.frameworks.keras.adapter import KerasAdapter

    adapter = KerasAdapter(mlp(), "sgd", "mse", ["mae", "acc", keras.metrics.MeanSquaredError(name="my_mse"), "mae"])
    assert adapter.stat_names == ["loss", "mae", "acc", "my_mse", "mae_2"]


def pydataset_reference(batches: parts.Batches, epochs: int, micro_batches: int) -> list[np.ndarray]:
    """A GradientTape loop over the plan's steps of whole batches, each batch weighing the same
    (the documented rule: a short last batch counts as much as a full one)."""
    model, optimizer = mlp(), sgd()
    plan = Plan(len(batches), 1, micro_batches, SEED)
    for epoch in range(epochs):
        perm = epoch_permutation(SEED, epoch, len(batches))
        for step in range(plan.steps_per_epoch):
            items = [
                int(plan.micro_batch_indices(epoch, step, j, perm)[0])
                for j in range(plan.num_micro_batches(epoch, step))
            ]
            with tf.GradientTape() as tape:
                losses = [parts.LOSS(y, model(x, training=True)) for x, y in (batches[i] for i in items)]
                loss = tf.add_n(losses) / len(items)
            optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    return trainable(model)


@pytest.mark.processes
@pytest.mark.parametrize("workers", [1, 2])
def test_pydataset_batches_are_micro_batches(run_dir, tmp_path, workers):
    """250 samples in batches of 16: 16 batches, the last of 10, two to a step."""
    model = mlp()
    train = parts.Batches(DATA, BATCH, str(tmp_path))
    result = FabricModel(model, lambda: (train, parts.Batches(DATA[:40], 4)), parts.LOSS, sgd()).train(
        2, BATCH, workers, effective_batch_size=2 * BATCH, seed=SEED, run_dir=run_dir
    )
    assert max_rel_diff(trainable(model), pydataset_reference(parts.Batches(DATA, BATCH), 2, 2)) < 1e-5
    train_records = records(run_dir, "train")
    assert len(train_records) == 2 * 8
    # The plan counts the dataset's batches: every batch exactly once, by the reports and the reads.
    used = sample_indices_of_steps(Plan(16, 1, 2, SEED), train_records)
    assert sorted(used[0]) == sorted(used[1]) == list(range(16))
    reads = sorted(i for pid, got in reads_by_pid(tmp_path).items() if pid != os.getpid() for i in got)
    assert reads == sorted(list(range(16)) * 2)
    assert len(result.replica_digests) == workers and len(set(result.replica_digests.values())) == 1
    assert result.test_history and np.isfinite(result.test_history[0]["loss"])


@pytest.mark.processes
def test_pydataset_batch_size_must_be_its_own(run_dir):
    with pytest.raises(ValueError, match=r"Expected `batch_size` to be the batch size.*batch_size=32.*batch_size=16"):
        FabricModel(mlp(), lambda: (parts.Batches(DATA, BATCH), None), parts.LOSS, sgd()).train(
            1, 32, 2, run_dir=run_dir
        )


KERAS_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    from tests.keras_parts import LOSS
    from tests.test_keras import DATA, mlp, sgd
    from fabric_model import FabricModel
    from fabric_model.testing import FaultInjector

    class Progress:
        def log_train_metrics(self, metrics, iteration, epoch, workers):
            with open({progress!r}, "w") as f:
                f.write(str(iteration))

    fm = FabricModel(mlp(dropout=0.3, batchnorm=True), lambda: (DATA, None), LOSS, sgd(),
                     driver_logger_callback=Progress(),
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


@pytest.mark.processes
def test_keras_job_killed_whole_resumes_to_the_undisturbed_weights(tmp_path, undisturbed):
    """Driver and workers SIGKILLed mid-epoch after a checkpoint; a new job resumes from it (on 2
    workers, and on 1 accumulating the same global batch) and ends with the undisturbed weights.
    Dropout, BatchNorm and SGD momentum: the checkpoint must carry the moving statistics and the
    optimizer's variables, and the randomness must follow the plan, not the process."""
    run_dir = tmp_path / "run"
    steps_per_epoch = Plan(len(DATA), BATCH, 3, SEED).steps_per_epoch
    proc, progress = run_keras_script(tmp_path, run_dir, "first", resume=False, delay=0.3)
    try:
        deadline = time.monotonic() + 150
        # 2 steps past the epoch's end, and its checkpoint on disk: its upload and write take their
        # own time (threads in rank 0 and in the driver), more on a busy machine than 2 paced steps.
        while not (
            progress.exists()
            and int(progress.read_text() or 0) >= steps_per_epoch + 2
            and list((run_dir / "checkpoints").glob("ckpt-unit-*.pt"))
        ):
            assert proc.poll() is None, (tmp_path / "first.out").read_text()
            assert time.monotonic() < deadline, "the job did not get 2 steps past its first checkpoint"
            time.sleep(0.05)
        workers = psutil.Process(proc.pid).children(recursive=True)  # the warm process and its forks
        assert len(workers) >= 2
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
        proc.wait(timeout=10)
    resumed = keras.saving.load_model(run_dir / "model" / "model.keras")
    assert max_rel_diff(floats(resumed), undisturbed) < 1e-5
    assert records(run_dir, "resume")

    model = mlp(dropout=0.3, batchnorm=True)
    FabricModel(model, lambda: (DATA, None), parts.LOSS, sgd()).train(
        EPOCHS, BATCH, 1, effective_batch_size=3 * BATCH, seed=SEED, run_dir=copy_dir, resume=True
    )
    assert max_rel_diff(floats(model), undisturbed) < 1e-5


@pytest.mark.processes
def test_functional_model_with_named_dict_inputs(run_dir):
    """Samples ({"a": array, "b": array}, y): stacked per key and fed to the named inputs."""
    keras.utils.set_random_seed(2)
    a, b = keras.Input((8,), name="a"), keras.Input((4,), name="b")
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([a, b]))
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(3)(hidden))
    samples = [({"a": x[:8], "b": x[8:]}, y) for x, y in DATA]
    before = [v.numpy().copy() for v in model.trainable_variables]
    result = FabricModel(model, lambda: (samples, samples[:40]), parts.LOSS, "sgd", metrics=["accuracy"]).train(
        2, BATCH, 2, seed=SEED, run_dir=run_dir
    )
    assert len(set(result.replica_digests.values())) == 1
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    assert max_rel_diff(trainable(model), before) > 0  # the caller's model holds the trained weights


def scheduled_sgd() -> keras.optimizers.Optimizer:
    schedule = keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=4, decay_rate=0.5)
    return keras.optimizers.SGD(learning_rate=schedule, momentum=0.9)


@pytest.mark.processes
def test_a_learning_rate_schedule_resumes_and_the_model_comes_back_compiled(run_dir):
    """A LearningRateSchedule reads the optimizer's iteration count, which the checkpoint carries:
    1 epoch, then a resume to 2, ends with the weights of a GradientTape loop under the same
    schedule. The model comes back compiled (model.evaluate works); fm.evaluate / predict agree."""
    reference = mlp()
    gradient_tape_reference(
        reference, scheduled_sgd(), parts.LOSS, DATA, epochs=EPOCHS, batch_size=BATCH, micro_batches=3, seed=SEED
    )
    test = DATA[:40]
    FabricModel(mlp(), lambda: (DATA, test), parts.LOSS, scheduled_sgd(), metrics=["accuracy"]).train(
        1, BATCH, 1, effective_batch_size=3 * BATCH, seed=SEED, run_dir=run_dir
    )
    model, optimizer = mlp(), scheduled_sgd()
    fm = FabricModel(model, lambda: (DATA, test), parts.LOSS, optimizer, metrics=["accuracy"])
    result = fm.train(EPOCHS, BATCH, 1, effective_batch_size=3 * BATCH, run_dir=run_dir, resume=True)
    assert max_rel_diff(trainable(model), trainable(reference)) < 1e-5
    steps = EPOCHS * -(-len(DATA) // (3 * BATCH))
    assert int(optimizer.iterations) == steps
    x, y = collate_numpy(test)
    keras_result = model.evaluate(x, y, verbose=0, return_dict=True)  # compiled with the loss and metrics given
    ours = fm.evaluate()
    assert ours["loss"] == pytest.approx(result.test_history[-1]["loss"], rel=1e-5)
    assert keras_result["loss"] == pytest.approx(ours["loss"], rel=1e-5)
    assert keras_result["accuracy"] == pytest.approx(result.test_history[-1]["accuracy"])
    assert fm.predict(test).shape == (40, 3)


@pytest.mark.processes
def test_gradient_clip_norm_clips_the_reduced_step_gradient_as_global_clipnorm_does(run_dir, tape_reference):
    """Two workers: Keras' optimizer clips the step's reduced gradient, as ``global_clipnorm``
    does on the GradientTape loop's whole-batch gradient; the user's optimizer is left as given."""
    clip = 0.05
    reference = mlp()
    clipping = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9, global_clipnorm=clip)
    gradient_tape_reference(
        reference, clipping, parts.LOSS, DATA, epochs=EPOCHS, batch_size=BATCH, micro_batches=3, seed=SEED
    )
    assert max_rel_diff(trainable(reference), tape_reference) > 0.1  # the clip binds
    model, optimizer = mlp(), sgd()
    FabricModel(model, lambda: (DATA, None), parts.LOSS, optimizer, gradient_clip_norm=clip).train(
        EPOCHS, BATCH, 2, effective_batch_size=3 * BATCH, seed=SEED, run_dir=run_dir
    )
    assert max_rel_diff(trainable(model), trainable(reference)) < 1e-5
    assert optimizer.global_clipnorm is None
    for log in (run_dir / "logs").glob("worker-*.log"):  # TensorFlow's start-up notices stay out, whichever
        assert TF_LOG_LINE.search(log.read_text()) is None, log.read_text()


QUIET_IMPORT = """
import os, sys
from fabric_model import quiet_tensorflow
with quiet_tensorflow():
    os.write(2, b"a real error line\\n")
    import tensorflow
tensorflow.constant(1.0) + 1.0  # the first operation: no CUDA notice left to print here
"""

#: A line in TensorFlow's native log format, whatever it says: absl's (``I0000 00:00:1795755961.669667
#: 6010 port.cc:153] ...``) or older TensorFlow's (``2024-05-01 10:00:00.000000: I tensorflow/...cc:153]
#: ...``), or absl's preamble to the first of them. Which notices a machine prints depends on its
#: CPU and its CUDA driver: the tests recognise them by this format, not by what they say.
TF_LOG_LINE = re.compile(
    r"^(?:[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ |\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] )\S+:\d+\] "
    r"|^WARNING: All log messages before absl::InitializeLog\(\)",
    re.M,
)


def tf_messages(stderr: str) -> set[str]:
    """The lines of ``stderr``, each without the time and thread TensorFlow's format puts first."""
    return {re.sub(r"^.*?\S+:\d+\] ", "", line) for line in stderr.splitlines() if line.strip()}


def import_quietly(level: str, onednn: str) -> str:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": level, "TF_ENABLE_ONEDNN_OPTS": onednn}
    done = subprocess.run([sys.executable, "-c", QUIET_IMPORT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "a real error line" in done.stderr
    return done.stderr


@pytest.mark.processes
@pytest.mark.parametrize("onednn", ["1", "0"])
def test_quiet_tensorflow_drops_only_the_start_up_notices(onednn):
    """TensorFlow writes its start-up notices to descriptor 2 whatever TF_CPP_MIN_LOG_LEVEL says;
    quiet_tensorflow drops those lines and keeps any other, unless the user asks for them (0).
    Which notices come depends on the machine (oneDNN's on some CPUs, the CPU-feature one, a
    missing CUDA driver's): the oneDNN notice is provoked here (TF_ENABLE_ONEDNN_OPTS=1) or kept
    off, and the others are recognised by TensorFlow's log format."""
    shown, quiet = import_quietly("0", onednn), import_quietly("2", onednn)
    assert ("oneDNN custom operations" in shown) == (onednn == "1")  # level 0: TensorFlow's lines, as it wrote them
    assert TF_LOG_LINE.search(quiet) is None, quiet  # level 2: no line of TensorFlow's ...
    assert tf_messages(quiet) & tf_messages(shown) == {"a real error line"}, quiet  # ... nor a continuation


@pytest.mark.processes
def test_a_keras_model_built_under_mixed_bfloat16_trains_in_bfloat16(run_dir):
    """What the `precision` error tells a Keras user to do instead: the dtype policy travels with
    the model to the workers (float32 variables, bfloat16 compute), and training goes as usual."""
    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((12,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(3, dtype="float32")]
        )
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    result = FabricModel(model, lambda: (DATA, None), parts.LOSS, sgd()).train(
        3, BATCH, 2, effective_batch_size=3 * BATCH, seed=SEED, run_dir=run_dir
    )
    assert model.layers[0].compute_dtype == "bfloat16" and model.layers[0].kernel.dtype == "float32"
    assert result.history[-1]["loss"] < result.history[0]["loss"]


@pytest.mark.processes
def test_verbose_2_shows_tensorflow_s_notices_in_the_worker_logs(run_dir, monkeypatch):
    """The default keeps them out (test_gradient_clip_norm_... checks that); verbose=2 lets them in.
    The workers are made to print one (TF_ENABLE_ONEDNN_OPTS=1: oneDNN's notice, on any CPU)."""
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "1")
    FabricModel(mlp(), lambda: (DATA, None), parts.LOSS, sgd()).train(
        1, BATCH, 1, effective_batch_size=3 * BATCH, seed=SEED, run_dir=run_dir, verbose=2
    )
    log = (run_dir / "logs" / "worker-0.log").read_text()
    assert "oneDNN custom operations" in log and TF_LOG_LINE.search(log), log
    assert "_FABRIC_MODEL_TF_NOTICES" not in os.environ  # the caller's environment is left as it was
