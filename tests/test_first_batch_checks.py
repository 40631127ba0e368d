"""Mistakes in the model, loss or metrics fail in the caller on the first batch, naming the argument,
with no worker process started."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.launchers.local import LocalLauncher

from .helpers import MLP, make_data, started_processes

pytestmark = pytest.mark.processes

DATA = make_data(40)
FLOAT_LABELS = [(x, float(y)) for x, y in DATA]
NAN_DATA = [(x * float("nan"), y) for x, y in DATA]


def per_sample_metric(output, target):
    return (output.argmax(1) == target).float()  # no .mean(): one value per sample


CASES = [
    ("loss class", dict(loss_function=nn.CrossEntropyLoss), TypeError, ["`loss_function`", "CrossEntropyLoss()"]),
    (
        "reduction none",
        dict(loss_function=nn.CrossEntropyLoss(reduction="none")),
        ValueError,
        ["`loss_function`", "scalar", "shape (2,)", "reduction='mean'"],
    ),
    ("per-sample metric", dict(metrics=[per_sample_metric]), ValueError, ["`metrics[0]`", "scalar", "shape (2,)"]),
    ("float labels", dict(data=FLOAT_LABELS), ValueError, ["`loss_function`", "torch.float32", "torch.long"]),
    (
        "shape mismatch",
        dict(loss_function=F.mse_loss, data=FLOAT_LABELS, metrics=[]),
        ValueError,
        ["`loss_function`", "shape (2, 3)", "shape (2,)", "HINT"],
    ),
    (
        "silent broadcast",
        dict(loss_function=F.mse_loss, data=FLOAT_LABELS, metrics=[], classes=1),
        ValueError,
        ["`loss_function`", "shape (2, 1)", "shape (2,)", "broadcasting"],
    ),
    ("non-finite loss", dict(data=NAN_DATA), ValueError, ["`loss_function`", "finite", "nan"]),
    ("bf16 model", dict(dtype=torch.bfloat16), TypeError, ["`model`", "torch.bfloat16", "model.float()"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_mistake_fails_in_the_caller(case, run_dir, monkeypatch):
    _, opts, exc_type, fragments = case

    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(LocalLauncher, "start", no_worker)
    torch.manual_seed(0)
    model = MLP(classes=opts.get("classes", 3)).to(opts.get("dtype", torch.float32))
    data = opts.get("data", DATA)
    loss, optimizer = opts.get("loss_function", F.cross_entropy), torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(exc_type) as info:  # the loss class fails in the constructor, the rest in train()
        FabricModel(model, lambda: (data, None), loss, optimizer, metrics=opts.get("metrics")).train(
            1, 8, 2, run_dir=run_dir
        )
    assert started_processes() == []
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
