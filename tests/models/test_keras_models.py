"""Keras models trained the ways Keras users write them (docs/keras.md, "Custom steps"): their own
GradientTape step, a real application model, named inputs with several outputs and losses, and a
Model subclass with its own train_step and compute_loss. Each trains on 2 workers and ends where
the single-device loop over the same global batches ends."""

from __future__ import annotations

import numpy as np
import pytest

from fabric_model import FabricModel
from fabric_model.frameworks.keras.batches import collate_numpy
from fabric_model.step.plan import Plan, epoch_permutation

from ..helpers import Lazily

# TensorFlow at a test's first use, not at collection; the losses and the Model subclasses with it.
keras, tf = Lazily("keras"), Lazily("tensorflow")
parts = Lazily(".keras_models_parts", __package__)

pytestmark = pytest.mark.processes

SEED, BATCH, MICRO = 5, 8, 2  # 2 micro-batches of 8 a step


def global_batches(samples: list, epochs: int, seed: int = SEED):
    """The run's global batches in order, collated: what one device would see (step/plan.py's plan)."""
    plan = Plan(len(samples), BATCH, MICRO, seed)
    for epoch in range(epochs):
        perm = epoch_permutation(seed, epoch, len(samples))
        for step in range(plan.steps_per_epoch):
            parts = [plan.micro_batch_indices(epoch, step, j, perm) for j in range(plan.num_micro_batches(epoch, step))]
            yield collate_numpy([samples[int(i)] for i in np.concatenate(parts)])


def max_rel_diff(a: list, b: list) -> float:
    assert len(a) == len(b)
    return max(float(np.abs(x - y).max() / (np.abs(y).max() or 1.0)) for x, y in zip(a, b))


def weights(model: keras.Model) -> list[np.ndarray]:
    return [v.numpy() for v in model.trainable_variables]


def tape_step(optimizer: keras.optimizers.Optimizer):
    """A custom step as written for one device: the optimizer named from the enclosing scope."""

    def train_step(model, data, eva, train_set, fn_args):
        x, y = data
        with tf.GradientTape() as tape:
            pred = model(x, training=True)
            loss = fn_args["loss"](y, pred)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return eva(y, pred), loss

    return train_step


def evaluate_step(model, test_iter, fn_args):
    losses, count = 0.0, 0
    for x, y in test_iter:
        losses, count = losses + float(fn_args["loss"](y, model(x, training=False))) * len(y), count + len(y)
    return 0.5, losses / count  # (metric, loss), as torch's fn_test


# -- (a) a custom GradientTape step ------------------------------------------------------------
def classification(n: int = 96, seed: int = 0) -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 10)).astype(np.float32)
    y = (x @ rng.normal(size=(10, 3))).argmax(1)
    return [(x[i], int(y[i])) for i in range(n)]


def mlp() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((10,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])


def test_a_custom_gradient_tape_step_trains_as_on_one_device(run_dir):
    """The step applies with the script's optimizer; deterministic on 2 workers it ends where the
    single-device loop over the same global batches ends; fn_test and fn_args reach the worker."""
    data, epochs = classification(), 3
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model, optimizer = mlp(), keras.optimizers.SGD(0.1, momentum=0.9)
    result = FabricModel(
        model,
        lambda: (data, data[:20]),
        loss,
        optimizer,
        fn_step_train=tape_step(optimizer),
        fn_test=evaluate_step,
        fn_args={"loss": loss},
    ).train(epochs, BATCH, 2, effective_batch_size=MICRO * BATCH, seed=SEED, run_dir=run_dir, deterministic=True)
    history = result.history
    assert history[-1]["loss"] < 0.7 * history[0]["loss"]
    assert 0.0 <= history[-1]["accuracy"] <= 1.0  # eva: the accuracy for these shapes
    validation = result.test_history[-1]
    assert validation["accuracy"] == 0.5 and validation["loss"] < result.test_history[0]["loss"]
    assert len(set(result.replica_digests.values())) == 1

    reference, ref_optimizer = mlp(), keras.optimizers.SGD(0.1, momentum=0.9)
    one_device = tf.function(tape_step(ref_optimizer), reduce_retracing=True)
    for x, y in global_batches(data, epochs):
        one_device(reference, (x, y), lambda y, p: 0.0, None, {"loss": loss})
    assert max_rel_diff(weights(model), weights(reference)) < 1e-5


# -- (b) a real application model, deterministic -------------------------------------------------
def images(n: int = 32) -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng(1)
    x = rng.uniform(size=(n, 32, 32, 3)).astype(np.float32)
    return [(x[i], int(rng.integers(3))) for i in range(n)]


def train_mobilenet(run_dir, engines: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(the initial variables, the trained variables then the optimizer's)."""
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), classes=3, alpha=0.35)
    initial = [v.numpy() for v in model.variables]
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    loss = keras.losses.SparseCategoricalCrossentropy()
    data = images()
    FabricModel(
        model, lambda: (data, None), loss, optimizer, fn_step_train=tape_step(optimizer), fn_args={"loss": loss}
    ).train(2, BATCH, engines, effective_batch_size=MICRO * BATCH, seed=SEED, run_dir=run_dir, deterministic=True)
    return initial, [v.numpy() for v in model.variables] + [v.numpy() for v in optimizer.variables]


def test_mobilenet_v2_with_a_custom_step_is_bitwise_equal_on_1_and_2_workers(tmp_path):
    """Weights, BatchNorm statistics and momenta: 1 worker running both micro-batches, or 2 one each."""
    initial, one = train_mobilenet(tmp_path / "one", 1)
    _, two = train_mobilenet(tmp_path / "two", 2)
    differ = [i for i, (a, b) in enumerate(zip(one, two)) if not np.array_equal(a, b)]
    assert len(one) == len(two) and not differ, f"not bitwise equal: variables {differ}"
    assert all(np.isfinite(a).all() for a in one)
    assert max_rel_diff(one[: len(initial)], initial) > 0  # it trained


# -- (c) named inputs, two outputs, a dict of losses -----------------------------------------------
def two_headed(cls: type | None = None) -> keras.Model:
    """A keras.Model, or one of class ``cls``."""
    cls = cls or keras.Model
    keras.utils.set_random_seed(2)
    a, b = keras.Input((6,), name="a"), keras.Input((4,), name="b")
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([a, b]))
    outputs = {"cls": keras.layers.Dense(3, name="cls")(hidden), "reg": keras.layers.Dense(1, name="reg")(hidden)}
    return cls({"a": a, "b": b}, outputs)


def named_samples(n: int = 64) -> list:
    return [({"a": x[:6], "b": x[6:]}, {"cls": y, "reg": x[:1].sum(keepdims=True)}) for x, y in classification(n)]


def test_named_inputs_two_outputs_and_a_dict_of_losses(run_dir):
    data, epochs = named_samples(), 3
    model = two_headed()
    result = FabricModel(model, lambda: (data, data[:16]), parts.LOSSES, keras.optimizers.SGD(0.05)).train(
        epochs, BATCH, 2, effective_batch_size=MICRO * BATCH, seed=SEED, run_dir=run_dir
    )
    assert set(result.history[-1]) == {"epoch", "loss"}  # no default accuracy for two outputs
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    assert result.test_history[-1]["loss"] < result.test_history[0]["loss"]
    assert len(set(result.replica_digests.values())) == 1

    reference, ref_optimizer = two_headed(), keras.optimizers.SGD(0.05)
    reference.compile(optimizer=ref_optimizer, loss=parts.LOSSES)
    train_on_compute_loss(reference, ref_optimizer, data, epochs)
    assert max_rel_diff(weights(model), weights(reference)) < 1e-5


def train_on_compute_loss(model: keras.Model, optimizer, data: list, epochs: int) -> None:
    """The loop its user writes: one device, the global batches in the plan's order, the gradient
    of ``model.compute_loss``."""

    @tf.function(reduce_retracing=True)
    def one_device(x, y):
        with tf.GradientTape() as tape:
            total = model.compute_loss(x, y, model(x, training=True))
        optimizer.apply(tape.gradient(total, model.trainable_variables), model.trainable_variables)

    for x, y in global_batches(data, epochs):
        one_device(x, y)


# -- (d) a Model subclass with its own train_step and compute_loss ----------------------------------
def test_a_model_subclass_s_train_step_and_compute_loss_are_honoured(run_dir):
    data, epochs = named_samples(), 3
    model = two_headed(parts.OwnStep)
    result = FabricModel(model, lambda: (data, None), parts.LOSSES, keras.optimizers.SGD(0.05)).train(
        epochs, BATCH, 2, effective_batch_size=MICRO * BATCH, seed=SEED, run_dir=run_dir
    )
    assert set(result.history[-1]) == {"epoch", "loss"}
    assert result.history[-1]["loss"] < result.history[0]["loss"]

    def one_device(cls: type) -> keras.Model:
        reference = two_headed(cls)
        reference.compile(optimizer=keras.optimizers.SGD(0.05), loss=parts.LOSSES)
        step = tf.function(reference.train_step, reduce_retracing=True)
        for batch in global_batches(data, epochs):
            step(batch)
        return reference

    assert max_rel_diff(weights(model), weights(one_device(parts.OwnStep))) < 1e-5
    assert max_rel_diff(weights(model), weights(one_device(keras.Model))) > 1e-3  # the overrides mattered


# -- (e) a Model subclass with a loss of its own, and no loss_function ------------------------------
def regression(n: int = 64) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(n, 10)).astype(np.float32)
    y = np.tanh(x @ rng.normal(size=(10, 1))).astype(np.float32)
    return [(x[i], y[i]) for i in range(n)]


def own_loss_model() -> keras.Model:
    keras.utils.set_random_seed(4)
    inputs = keras.Input((10,))
    return parts.OwnLoss(inputs, keras.layers.Dense(1)(keras.layers.Dense(16, activation="relu")(inputs)))


def train_own_loss(run_dir, engines: int, data: list, epochs: int):
    """(the model, its optimizer, the result) of a deterministic run with loss_function=None."""
    model, optimizer = own_loss_model(), keras.optimizers.SGD(0.05, momentum=0.9)
    result = FabricModel(model, lambda: (data, data[:16]), None, optimizer).train(
        epochs, BATCH, engines, effective_batch_size=MICRO * BATCH, seed=SEED, run_dir=run_dir, deterministic=True
    )
    return model, optimizer, result


def test_a_model_subclass_with_its_own_compute_loss_needs_no_loss_function(tmp_path):
    """Bitwise equal on 1 and 2 workers, where the loop its user writes ends; validation shows the
    model's compute_loss (training=False)."""
    data, epochs = regression(), 3
    one, one_optimizer, _ = train_own_loss(tmp_path / "one", 1, data, epochs)
    two, two_optimizer, result = train_own_loss(tmp_path / "two", 2, data, epochs)
    ones = [v.numpy() for v in one.variables + one_optimizer.variables]
    twos = [v.numpy() for v in two.variables + two_optimizer.variables]
    differ = [i for i, (a, b) in enumerate(zip(ones, twos)) if not np.array_equal(a, b)]
    assert len(ones) == len(twos) and not differ, f"not bitwise equal: variables {differ}"
    assert set(result.history[-1]) == {"epoch", "loss"}  # no default accuracy with the model's own loss
    assert result.history[-1]["loss"] < 0.7 * result.history[0]["loss"]

    x, y = collate_numpy(data[:16])
    expected = float(two.compute_loss(x, y, two(x, training=False), training=False))
    assert abs(result.test_history[-1]["loss"] - expected) <= 1e-5 * expected

    reference = own_loss_model()
    train_on_compute_loss(reference, keras.optimizers.SGD(0.05, momentum=0.9), data, epochs)
    assert max_rel_diff(weights(two), weights(reference)) < 1e-5
