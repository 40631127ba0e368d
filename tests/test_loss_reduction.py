"""A loss summed over the batch is refused on the first batch, in the caller (issue 31): workers weight
each micro-batch's loss by its samples, which equals the single-device loop only for a batch mean.
In-process: the framework's first-batch check is called as ``train()`` calls it, before any worker."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fabric_model.frameworks import detect_framework
from fabric_model.frameworks.base import UserObjects
from fabric_model.frameworks.torch.first_batch import check_summed_loss
from fabric_model.setup.checks import check_loss_reduction

from .helpers import MLP, Lazily, make_data

keras = Lazily("keras")  # at a test's first use: collecting this module imports no TensorFlow
found = importlib.util.find_spec("tensorflow") and importlib.util.find_spec("keras")
needs_keras = pytest.mark.skipif(not found, reason="needs TensorFlow and Keras")

DATA = make_data(16)


def first_batch_check(model, loss_function, data=DATA, optimizer=None) -> None:
    """What ``train()`` runs on the first batch before any worker starts (orchestrator/pipeline.ship)."""
    framework = detect_framework(model)
    optimizer = optimizer if optimizer is not None else torch.optim.SGD(model.parameters(), lr=0.1)
    adapter = framework.make_adapter(UserObjects(model, optimizer, loss_function, metrics=[]))
    framework.prepare_for_shipping(adapter, framework.first_batch(adapter, data))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLP()


@pytest.mark.parametrize(
    "loss_function",
    [
        nn.CrossEntropyLoss(reduction="sum"),
        lambda o, t: F.cross_entropy(o, t, reduction="sum"),
        nn.MSELoss(reduction="sum"),
    ],
    ids=["module", "functional", "mse"],
)
def test_a_summed_torch_loss_is_refused(loss_function):
    data = [(x, torch.randn(3)) for x, _ in DATA] if isinstance(loss_function, nn.MSELoss) else DATA
    with pytest.raises(ValueError, match="`loss_function`") as info:
        first_batch_check(mlp(), loss_function, data)
    message = str(info.value)
    assert 'reduction="mean"' in message and "Received:" in message and "sums over the batch" in message


def test_mean_default_and_regularised_losses_pass():
    model = mlp()

    def regularised(output, target):  # a mean plus a term that does not scale with the batch
        return F.cross_entropy(output, target) + 1e-3 * sum(p.pow(2).sum() for p in model.parameters())

    def heavily_regularised(output, target):  # neither a sum nor a mean: not refused either
        return F.cross_entropy(output, target, reduction="sum") + 10.0 * sum(p.pow(2).sum() for p in model.parameters())

    for loss_function in (
        F.cross_entropy,
        nn.CrossEntropyLoss(),
        nn.CrossEntropyLoss(reduction="mean"),
        nn.CrossEntropyLoss(weight=torch.tensor([10.0, 0.1, 1.0])),  # a class-weighted mean
        lambda o, t: F.cross_entropy(o, t, reduction="mean"),
        regularised,
        heavily_regularised,
    ):
        first_batch_check(model, loss_function)


class DropoutBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.drop, self.fc2 = (
            nn.Linear(12, 16),
            nn.BatchNorm1d(16),
            nn.Dropout(0.5),
            nn.Linear(16, 3),
        )

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.bn(self.fc1(x)))))


def test_dropout_and_batchnorm_pass_with_their_state_unchanged():
    torch.manual_seed(0)
    model = DropoutBatchNorm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    first_batch_check(model, F.cross_entropy)
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # running stats included
    assert torch.equal(rng, torch.get_rng_state())
    with pytest.raises(ValueError, match='reduction="mean"'):
        first_batch_check(model, nn.CrossEntropyLoss(reduction="sum"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_odd_batches_weight_halves_by_their_samples_and_one_sample_is_not_judged():
    torch.manual_seed(0)
    output, target = torch.randn(5, 3), torch.randint(0, 3, (5,))
    mean = F.cross_entropy(output, target)
    check_summed_loss(F.cross_entropy, output, target, mean.item())  # halves of 2 and 3 samples
    summed = F.cross_entropy(output, target, reduction="sum")
    with pytest.raises(ValueError, match="2 samples.*3 samples"):
        check_summed_loss(lambda o, t: F.cross_entropy(o, t, reduction="sum"), output, target, summed.item())
    one = lambda o, t: F.cross_entropy(o, t, reduction="sum")  # noqa: E731
    check_summed_loss(one, output[:1], target[:1], one(output[:1], target[:1]).item())  # a sum and a mean agree


def test_the_decision_is_clear_cut():
    check_loss_reduction(1.5, [(1.0, 1), (2.0, 1)], "fix")  # a mean
    check_loss_reduction(0.0, [(0.0, 1), (0.0, 1)], "fix")  # both fit: not refused
    check_loss_reduction(2.0, [(1.0, 1), (2.0, 1)], "fix")  # neither
    check_loss_reduction(1.98, [(2.0, 1), (0.0, 1)], "fix")  # a class-weighted mean, one half's loss 0
    with pytest.raises(ValueError):
        check_loss_reduction(-3.0, [(-1.0, 1), (-2.0, 1)], "fix")  # a sum of negative losses
    with pytest.raises(ValueError, match="Received: a loss that sums over the batch: 3.003 on .* HINT: fix"):
        check_loss_reduction(3.0 * (1 + 1e-3), [(1.0, 1), (2.0, 1)], "fix")  # a sum, float32-rounded


def test_float64_parameters_are_refused_without_offering_a_lower_precision():
    model = mlp().double()
    with pytest.raises(TypeError, match="float64 parameters are not supported") as info:
        first_batch_check(model, F.cross_entropy)
    assert "model.float()" in str(info.value) and "Received: parameters of dtype torch.float64" in str(info.value)


def test_a_sample_error_has_no_doubled_period():
    with pytest.raises(TypeError, match="first training sample: A batch must be") as info:
        first_batch_check(mlp(), F.cross_entropy, [(x,) for x, _ in DATA])
    assert ".." not in str(info.value) and "'target', 'label', 'labels', 'y'" in str(info.value)


@needs_keras
@pytest.mark.tensorflow
def test_a_keras_dict_sample_without_a_target_names_every_key_once():
    _, model = keras_model()
    with pytest.raises(TypeError, match="'target', 'label', 'labels', 'y'") as info:
        first_batch_check(
            model, "sparse_categorical_crossentropy", [{"x": x, "class": y} for x, y in KERAS_DATA], "sgd"
        )
    assert ".." not in str(info.value)


# -- Keras ------------------------------------------------------------------------------------
def keras_model():
    keras.utils.set_random_seed(0)
    return keras, keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(3),
        ]
    )


KERAS_DATA = [(x.numpy(), y) for x, y in DATA]


@needs_keras
@pytest.mark.tensorflow
def test_a_summed_keras_loss_is_refused():
    keras, model = keras_model()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    with pytest.raises(ValueError, match="`loss_function`") as info:
        first_batch_check(model, loss, KERAS_DATA, optimizer="sgd")
    assert "sum_over_batch_size" in str(info.value) and "Received:" in str(info.value)


@needs_keras
@pytest.mark.tensorflow
def test_the_default_keras_reduction_passes_with_the_state_unchanged():
    keras, model = keras_model()
    before = [w.copy() for w in model.get_weights()]  # BatchNormalization's moving statistics included
    first_batch_check(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), KERAS_DATA, "sgd")
    first_batch_check(model, "sparse_categorical_crossentropy", KERAS_DATA, "sgd")
    assert all((a == b).all() for a, b in zip(before, model.get_weights()))
