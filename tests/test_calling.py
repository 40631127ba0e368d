"""How a batch reaches the model and what its loss is (frameworks/torch/calling.py), in-process:
the call a user would write by hand, for every sample shape; the model's own loss; structured
outputs; and the errors before any worker starts when neither a loss function nor a model loss exists."""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.frameworks import detect_framework
from fabric_model.frameworks.base import UserObjects
from fabric_model.frameworks.torch.calling import ModelCall, model_loss, primary_output
from fabric_model.frameworks.torch.ibm import accuracy, accuracy_applies
from fabric_model.launchers.local import LocalLauncher

from .helpers import started_processes


class Named(torch.nn.Module):
    """A forward of named inputs, taking the labels too (a Hugging Face model's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, features, mask=None, labels=None):
        logits = self.fc(features * (1 if mask is None else mask[:, None]))
        return {"logits": logits, "loss": None if labels is None else F.cross_entropy(logits, labels)}


class TwoInputs(torch.nn.Module):
    def forward(self, a, b):
        return a + b


class OneDict(torch.nn.Module):
    def forward(self, batch):
        return batch["a"] * 2


def test_a_dict_the_forward_takes_by_name_is_passed_as_keywords_with_its_labels():
    call = ModelCall.of(Named())
    batch = {"features": torch.ones(2, 4), "mask": torch.ones(2), "labels": torch.tensor([0, 2])}
    inputs, target = call.split(batch)
    assert set(inputs) == {"features", "mask", "labels"} and torch.equal(target, batch["labels"])
    output = call(Named(), inputs)
    assert output["loss"] is not None  # the labels reached the forward
    assert call.args_and_kwargs(inputs) == ((), inputs)


def test_a_target_the_forward_does_not_take_is_left_out():
    class NoLabels(torch.nn.Module):
        def forward(self, features, mask):
            return features.sum(1) * mask

    call = ModelCall.of(NoLabels())
    inputs, target = call.split({"features": torch.ones(2, 4), "mask": torch.ones(2), "target": torch.zeros(2)})
    assert set(inputs) == {"features", "mask"} and target.shape == (2,)
    assert torch.equal(call(NoLabels(), inputs), torch.full((2,), 4.0))


def test_a_dict_the_forward_does_not_take_by_name_is_its_one_argument():
    call = ModelCall.of(OneDict())
    inputs, _ = call.split({"a": torch.ones(2), "b": torch.ones(2), "label": torch.zeros(2)})
    assert torch.equal(call(OneDict(), inputs), torch.full((2,), 2.0))


def test_one_input_and_a_target_pass_the_input_itself():
    call = ModelCall.of(torch.nn.Linear(4, 2))
    inputs, target = call.split({"x": torch.ones(3, 4), "label": torch.zeros(3)})
    assert isinstance(inputs, torch.Tensor) and call(torch.nn.Linear(4, 2), inputs).shape == (3, 2)


def test_tuples_are_unpacked_only_where_the_forward_takes_them():
    two = ModelCall.of(TwoInputs())
    inputs, _ = two.split((torch.ones(2), torch.ones(2), torch.zeros(2)))  # (a, b, y)
    assert torch.equal(two(TwoInputs(), inputs), torch.full((2,), 2.0))
    inputs, _ = two.split(((torch.ones(2), torch.ones(2)), torch.zeros(2)))  # ((a, b), y)
    assert torch.equal(two(TwoInputs(), inputs), torch.full((2,), 2.0))

    class WholeTuple(torch.nn.Module):
        def forward(self, pair):
            return pair[0] - pair[1]

    one = ModelCall.of(WholeTuple())
    inputs, _ = one.split(((torch.ones(2), torch.ones(2)), torch.zeros(2)))
    assert torch.equal(one(WholeTuple(), inputs), torch.zeros(2))


def test_a_compiled_model_is_called_as_its_original_forward():
    compiled = torch.compile(Named(), backend="eager")  # the wrapper is what counts, not the backend
    assert ModelCall.of(compiled).names == {"features", "mask", "labels"}


def test_a_dict_without_a_target_needs_the_model_to_compute_its_loss():
    batch = {"features": torch.ones(2, 4)}
    with pytest.raises(ValueError, match="needs a target under one of the keys"):
        ModelCall.of(Named()).split(batch)
    assert ModelCall.of(Named(), target_required=False).split(batch) == (batch, None)


class PassesOn(torch.nn.Module):
    """A wrapper of the shape DDP, accelerate and peft have: ``forward(*args, **kwargs)``, the
    wrapped module exposed under ``attribute``."""

    def __init__(self, inner: torch.nn.Module, attribute: str = "module") -> None:
        super().__init__()
        setattr(self, attribute, inner)
        self.attribute = attribute

    def forward(self, *args, **kwargs):
        return getattr(self, self.attribute)(*args, **kwargs)


class BaseExposed(torch.nn.Module):
    """peft's shape: the wrapped model behind ``get_base_model()``, under a name of its own."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.wrapped = PassesOn(inner, "model")

    def get_base_model(self) -> torch.nn.Module:
        return self.wrapped.model

    def forward(self, *args, **kwargs):
        return self.wrapped(*args, **kwargs)


@pytest.mark.parametrize("wrap", ["module", "model", "get_base_model", "nested"])
def test_a_wrapper_is_called_as_the_module_it_exposes_takes(wrap):
    named = Named()
    model = {
        "module": lambda: PassesOn(named, "module"),
        "model": lambda: PassesOn(named, "model"),
        "get_base_model": lambda: BaseExposed(named),
        "nested": lambda: PassesOn(BaseExposed(named), "module"),
    }[wrap]()
    call = ModelCall.of(model)
    assert call.names == {"features", "mask", "labels"} and not call.wraps_all
    batch = {"features": torch.ones(2, 4), "mask": torch.ones(2), "labels": torch.tensor([0, 2])}
    inputs, _ = call.split(batch)
    assert set(inputs) == set(batch) and call(model, inputs)["loss"] is not None
    # a target the wrapped forward does not name stays out, as for the module itself
    inputs, _ = call.split({"features": torch.ones(2, 4), "mask": torch.ones(2), "target": torch.zeros(2)})
    assert set(inputs) == {"features", "mask"} and call(model, inputs)["loss"] is None


def test_a_forward_taking_kwargs_gets_the_target_when_it_computes_the_loss_or_names_nothing():
    class Keywords(torch.nn.Module):  # names its input, passes the rest on
        def __init__(self) -> None:
            super().__init__()
            self.inner = Named()

        def forward(self, features, **kwargs):
            return self.inner(features, **kwargs)

    class AllKeywords(Keywords):  # a wrapper that exposes nothing by a known name
        def forward(self, **kwargs):
            return self.inner(**kwargs)

    batch = {"features": torch.ones(2, 4), "labels": torch.tensor([0, 2])}
    for model in (Keywords(), AllKeywords()):
        own = ModelCall.of(model, target_required=False)  # loss_function=None: the labels go in
        inputs, _ = own.split(batch)
        assert set(inputs) == {"features", "labels"} and own(model, inputs)["loss"] is not None
    given = ModelCall.of(Keywords())  # a loss function reads the labels: the forward does not get them
    inputs, _ = given.split(batch)
    assert inputs is batch["features"] and given(Keywords(), inputs)["loss"] is None
    assert set(ModelCall.of(AllKeywords()).split(batch)[0]) == {"features", "labels"}


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


def test_the_model_loss_is_found_where_models_put_it():
    loss = torch.tensor(1.5)
    assert model_loss({"loss": loss, "logits": torch.ones(2, 3)}) is loss
    assert model_loss(Output(torch.ones(2, 3), loss)) is loss
    assert model_loss((loss, torch.ones(2, 3))) is loss  # Hugging Face's tuple
    assert model_loss((torch.ones(2, 3), loss)) is loss  # nanoGPT's (logits, loss)
    assert model_loss(loss) is loss
    with pytest.raises(ValueError, match="loss_function=None.*labels"):
        model_loss(Output(torch.ones(2, 3)))


class LossAndAux(NamedTuple):
    loss: torch.Tensor
    aux: torch.Tensor
    logits: torch.Tensor


#: What is said of the output (loss, logits, aux) and the two ways out.
SEVERAL_SCALARS = [
    "`loss_function`",
    "loss_function=None",
    "a tuple of 3: [0] a scalar tensor, [1] a tensor of shape (2, 3), [2] a scalar tensor",
    "[0], [2]",
    "`loss` field",
    "a dict or ModelOutput with `loss`",
    "loss_function=lambda output, target: output[0]",
    "HINT",
]


def test_several_scalar_tensors_and_no_loss_field_are_refused_not_guessed():
    loss, aux, logits = torch.tensor(1.5), torch.tensor(0.1), torch.ones(2, 3)
    with pytest.raises(ValueError) as info:
        model_loss((loss, logits, aux))
    for fragment in SEVERAL_SCALARS:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"
    with pytest.raises(ValueError, match=r"a list of 2: \[0\] a scalar tensor, \[1\] a scalar tensor"):
        model_loss([aux, loss])
    # A `loss` field says which one it is, whatever else the output holds.
    assert model_loss(LossAndAux(loss, aux, logits)) is loss
    assert model_loss({"aux": aux, "loss": loss, "logits": logits}) is loss
    # One scalar tensor among other things is not a guess (an int or None is no tensor).
    assert model_loss((logits, loss, None, 3)) is loss


class ComputesItsLoss(torch.nn.Module):
    """A model that computes its loss from the target it is given, returning ``shape(logits, loss, aux)``."""

    def __init__(self, shape) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.shape = shape

    def forward(self, features, labels=None):
        logits = self.fc(features)
        loss = F.cross_entropy(logits, labels)
        return self.shape(logits, loss, logits.pow(2).mean())


def loss_then_logits_then_aux(logits, loss, aux):
    return loss, logits, aux


def test_several_scalar_tensors_fail_in_the_caller_before_any_worker_starts(monkeypatch, run_dir):
    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(LocalLauncher, "start", no_worker)
    model = ComputesItsLoss(loss_then_logits_then_aux)
    fm = FabricModel(model, get_data, None, torch.optim.SGD(model.parameters(), lr=0.1), metrics=[])
    began = time.monotonic()
    with pytest.raises(ValueError) as info:
        fm.train(1, 4, 2, run_dir=run_dir)  # micro-batches of 2 samples
    assert started_processes() == []
    assert time.monotonic() - began < 60, "refused only after a run"
    for fragment in SEVERAL_SCALARS:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


@pytest.mark.parametrize(
    "shape",
    [
        lambda logits, loss, aux: (logits, loss),  # nanoGPT's
        lambda logits, loss, aux: (loss, logits),  # Hugging Face's, return_dict=False
        lambda logits, loss, aux: {"loss": loss, "aux": aux, "logits": logits},
        lambda logits, loss, aux: LossAndAux(loss, aux, logits),
    ],
    ids=["logits-loss", "loss-logits", "dict-with-loss-and-aux", "namedtuple-with-loss-and-aux"],
)
def test_one_scalar_tensor_or_a_loss_field_passes_the_first_batch_check(shape):
    """What ``train()`` runs on the first batch before any worker starts (orchestrator/pipeline.ship)."""
    model = ComputesItsLoss(shape)
    framework = detect_framework(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    adapter = framework.make_adapter(UserObjects(model, optimizer, None, metrics=[]))
    data, _ = get_data()
    framework.prepare_for_shipping(adapter, framework.first_batch(adapter, data))


@pytest.mark.processes
def test_a_tuple_of_logits_and_loss_trains_on_that_loss(run_dir):
    """nanoGPT's ``(logits, loss)`` trains end to end on the loss the model computed, in a worker."""
    torch.manual_seed(0)
    model = ComputesItsLoss(lambda logits, loss, aux: (logits, loss))
    with torch.no_grad():
        before = F.cross_entropy(model.fc(torch.stack([s["features"] for s in get_data()[0]])), LABELS).item()
    fm = FabricModel(model, get_data, None, torch.optim.SGD(model.parameters(), lr=0.5), metrics=[])
    result = fm.train(8, 8, 1, run_dir=run_dir)
    losses = list(result.history["loss"])
    assert losses[-1] < losses[0] and losses[-1] < before, losses


def test_the_default_accuracy_reads_the_logits_of_a_structured_output():
    logits = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    target = torch.tensor([1, 1])
    assert primary_output(Output(logits)) is logits and primary_output({"h": logits}) is logits
    assert accuracy_applies(Output(logits), target) and float(accuracy(Output(logits), target)) == 0.5


LABELS = torch.arange(8) % 3


def get_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g)
    return [{"features": x[i].clone(), "labels": LABELS[i].clone()} for i in range(8)], None


def test_no_loss_function_and_no_model_loss_fails_before_any_worker_starts():
    class NoLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, features):
            return self.fc(features)

    model = NoLoss()
    fm = FabricModel(model, get_data, None, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"loss_function=None: the model must compute its loss.*HINT"):
        fm.train(1, 4, 1)


def test_sparse_adam_is_refused_with_the_fix():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    with pytest.raises(TypeError, match=r"`optimizer`.*0's gradient.*SparseAdam.*torch.optim.Adam"):
        FabricModel(model, get_data, F.cross_entropy, torch.optim.SparseAdam(list(model[0].parameters())))
