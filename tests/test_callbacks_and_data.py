"""Loggers get the documented values; samples of every documented shape train."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.step.plan import Plan

from .helpers import accuracy, fresh_model_and_optimizer, make_data, records

pytestmark = pytest.mark.processes

DATA = make_data(100)


class Recorder:
    def __init__(self):
        self.calls = []

    def on_train_begin(self):
        self.calls.append(("begin",))

    def on_train_end(self):
        self.calls.append(("end",))

    def log_train_metrics(self, metrics, iteration, epoch, workers):
        self.calls.append(("train", dict(metrics), iteration, epoch, workers))

    def log_test_metrics(self, metrics, iteration, epoch):
        self.calls.append(("test", dict(metrics), iteration, epoch))


class FileWorkerLogger:
    """Worker loggers run in the workers: write what they see to a file per process."""

    def __init__(self, directory):
        self.directory = directory

    def log_train_metrics(self, metrics, iteration, epoch, workers):
        import os

        with open(f"{self.directory}/w-{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps({"metrics": metrics, "iteration": iteration, "epoch": epoch, "workers": workers}) + "\n")


def test_driver_logger_gets_epoch_averages_and_worker_logger_gets_step_values(run_dir, tmp_path):
    model, opt = fresh_model_and_optimizer()
    driver_log = Recorder()
    FabricModel(
        model,
        lambda: (DATA, DATA[:30]),
        F.cross_entropy,
        opt,
        metrics=[accuracy],
        driver_logger_callback=driver_log,
        worker_logger_callback=FileWorkerLogger(str(tmp_path)),
    ).train(2, 10, 2, validation_freq=2, run_dir=run_dir, seed=3)
    plan = Plan(100, 10, 2, 3)
    calls = driver_log.calls
    assert calls[0] == ("begin",) and calls[-1] == ("end",)
    train = [c for c in calls if c[0] == "train"]
    assert [c[2] for c in train] == list(range(1, 2 * plan.steps_per_epoch + 1))  # iterations completed
    assert {c[4] for c in train} == {2}
    # Driver values are the sample-weighted epoch averages of the per-step values.
    steps = records(run_dir, "train")
    epoch1 = [s for s in steps if s["epoch"] == 1]
    expected = sum(s["metrics"]["loss"] for s in epoch1) / len(epoch1)  # equal-size steps here
    assert abs(train[-1][1]["loss"] - expected) < 1e-5
    assert set(train[-1][1]) == {"loss", "accuracy"}
    test = [c for c in calls if c[0] == "test"]
    assert len(test) == 1 and test[0][3] == 1 and test[0][2] == 2 * plan.steps_per_epoch  # validation_freq=2
    # Each worker logger saw every step, with that step's values and its own iteration count.
    files = sorted(tmp_path.glob("w-*.jsonl"))
    assert len(files) == 2
    for f in files:
        seen = [json.loads(line) for line in f.read_text().splitlines()]
        assert [s["iteration"] for s in seen] == list(range(1, 11))
        assert [round(s["metrics"]["loss"], 5) for s in seen] == [round(s["metrics"]["loss"], 5) for s in steps]


def test_test_accuracy_is_computed_over_the_whole_test_set(run_dir):
    model, opt = fresh_model_and_optimizer()
    test_set = DATA[:37]  # not a multiple of batch * workers
    result = FabricModel(model, lambda: (DATA, test_set), F.cross_entropy, opt, metrics=[accuracy]).train(
        1, 8, 3, run_dir=run_dir
    )
    with torch.no_grad():
        model.eval()
        x = torch.stack([s[0] for s in test_set])
        y = torch.tensor([s[1] for s in test_set])
        expected = accuracy(model(x), y).item()
    assert abs(result.test_history[-1]["accuracy"] - expected) < 1e-6


class DictDataset:
    def __init__(self, n):
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((n, 12)).astype(np.float32)
        self.y = (self.x[:, 0] > 0).astype(np.int64)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"features": self.x[i], "label": self.y[i]}


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(12, 2), nn.Linear(3, 2)

    def forward(self, x, extra):
        return self.a(x) + self.b(extra)


def test_dict_and_numpy_samples(run_dir):
    torch.manual_seed(0)
    model = nn.Linear(12, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    result = FabricModel(
        model, lambda: (DictDataset(200), DictDataset(50)), F.cross_entropy, opt, metrics=[accuracy]
    ).train(3, 16, 2, run_dir=run_dir)
    assert result.test_history[-1]["accuracy"] > 0.9


def test_multi_input_tuples_and_custom_collate(run_dir):
    samples = [(torch.randn(12), torch.randn(3), i % 2) for i in range(64)]
    collated = []

    def collate(batch):
        collated.append(len(batch))  # runs in the caller once (the check), then in workers
        x = torch.stack([b[0] for b in batch])
        e = torch.stack([b[1] for b in batch])
        return x, e, torch.tensor([b[2] for b in batch])

    torch.manual_seed(0)
    model = TwoInputs()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.a.weight.detach().clone()
    FabricModel(model, lambda: (samples, None), F.cross_entropy, opt, fn_batch_collate=collate).train(
        1, 8, 2, run_dir=run_dir
    )
    assert not torch.equal(before, model.a.weight)
