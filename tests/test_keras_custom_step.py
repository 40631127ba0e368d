"""A Keras custom step's pieces in one process (docs/keras.md, "Custom steps"): the gradients taken
from the optimizer's apply, the user's code travelling with references to the worker's model and
optimizer, and the adapter's step with ``fn_step_train`` or a ``compute_loss`` override."""

from __future__ import annotations

import cloudpickle
import numpy as np
import pytest

from fabric_model.frameworks.keras.adapter import KerasAdapter
from fabric_model.frameworks.keras.capture import GradientCapture, capturing
from fabric_model.frameworks.keras.user_step import (
    UserCode,
    gradient_list,
    pack_user_code,
    unpack_user_code,
)

from .helpers import Lazily

# TensorFlow at a test's first use, not at collection; the loss and the Model subclasses with it.
keras, tf = Lazily("keras"), Lazily("tensorflow")
parts = Lazily(".keras_custom_step_parts", __package__)

pytestmark = pytest.mark.tensorflow


def mlp() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])


# -- the capture --------------------------------------------------------------------------------
def test_gradients_land_by_variable_position():
    a, b, c = tf.Variable(1.0), tf.Variable(2.0), tf.Variable(3.0)
    capture = GradientCapture([a, b, c])
    capture.add([tf.constant(0.5), None], [c, a], "apply")
    capture.add([tf.constant(0.25)], [b], "apply")  # another variable in another call: fine
    assert capture.applied and capture.gradients[0] is None  # a None gradient: the variable got none
    assert [float(g) for g in capture.gradients[1:]] == [0.25, 0.5]
    with pytest.raises(ValueError, match="second gradient"):
        capture.add([tf.constant(1.0)], [c], "apply")
    with pytest.raises(ValueError, match="not one of the model's trainable variables"):
        capture.add([tf.constant(1.0)], [tf.Variable(0.0)], "apply")
    with pytest.raises(ValueError, match="2 gradient"):
        capture.add([tf.constant(1.0), tf.constant(1.0)], None, "apply")  # None: all of them, in order


def test_returned_gradients_may_be_a_list_or_pairs():
    v = tf.Variable(1.0)
    assert gradient_list([1.0, None]) == ([1.0, None], None)
    assert gradient_list(zip([2.0], [v])) == ([2.0], [v])


def test_capturing_keeps_the_optimizer_s_hands_off_and_refuses_another_optimizer():
    model, optimizer = mlp(), keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
    x, y = np.ones((4, 6), np.float32), np.array([0, 1, 2, 0])
    before = [v.numpy() for v in model.trainable_variables]

    @tf.function
    def step() -> list:
        with capturing(optimizer, model.trainable_variables, "fn_step_train") as capture:
            with tf.GradientTape() as tape:
                loss = parts.LOSS(y, model(x, training=True))
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return capture.gradients

    grads = step()
    assert all(np.array_equal(v.numpy(), b) for v, b in zip(model.trainable_variables, before))
    assert len(grads) == len(before) and int(optimizer.iterations) == 0
    other = keras.optimizers.Adam()
    with pytest.raises(RuntimeError, match="optimizer other than the one given"):
        with capturing(optimizer, model.trainable_variables, "fn_step_train"):
            other.apply(grads, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)  # both restored once the block ends
    other.apply(grads, model.trainable_variables)
    assert int(optimizer.iterations) == 1 and "apply" not in vars(optimizer)


def test_the_user_s_references_to_model_and_optimizer_resolve_to_the_worker_s():
    model, optimizer = mlp(), keras.optimizers.SGD(0.1)

    def step(*args):
        return model, optimizer

    code = UserCode(step, None, {"optimizer": optimizer})
    data = pack_user_code(code, {"model": model, "optimizer": optimizer})
    theirs = unpack_user_code(data, {"model": "worker's model", "optimizer": "worker's optimizer"})
    assert theirs.step_fn() == ("worker's model", "worker's optimizer")
    assert theirs.fn_args == {"optimizer": "worker's optimizer"}


# -- the adapter's step -------------------------------------------------------------------------
class OneOfTwo:
    """A collective of two whose peer adds nothing: the adapter takes its reducing path."""

    world_size, rank = 2, 0

    def all_reduce_start(self, tensor):
        return None

    def wait(self, work) -> None:
        pass


RNG = np.random.default_rng(0)
X, Y = RNG.normal(size=(16, 6)).astype(np.float32), RNG.integers(0, 3, 16)


def shipped(model: keras.Model, **kwargs) -> KerasAdapter:
    """The adapter as a worker gets it, set up (its loss LOSS unless ``loss`` is given)."""
    loss = kwargs.pop("loss", parts.LOSS)
    adapter = KerasAdapter(model, keras.optimizers.SGD(0.1, momentum=0.9), loss, None, **kwargs)
    adapter.check_rebuild((X[:2], Y[:2]))
    worker = cloudpickle.loads(cloudpickle.dumps(adapter))
    worker.setup("cpu", 1)
    return worker


def train_two_steps(adapter: KerasAdapter) -> list[list[float]]:
    """Two steps of two micro-batches of 4."""
    stats = []
    for step in range(2):
        adapter.begin_step(OneOfTwo())
        for j in range(2):
            rows = slice(8 * step + 4 * j, 8 * step + 4 * j + 4)
            adapter.train_micro_batch((X[rows], Y[rows]), 4, 8, seed=step * 10 + j, last=j == 1)
        adapter.all_reduce(OneOfTwo())
        stats.append(adapter.finish_step().stats)
    return stats


def one_device(model: keras.Model, loss_of=None) -> list[np.ndarray]:
    """The plain loop over the same global batches of 8."""
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    for step in range(2):
        x, y = X[8 * step : 8 * step + 8], Y[8 * step : 8 * step + 8]
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = loss_of(model, x, y, out) if loss_of else parts.LOSS(y, out)
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    return [v.numpy() for v in model.trainable_variables]


def close(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b))


def returning_step(model, data, eva, train_set, fn_args):
    x, y = data
    with tf.GradientTape() as tape:
        pred = model(x, training=True)
        loss = parts.LOSS(y, pred)
    return eva(y, pred), loss, tape.gradient(loss, model.trainable_variables)


def test_a_step_that_returns_its_gradients_trains_as_the_plain_loop():
    adapter = shipped(mlp(), user_code=UserCode(returning_step))
    assert adapter.stat_names == ["loss", "accuracy"]
    stats = train_two_steps(adapter)
    assert all(len(s) == 3 and s[-1] == 8.0 and 0.0 <= s[1] <= 8.0 for s in stats)  # loss, metric sums, count
    assert close([v.numpy() for v in adapter.model.trainable_variables], one_device(mlp()))


def lazy_step(model, data, eva, train_set, fn_args):
    x, y = data
    return 0.0, parts.LOSS(y, model(x, training=True))


def applying_and_returning_step(model, data, eva, train_set, fn_args):
    metric, loss, grads = returning_step(model, data, eva, train_set, fn_args)
    model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return metric, loss, grads


@pytest.mark.parametrize(
    ("step", "message"),
    [(lazy_step, "neither applied gradients nor returned them"), (applying_and_returning_step, "both applied")],
)
def test_a_step_must_hand_over_its_gradients_once(step, message):
    adapter = shipped(mlp(), user_code=UserCode(step))
    adapter.begin_step(OneOfTwo())
    with pytest.raises(ValueError, match=message):
        adapter.train_micro_batch((X[:4], Y[:4]), 4, 8, seed=0)


def test_a_compute_loss_override_is_what_the_step_differentiates():
    keras.utils.set_random_seed(0)
    model = parts.Doubled([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    adapter = shipped(model, custom_objects={"Doubled": parts.Doubled})
    assert adapter.model_loss and adapter.stat_names == ["loss"]  # no default accuracy with the model's own loss
    stats = train_two_steps(adapter)
    keras.utils.set_random_seed(0)
    reference = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    expected = one_device(reference, lambda m, x, y, out: 2.0 * parts.LOSS(y, out))
    assert close([v.numpy() for v in adapter.model.trainable_variables], expected)
    assert stats[0][0] / 8 > 2.0  # the loss shown is the doubled one (a 3-class loss starts near ln 3)


# -- loss_function=None: the model's own loss (parts.OwnTrainStep's train_step, parts.OwnLoss's compute_loss)
def layers() -> list:
    keras.utils.set_random_seed(0)  # mlp()'s weights
    return [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]


@pytest.mark.parametrize(
    ("make", "kwargs", "loss_of", "stat_names"),
    [
        (
            lambda: parts.OwnTrainStep(layers()),
            lambda: {"custom_objects": {"OwnTrainStep": parts.OwnTrainStep}},
            None,
            ["loss"],
        ),
        (mlp, lambda: {"user_code": UserCode(returning_step)}, None, ["loss", "accuracy"]),
        (
            lambda: parts.OwnLoss(layers()),
            lambda: {"custom_objects": {"OwnLoss": parts.OwnLoss}},
            lambda m, x, y, out: 2.0 * parts.LOSS(y, out),
            ["loss"],
        ),
    ],
    ids=["train_step", "fn_step_train", "compute_loss"],
)
def test_loss_function_none_is_taken_from_a_model_that_computes_its_own(make, kwargs, loss_of, stat_names):
    """No loss given: the step is the model's (or the user's), and validation shows the model's
    compute_loss where it has its own, else NaN (the metrics as usual)."""
    adapter = shipped(make(), loss=None, **kwargs())
    assert adapter.loss_function is None and adapter.stat_names == stat_names
    stats = train_two_steps(adapter)
    assert all(np.isfinite(s).all() and s[-1] == 8.0 for s in stats)
    assert close([v.numpy() for v in adapter.model.trainable_variables], one_device(mlp(), loss_of))
    validation = adapter._evaluate_batch((X[:4], Y[:4])).tolist()
    assert len(validation) == len(stat_names) + 1 and validation[-1] == 4.0
    if loss_of is None:
        assert np.isnan(validation[0]) and np.isfinite(validation[1:]).all()
    else:
        out = adapter.model(X[:4], training=False)
        assert np.isclose(validation[0] / 4, float(loss_of(adapter.model, X[:4], Y[:4], out)), rtol=1e-5)


def test_loss_function_none_is_refused_for_a_model_without_its_own_loss():
    """``FabricModel(...)`` refuses it, naming the argument, what came and what is accepted; a
    model that overrides ``train_step`` or ``compute_loss``, or a custom step, is taken without."""
    from fabric_model import FabricModel

    def data():
        return (X, Y), None

    with pytest.raises(TypeError) as info:
        FabricModel(mlp(), data, None, keras.optimizers.SGD(0.1))
    message = str(info.value)
    for part in ("`loss_function`", "loss_function=None", "Sequential", "compute_loss", "train_step", "fn_step_train"):
        assert part in message, message
    assert "keras.losses.Loss" in message and "loss(y_true, y_pred)" in message, message
    FabricModel(parts.OwnTrainStep(layers()), data, None, keras.optimizers.SGD(0.1))
    FabricModel(parts.OwnLoss(layers()), data, None, keras.optimizers.SGD(0.1))
    FabricModel(mlp(), data, None, keras.optimizers.SGD(0.1), fn_step_train=returning_step)
    with pytest.raises(TypeError, match="or None, for a model that computes its own loss"):
        FabricModel(mlp(), data, 3, keras.optimizers.SGD(0.1))
