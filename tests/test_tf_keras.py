"""Keras 2 models (``tf_keras``, ``tf.keras`` under ``TF_USE_LEGACY_KERAS=1``; docs/keras.md, "Keras 2
(tf_keras) models"): the same FabricModel and the same guarantees as for Keras 3 (tests/test_keras.py).

This process imports ``tf_keras`` directly, so ``TF_USE_LEGACY_KERAS`` is never set here and ``tf.keras``
stays Keras 3 for the other tests; the IBM-style script that sets it runs in a process of its own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fabric_model import FabricModel
from fabric_model.frameworks.keras.batches import collate_numpy
from fabric_model.step.plan import Plan, epoch_permutation
from fabric_model.testing import FaultInjector, HoldForJoin, Kill, WorkerStarter

from .helpers import IndexRecordingDataset, Lazily, assert_each_sample_once_per_epoch, need, records

if importlib.util.find_spec("tf_keras") is None:
    need("tf_keras")  # the module skipped (failed where tox promises every extra)

# tf_keras and TensorFlow at a test's first use, not at collection; the loss, the Model subclasses and
# the custom layer with them.
tf_keras, tf = Lazily("tf_keras"), Lazily("tensorflow")
parts = Lazily(".tf_keras_parts", __package__)

SEED, EPOCHS, BATCH = 7, 2, 16
REPO = str(Path(__file__).resolve().parents[1])


def make_samples(n: int = 250, features: int = 12, classes: int = 3, seed: int = 0) -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(np.float32)
    y = (x @ rng.normal(size=(features, classes))).argmax(1)
    return [(x[i], int(y[i])) for i in range(n)]


DATA = make_samples()
ONE_HOT = [(x, np.eye(3, dtype=np.float32)[y]) for x, y in DATA]  # Keras 2 scripts' usual labels


def mlp(dropout: float = 0.0, batchnorm: bool = False, seed: int = 0, softmax: bool = False):
    tf_keras.utils.set_random_seed(seed)
    layers = [tf_keras.layers.Dense(32, activation="relu", input_shape=(12,))]
    if batchnorm:
        layers.append(tf_keras.layers.BatchNormalization())
    if dropout:
        layers.append(tf_keras.layers.Dropout(dropout))
    layers.append(tf_keras.layers.Dense(3, activation="softmax" if softmax else None))
    return tf_keras.Sequential(layers)


def max_rel_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert len(a) == len(b)
    return max(float(np.abs(x - y).max() / (np.abs(y).max() or 1.0)) for x, y in zip(a, b))


def trainable(model) -> list[np.ndarray]:
    return [v.numpy() for v in model.trainable_variables]


def floats(model) -> list[np.ndarray]:
    """Weights and BatchNorm statistics."""
    return [v.numpy() for v in model.variables if v.dtype == tf.float32]


def tape_reference(model, optimizer, loss_fn, samples, *, epochs=EPOCHS, batch_size=BATCH, micro_batches=3, seed=SEED):
    """The plain single-process tf_keras loop: one GradientTape over each global batch of the plan."""
    plan = Plan(len(samples), batch_size, micro_batches, seed)
    for epoch in range(epochs):
        perm = epoch_permutation(seed, epoch, len(samples))
        for step in range(plan.steps_per_epoch):
            idx = np.concatenate(
                [plan.micro_batch_indices(epoch, step, j, perm) for j in range(plan.num_micro_batches(epoch, step))]
            )
            x, y = collate_numpy([samples[int(i)] for i in idx])
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(loss_fn(y, model(x, training=True)))
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return model


def sgd():
    return tf_keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)


@pytest.fixture(scope="module")
def sgd_reference():
    return trainable(tape_reference(mlp(), sgd(), parts.LOSS, DATA))


# -- which Keras, without processes ---------------------------------------------------------------
@pytest.mark.tensorflow
def test_a_tf_keras_model_is_its_own_framework_and_takes_tf_keras_objects_only():
    from fabric_model.frameworks import framework_name, framework_named

    model = mlp()
    assert framework_name(model) == "tf_keras"
    framework = framework_named("tf_keras")
    framework.check_optimizer(model, tf_keras.optimizers.legacy.Adam(learning_rate=0.01))
    framework.check_optimizer(model, "adam")
    framework.check_loss("categorical_crossentropy")
    import keras

    with pytest.raises(TypeError) as info:  # Keras 3's optimizer cannot update Keras 2's variables
        framework.check_optimizer(model, keras.optimizers.Adam())
    message = str(info.value)
    assert "tf.keras.optimizers.legacy.Optimizer" in message and "keras.src.optimizers" in message, message
    assert "TF_USE_LEGACY_KERAS" in message
    with pytest.raises(ValueError, match=r"`optimizer`.*'adam'"):
        framework.check_optimizer(model, "adamm")


@pytest.mark.processes
def test_a_keras_3_job_does_not_import_tf_keras():
    """tf-keras is an optional extra: only a tf_keras model imports it."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {REPO!r})
        import numpy as np
        from fabric_model import quiet_tensorflow
        with quiet_tensorflow():
            import keras
        from fabric_model.frameworks import detect_framework
        from fabric_model.frameworks.keras.adapter import KerasAdapter
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dropout(0.1), keras.layers.Dense(2)])
        framework = detect_framework(model)
        framework.check_optimizer(model, "adam")
        adapter = KerasAdapter(model, "adam", "mse")
        adapter.check_rebuild((np.zeros((2, 4), "float32"), np.zeros((2, 2), "float32")))
        assert framework.name == "keras", framework.name
        assert "tf_keras" not in sys.modules, "tf_keras was imported"
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]


# -- the step's guarantees ------------------------------------------------------------------------
@pytest.mark.processes
@pytest.mark.parametrize(("workers", "batch"), [(1, 3 * BATCH), (2, BATCH), (3, BATCH)])
def test_same_weights_for_1_2_3_workers_as_a_gradient_tape_loop(workers, batch, sgd_reference, run_dir, tmp_path):
    """(1, 48): one worker, one micro-batch a step, which runs the whole step in one function."""
    model = mlp()
    recording = IndexRecordingDataset(DATA, str(tmp_path))
    metrics = [
        "accuracy",
        tf_keras.metrics.SparseCategoricalAccuracy(name="acc_obj"),
        tf_keras.metrics.sparse_top_k_categorical_accuracy,
    ]
    result = FabricModel(model, lambda: (recording, DATA[:40]), parts.LOSS, sgd(), metrics=metrics).train(
        EPOCHS, batch, workers, effective_batch_size=3 * BATCH, seed=SEED, run_dir=run_dir
    )
    assert max_rel_diff(trainable(model), sgd_reference) < 1e-5
    assert len(result.replica_digests) == workers and len(set(result.replica_digests.values())) == 1
    assert_each_sample_once_per_epoch(run_dir, tmp_path, Plan(len(DATA), batch, 3 * BATCH // batch, SEED), EPOCHS)
    last = result.history[-1]
    assert last["accuracy"] == pytest.approx(last["acc_obj"], abs=1e-6)
    assert 0.0 < last["accuracy"] <= last["sparse_top_k_categorical_accuracy"] <= 1.0
    assert json.loads((run_dir / "run.json").read_text())["framework"] == "tf_keras"
    reloaded = tf_keras.saving.load_model(run_dir / "model" / "model.keras")
    assert max_rel_diff(trainable(reloaded), trainable(model)) == 0.0


def legacy_optimizer_values(optimizer, model) -> list[np.ndarray]:
    """The iteration count and each slot, by variable (names differ between two models of one process)."""
    slots = [
        optimizer.get_slot(v, name).numpy() for name in optimizer.get_slot_names() for v in model.trainable_variables
    ]
    return [np.array(float(optimizer.iterations.numpy())), *slots]


OPTIMIZERS = {
    # tf_keras' new optimizers drop `lr` with a warning and keep their default (tf_keras' own behaviour).
    "Adam(lr=)": lambda: tf_keras.optimizers.Adam(lr=0.01),
    "legacy.Adam(lr=)": lambda: tf_keras.optimizers.legacy.Adam(lr=0.01),
    "legacy.RMSprop": lambda: tf_keras.optimizers.legacy.RMSprop(learning_rate=0.01, momentum=0.5),
}


@pytest.mark.processes
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_keras_2_optimizers_and_one_hot_labels(name, run_dir):
    """A softmax model, one-hot labels and "categorical_crossentropy" by name, as Keras 2 scripts have it;
    2 workers end where the GradientTape loop with the same optimizer ends, and the caller's optimizer
    holds the trained state (the legacy ones' slots included)."""
    reference, reference_optimizer = mlp(softmax=True), OPTIMIZERS[name]()
    tape_reference(reference, reference_optimizer, tf_keras.losses.get("categorical_crossentropy"), ONE_HOT)
    model, optimizer = mlp(softmax=True), OPTIMIZERS[name]()
    fm = FabricModel(model, lambda: (ONE_HOT, ONE_HOT[:40]), "categorical_crossentropy", optimizer)
    result = fm.train(EPOCHS, BATCH, 2, effective_batch_size=3 * BATCH, seed=SEED, run_dir=run_dir)
    assert max_rel_diff(trainable(model), trainable(reference)) < 1e-5
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    assert 0.0 < result.history[-1]["accuracy"] <= 1.0  # categorical accuracy, picked for one-hot labels
    assert int(optimizer.iterations) == int(reference_optimizer.iterations) == EPOCHS * -(-len(DATA) // (3 * BATCH))
    if name.startswith("legacy"):
        theirs = legacy_optimizer_values(reference_optimizer, reference)
        assert max_rel_diff(legacy_optimizer_values(optimizer, model), theirs) < 1e-4
    # The model comes back compiled with what was given: tf_keras' evaluate agrees with the run's validation.
    x, y = collate_numpy(ONE_HOT[:40])
    keras_result = model.evaluate(x, y, verbose=0, return_dict=True)
    assert keras_result["loss"] == pytest.approx(result.test_history[-1]["loss"], rel=1e-5)
    assert fm.evaluate()["loss"] == pytest.approx(keras_result["loss"], rel=1e-5)
    assert fm.predict(ONE_HOT[:40]).shape == (40, 3)


@pytest.mark.processes
@pytest.mark.parametrize("family", ["legacy", "current"])
def test_a_learning_rate_schedule_and_gradient_clip_norm(family, run_dir):
    """A LearningRateSchedule (it reads the iteration count, which travels) and gradient_clip_norm= (the
    rebuilt optimizer's global_clipnorm, on the reduced step gradient), for both optimizer families."""
    cls = tf_keras.optimizers.legacy.SGD if family == "legacy" else tf_keras.optimizers.SGD

    def optimizer(**kwargs):
        schedule = tf_keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=4, decay_rate=0.5)
        return cls(learning_rate=schedule, momentum=0.9, **kwargs)

    reference = tape_reference(mlp(), optimizer(global_clipnorm=0.05), parts.LOSS, DATA)
    model, ours = mlp(), optimizer()
    FabricModel(model, lambda: (DATA, None), parts.LOSS, ours, gradient_clip_norm=0.05).train(
        EPOCHS, BATCH, 2, effective_batch_size=3 * BATCH, seed=SEED, run_dir=run_dir
    )
    assert max_rel_diff(trainable(model), trainable(reference)) < 1e-5
    assert ours.global_clipnorm is None  # the user's optimizer is left as given


def keras_train(run_dir, marker_dir, faults=(), joins=(), workers=3, epochs=EPOCHS, resume=False):
    """mlp(dropout, BatchNorm) with a legacy SGD with momentum: its slots travel with a joiner's pull."""
    model = mlp(dropout=0.3, batchnorm=True)
    injector = FaultInjector(list(faults), marker_dir)
    starter = WorkerStarter(run_dir, list(joins))
    optimizer = tf_keras.optimizers.legacy.SGD(learning_rate=0.1, momentum=0.9)
    try:
        result = FabricModel(
            model,
            lambda: (DATA, None),
            parts.LOSS,
            optimizer,
            worker_logger_callback=injector,
            driver_logger_callback=starter,
        ).train(epochs, BATCH, workers, effective_batch_size=3 * BATCH, seed=SEED, run_dir=run_dir, resume=resume)
    finally:
        starter.close()
    return model, result


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    """mlp(dropout, BatchNorm) trained by FabricModel on 3 workers without faults."""
    tmp = tmp_path_factory.mktemp("undisturbed")
    model, _ = keras_train(tmp / "run", tmp / "markers")
    return floats(model)


@pytest.mark.processes
def test_kill_and_join_keep_the_result(run_dir, tmp_path, monkeypatch, undisturbed):
    """Dropout and BatchNorm on: a kill re-divides micro-batches, a join pulls weights, the legacy
    optimizer's momentum and BatchNorm statistics, and the result does not change (so dropout draws
    from the micro-batch's seed, not from the worker's TensorFlow random state)."""
    monkeypatch.setenv("EDT_REPLACE_WORKERS", "0")
    model, result = keras_train(run_dir, tmp_path, [Kill(1, 3), HoldForJoin(6), Kill(2, 11, "after_step")], joins=[6])
    assert max_rel_diff(floats(model), undisturbed) < 1e-5
    assert len(set(result.replica_digests.values())) == 1
    plan = Plan(len(DATA), BATCH, 3, SEED)
    train_records = records(run_dir, "train")
    assert sorted((r["epoch"], r["step"]) for r in train_records) == [
        (e, s) for e in range(EPOCHS) for s in range(plan.steps_per_epoch)
    ]
    sizes = [g["workers"] for g in records(run_dir, "generation")]
    assert sizes[0] == 3 and 2 in sizes and sizes.count(3) >= 2, sizes
    assert any(g["source_rank"] >= 0 for g in records(run_dir, "generation"))  # the newcomer pulled state


@pytest.mark.processes
def test_a_resumed_run_ends_with_the_undisturbed_weights(run_dir, tmp_path, undisturbed):
    """One epoch on 3 workers, then a new job resumes from its checkpoint on 2 to the second epoch:
    the checkpoint carries BatchNorm statistics and the legacy optimizer's momentum."""
    keras_train(run_dir, tmp_path, epochs=1)
    assert list((run_dir / "checkpoints").glob("ckpt-unit-*.pt"))
    model, _ = keras_train(run_dir, tmp_path, workers=2, resume=True)
    assert records(run_dir, "resume")
    assert max_rel_diff(floats(model), undisturbed) < 1e-5


# -- deterministic=True ---------------------------------------------------------------------------
def deterministic_train(run_dir, workers, faults=(), marker_dir=None):
    model = mlp(dropout=0.2, batchnorm=True)
    optimizer = tf_keras.optimizers.legacy.Adam(learning_rate=0.01)
    injector = FaultInjector(list(faults), marker_dir) if faults else None
    FabricModel(model, lambda: (DATA[:144], None), parts.LOSS, optimizer, worker_logger_callback=injector).train(
        6, BATCH, workers, effective_batch_size=3 * BATCH, seed=3, run_dir=run_dir, deterministic=True
    )
    return [v.numpy() for v in model.variables] + legacy_optimizer_values(optimizer, model)


@pytest.mark.processes
def test_deterministic_mode_is_bitwise_equal_after_a_kill_and_a_replacement(run_dir, tmp_path):
    """1 worker, and 3 workers, then 2 after the kill, then 3 again: the same bits (weights, BatchNorm
    statistics, the legacy Adam's iteration count and moments)."""
    reference = deterministic_train(tmp_path / "reference", 1)
    state = deterministic_train(run_dir, 3, [Kill(1, 5), HoldForJoin(9)], tmp_path)
    differ = [i for i, (a, b) in enumerate(zip(state, reference)) if not np.array_equal(a, b)]
    assert len(state) == len(reference) and not differ, f"not bitwise equal: variables {differ}"
    sizes = [g["workers"] for g in records(run_dir, "generation")]
    assert sizes[:2] == [3, 2] and sizes[-1] == 3, sizes


# -- what Keras 2 scripts bring -------------------------------------------------------------------
@pytest.mark.processes
def test_a_custom_step_and_a_subclassed_model(run_dir):
    """A subclassed tf_keras model with a custom layer (named in keras_custom_objects) and a custom step
    ending in optimizer.apply_gradients, as on one device: 2 workers end where the loop ends."""

    def build():
        tf_keras.utils.set_random_seed(4)
        return parts.Subclassed()

    def step(model, data, eva, train_set, fn_args):
        x, y = data
        with tf.GradientTape() as tape:
            pred = model(x, training=True)
            loss = tf.reduce_mean(parts.LOSS(y, pred))
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return eva(y, pred), loss

    reference = build()
    tape_reference(reference, sgd(), parts.LOSS, DATA)
    model = build()
    result = FabricModel(
        model,
        lambda: (DATA, None),
        parts.LOSS,
        sgd(),
        fn_step_train=step,
        keras_custom_objects={"Subclassed": parts.Subclassed, "Scale": parts.Scale},
    ).train(EPOCHS, BATCH, 2, effective_batch_size=3 * BATCH, seed=SEED, run_dir=run_dir)
    assert max_rel_diff(trainable(model), trainable(reference)) < 1e-5
    assert result.history[-1]["loss"] < result.history[0]["loss"]


@pytest.mark.processes
@pytest.mark.parametrize("name", ["OwnStep", "OwnLoss"])
def test_a_model_s_own_train_step_or_compute_loss(name, run_dir):
    cls = getattr(parts, name)

    def build():
        tf_keras.utils.set_random_seed(5)
        inputs = tf_keras.Input((12,))
        hidden = tf_keras.layers.Dense(16, activation="relu")(inputs)
        return cls(inputs, tf_keras.layers.Dense(3)(hidden))

    reference = build()
    scale = 2.0 if name == "OwnLoss" else 1.0
    tape_reference(reference, sgd(), lambda y, out: scale * parts.LOSS(y, out), DATA)
    model = build()
    metrics = ["accuracy"] if name == "OwnStep" else None
    result = FabricModel(
        model, lambda: (DATA, None), parts.LOSS, sgd(), metrics=metrics, keras_custom_objects={cls.__name__: cls}
    ).train(EPOCHS, BATCH, 2, effective_batch_size=3 * BATCH, seed=SEED, run_dir=run_dir)
    assert max_rel_diff(trainable(model), trainable(reference)) < 1e-5
    assert result.history[-1]["loss"] < result.history[0]["loss"]


# The WMLA script shape: TF_USE_LEGACY_KERAS=1 before TensorFlow, tf.keras everywhere, an
# ImageDataGenerator's flow() as the datasets, one-hot labels, Adam(lr=...). In a process of its own.
WMLA_SCRIPT = textwrap.dedent("""
    import os
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import sys
    sys.path.insert(0, {repo!r})
    import numpy as np
    from fabric_model import FabricModel, quiet_tensorflow
    with quiet_tensorflow():
        import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(160, 8, 8, 1)).astype("float32")
    labels = (x[:, :4].mean(axis=(1, 2, 3)) > 0).astype(int) + (x[:, 4:].mean(axis=(1, 2, 3)) > 0).astype(int)
    y = tf.keras.utils.to_categorical(labels, 3)

    def get_dataset():
        generator = tf.keras.preprocessing.image.ImageDataGenerator()
        return generator.flow(x, y, batch_size=16), generator.flow(x[:48], y[:48], batch_size=16)

    tf.keras.utils.set_random_seed(0)
    model = tf.keras.models.Sequential([
        tf.keras.layers.Conv2D(8, 3, activation="relu", input_shape=(8, 8, 1)),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(3, activation="softmax"),
    ])
    assert type(model).__module__.startswith("tf_keras"), type(model).__module__
    result = FabricModel(model, get_dataset, loss_function="categorical_crossentropy",
                         optimizer=tf.keras.optimizers.Adam(lr=0.01), save_to_onnx={onnx}).train(
        {epochs}, 16, {workers}, effective_batch_size=32, seed=5, run_dir={run_dir!r})
    np.savez({out!r}, *[v.numpy() for v in model.variables])
    with open({out!r} + ".json", "w") as f:
        f.write(__import__("json").dumps({{"history": result.history, "onnx": result.onnx_max_diff}}))
""")


def run_wmla_script(tmp_path, name, workers, epochs=3, onnx=False):
    out, run_dir = tmp_path / f"{name}.npz", tmp_path / name
    script = tmp_path / f"{name}.py"
    script.write_text(
        WMLA_SCRIPT.format(repo=REPO, workers=workers, epochs=epochs, run_dir=str(run_dir), out=str(out), onnx=onnx)
    )
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    with np.load(out) as arrays:
        weights = [arrays[k] for k in sorted(arrays.files, key=lambda k: int(k.split("_")[1]))]
    return weights, json.loads(Path(f"{out}.json").read_text()), run_dir


@pytest.mark.processes
def test_an_ibm_keras_2_script_with_image_data_generator_batches(tmp_path):
    """The script as IBM WMLA users write it for Keras 2: the same weights on 1 worker and on 2 (each
    flow() batch one micro-batch, its shuffle replaced by the plan's), the loss falls, and the model
    comes back as an ONNX file checked against tf_keras."""
    one, first, _ = run_wmla_script(tmp_path, "one", 1)
    two, second, run_dir = run_wmla_script(tmp_path, "two", 2, onnx=True)
    assert max_rel_diff(two, one) < 1e-5
    losses = [h["loss"] for h in second["history"]]
    assert losses[-1] < losses[0], losses
    assert second["onnx"] is not None and second["onnx"] < 1e-4
    assert (run_dir / "model" / "model.onnx").is_file() and (run_dir / "model" / "model.keras").is_file()
    assert json.loads((run_dir / "run.json").read_text())["framework"] == "tf_keras"


@pytest.mark.processes
def test_fabric_model_writes_a_checked_onnx_file_for_tf_keras(run_dir):
    need("onnxruntime")
    need("tf2onnx")
    from fabric_model.frameworks.export import onnx_max_diff

    rng = np.random.default_rng(0)
    images = [(rng.normal(size=(8, 8, 1)).astype("float32"), i % 3) for i in range(48)]
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential(
        [
            tf_keras.layers.Conv2D(4, 3, padding="same", activation="relu", input_shape=(8, 8, 1)),
            tf_keras.layers.BatchNormalization(),
            tf_keras.layers.MaxPooling2D(),
            tf_keras.layers.Dropout(0.2),
            tf_keras.layers.Flatten(),
            tf_keras.layers.Dense(3),
        ]
    )
    result = FabricModel(model, lambda: (images, None), parts.LOSS, "adam", save_to_onnx=True).train(
        1, 8, 2, seed=3, run_dir=run_dir
    )
    assert result.onnx_max_diff is not None and result.onnx_max_diff < 1e-4
    batch = rng.normal(size=(5, 8, 8, 1)).astype("float32")
    assert onnx_max_diff(run_dir / "model" / "model.onnx", "tf_keras", model, [batch]) < 1e-4


# -- augmentation (step/sample_seeds.py) -----------------------------------------------------------
IMAGES = np.random.default_rng(3).random((96, 8, 8, 1)).astype("float32")
IMAGE_LABELS = np.eye(2, dtype=np.float32)[(IMAGES[:, :, :4].mean(axis=(1, 2, 3)) > 0.5).astype(int)]


def augmented_flow():
    """An ImageDataGenerator that flips and shifts at random (NumPy's global generator), shuffled."""
    generator = tf_keras.preprocessing.image.ImageDataGenerator(
        horizontal_flip=True, width_shift_range=0.2, height_shift_range=0.2
    )
    return generator.flow(IMAGES, IMAGE_LABELS, batch_size=8, shuffle=True), None


def augmented_train(run_dir, workers):
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential(
        [
            tf_keras.layers.Conv2D(4, 3, activation="relu", input_shape=(8, 8, 1)),
            tf_keras.layers.Flatten(),
            tf_keras.layers.Dropout(0.2),
            tf_keras.layers.Dense(2, activation="softmax"),
        ]
    )
    FabricModel(model, augmented_flow, "categorical_crossentropy", tf_keras.optimizers.legacy.SGD(0.05)).train(
        2, 8, workers, effective_batch_size=24, seed=4, run_dir=run_dir, deterministic=True, num_dataloader_threads=2
    )
    return [v.numpy() for v in model.variables]


@pytest.mark.processes
def test_an_augmenting_image_data_generator_trains_bitwise_alike_on_1_and_2_workers(tmp_path):
    """Each batch of the flow is read after its seeds are set: its flips and shifts are the same
    whichever worker reads it, on whichever reader thread."""
    one, two = augmented_train(tmp_path / "one", 1), augmented_train(tmp_path / "two", 2)
    differ = [i for i, (a, b) in enumerate(zip(one, two)) if not np.array_equal(a, b)]
    assert not differ, f"not bitwise equal: variables {differ}"


@pytest.mark.tensorflow
def test_an_image_data_generator_flow_transforms_each_sample_by_its_own_seeds():
    """In-process: a sample's flips and shifts are the same read again after other draws, and
    the same in a batch of another size (each sample transformed after its own seeds are set)."""
    from fabric_model.step.data import EpochShuffledBatches
    from fabric_model.step.sample_seeds import SampleSeeds, global_generators

    generator = tf_keras.preprocessing.image.ImageDataGenerator(horizontal_flip=True, width_shift_range=0.3)
    labels = np.arange(len(IMAGES))

    def batches(size: int) -> EpochShuffledBatches:
        flow = generator.flow(IMAGES, labels, batch_size=size, shuffle=True)
        return EpochShuffledBatches(flow, 3, SampleSeeds(3, global_generators()))

    fours, eights = batches(4), batches(8)
    x, y = fours[1]
    np.random.rand(100)
    again_x, again_y = fours[1]
    assert np.array_equal(x, again_x) and np.array_equal(y, again_y)
    x4, y4 = fours[0]
    x8, y8 = eights[0]  # the same epoch order: its first 8 samples hold the first 4
    for k, label in enumerate(y4):
        assert np.array_equal(x4[k], x8[list(y8).index(label)])
    assert not np.array_equal(x4, IMAGES[fours.order(0)[:4]])  # it did transform them
