"""Bad input fails in the caller, before any worker starts, naming argument, value and what is accepted."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from fabric_model import FabricModel

from .helpers import MLP, make_data, started_processes

pytestmark = pytest.mark.processes

DATA = make_data(40)


def good():
    torch.manual_seed(0)
    model = MLP()
    return dict(
        model=model,
        get_datasets=lambda: (DATA, DATA),
        loss_function=F.cross_entropy,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )


def _other_optimizer():
    return torch.optim.SGD(MLP().parameters(), lr=0.1)


CONSTRUCTOR_CASES = [
    ("model", lambda kw: {**kw, "model": "resnet"}, TypeError, ["`model`", "torch.nn.Module", "str"]),
    (
        "datasets_function",
        lambda kw: {**kw, "get_datasets": (DATA, DATA)},
        TypeError,
        ["`datasets_function`", "callable", "HINT"],
    ),
    (
        "loss_function",
        lambda kw: {**kw, "loss_function": "cross_entropy"},
        TypeError,
        ["`loss_function`", "'cross_entropy'", "callable"],
    ),
    (
        "optimizer type",
        lambda kw: {**kw, "optimizer": torch.optim.SGD},
        TypeError,
        ["`optimizer`", "torch.optim.Optimizer", "HINT"],
    ),
    (
        "optimizer of another model",
        lambda kw: {**kw, "optimizer": _other_optimizer()},
        ValueError,
        ["`optimizer`", "not parameters of the model"],
    ),
    ("metrics not a list", lambda kw: {**kw, "metrics": lambda o, t: 0.0}, TypeError, ["`metrics`", "HINT"]),
    ("metrics item", lambda kw: {**kw, "metrics": ["accuracy", 3]}, TypeError, ["metrics[0]", "'accuracy'"]),
    (
        "logger class",
        lambda kw: {**kw, "driver_logger_callback": object},
        TypeError,
        ["`driver_logger_callback`", "instance"],
    ),
    (
        "logger without hooks",
        lambda kw: {**kw, "worker_logger_callback": 42},
        TypeError,
        ["`worker_logger_callback`", "log_train_metrics", "42"],
    ),
    ("save_to_onnx", lambda kw: {**kw, "save_to_onnx": "yes"}, TypeError, ["`save_to_onnx`", "'yes'"]),
    (
        "keras_custom_objects",
        lambda kw: {**kw, "keras_custom_objects": ["Layer"]},
        TypeError,
        ["`keras_custom_objects`", "dict"],
    ),
    ("fn_batch_collate", lambda kw: {**kw, "fn_batch_collate": 3}, TypeError, ["`fn_batch_collate`", "3"]),
]

TRAIN_CASES = [
    ("epoch_number zero", dict(epoch_number=0, batch_size=8), ValueError, ["`epoch_number`", ">= 1", "0"]),
    ("epoch_number float", dict(epoch_number=1.5, batch_size=8), TypeError, ["`epoch_number`", "1.5", "float"]),
    ("batch_size negative", dict(epoch_number=1, batch_size=-4), ValueError, ["`batch_size`", "-4"]),
    ("batch_size bool", dict(epoch_number=1, batch_size=True), TypeError, ["`batch_size`", "True"]),
    (
        "engines_number zero",
        dict(epoch_number=1, batch_size=8, engines_number=0),
        ValueError,
        ["`engines_number`", "0"],
    ),
    (
        "engines_number str",
        dict(epoch_number=1, batch_size=8, engines_number="2"),
        TypeError,
        ["`engines_number`", "'2'", "or None"],
    ),
    (
        "threads negative",
        dict(epoch_number=1, batch_size=8, num_dataloader_threads=-1),
        ValueError,
        ["`num_dataloader_threads`", ">= 0"],
    ),
    ("validation_freq", dict(epoch_number=1, batch_size=8, validation_freq=0), ValueError, ["`validation_freq`"]),
    ("checkpoint_freq", dict(epoch_number=1, batch_size=8, checkpoint_freq=-1), ValueError, ["`checkpoint_freq`"]),
    (
        "checkpoint_steps negative",
        dict(epoch_number=1, batch_size=8, checkpoint_steps=-1),
        ValueError,
        ["`checkpoint_steps`", ">= 0", "-1"],
    ),
    (
        "checkpoint_steps str",
        dict(epoch_number=1, batch_size=8, checkpoint_steps="3"),
        TypeError,
        ["`checkpoint_steps`", "'3'", "an int"],
    ),
    (
        "effective batch not a multiple",
        dict(epoch_number=1, batch_size=8, effective_batch_size=20),
        ValueError,
        ["`effective_batch_size`", "multiple", "20", "16 or 24"],
    ),
    ("seed", dict(epoch_number=1, batch_size=8, seed=-1), TypeError, ["`seed`", "-1"]),
]


def _assert_fast_and_processless(fn, exc_type, fragments):
    start = time.monotonic()
    with pytest.raises(exc_type) as info:
        fn()
    assert time.monotonic() - start < 1.0
    assert started_processes() == []
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize("case", CONSTRUCTOR_CASES, ids=[c[0] for c in CONSTRUCTOR_CASES])
def test_constructor_rejects(case):
    _, mutate, exc_type, fragments = case
    kwargs = mutate(good())
    _assert_fast_and_processless(lambda: FabricModel(**kwargs), exc_type, fragments)


@pytest.mark.parametrize("case", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_train_rejects(case, run_dir):
    _, kwargs, exc_type, fragments = case
    fm = FabricModel(**good())
    _assert_fast_and_processless(lambda: fm.train(**kwargs, run_dir=run_dir), exc_type, fragments)


class NotIndexable:
    def __iter__(self):
        return iter(DATA)


@pytest.mark.parametrize(
    "datasets, exc_type, fragments",
    [
        (lambda: DATA, TypeError, ["(train_dataset, test_dataset)", "list"]),
        (lambda: (DATA, DATA, DATA), TypeError, ["(train_dataset, test_dataset)"]),
        (lambda: (NotIndexable(), DATA), TypeError, ["train dataset", "map-style", "NotIndexable"]),
        (lambda: (DATA, NotIndexable()), TypeError, ["test dataset", "NotIndexable"]),
        (lambda: ([], DATA), ValueError, ["train dataset", "empty"]),
        (lambda: ([torch.zeros(3)] * 4, None), TypeError, ["first training sample", "(input, target)"]),
    ],
    ids=["not a pair", "three", "train iterable", "test iterable", "empty", "bad sample"],
)
def test_dataset_function_is_checked(datasets, exc_type, fragments, run_dir):
    kw = good()
    kw["get_datasets"] = datasets
    fm = FabricModel(**kw)
    _assert_fast_and_processless(lambda: fm.train(1, 8, 2, run_dir=run_dir), exc_type, fragments)


def test_unpicklable_job_fails_early(run_dir):
    import threading

    lock = threading.Lock()
    kw = good()
    kw["loss_function"] = lambda out, target: (lock, F.cross_entropy(out, target))[1]
    fm = FabricModel(**kw)
    _assert_fast_and_processless(lambda: fm.train(1, 8, 2, run_dir=run_dir), TypeError, ["serialize", "HINT"])
