"""``result.history`` as a list of per-epoch dicts and as Keras' ``History``; the epoch's row of
``logs/metrics.csv`` with its validation; TensorBoard's per-epoch scalars by epoch
(docs/training.md; ``run/result.py``, ``run/recorder.py``)."""

from __future__ import annotations

import csv
import json
import math
import pickle

import pytest
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.run.result import History

from .helpers import accuracy, fresh_model_and_optimizer, make_data

DATA = make_data(96)  # 3 steps an epoch (2 workers of 16); a small test set, so validation is quick
EPOCHS = 3


def train(run_dir, test=True, **options):
    model, opt = fresh_model_and_optimizer()
    datasets = (lambda: (DATA, DATA[:32])) if test else (lambda: (DATA, None))
    fm = FabricModel(model, datasets, F.cross_entropy, opt, metrics=[accuracy])
    return fm.train(EPOCHS, 16, 2, seed=3, run_dir=run_dir, verbose=0, **options)


@pytest.fixture(scope="module")
def validated(tmp_path_factory):
    """A 2-worker run validating after every epoch: (run_dir, result)."""
    run_dir = tmp_path_factory.mktemp("history") / "run"
    return run_dir, train(run_dir)


@pytest.mark.processes
def test_the_history_answers_as_keras_history_and_as_the_list_of_records(validated):
    _, result = validated
    history, tests = result.history, result.test_history
    assert history.epoch == [0, 1, 2] == [h["epoch"] for h in history]
    assert list(history.history) == ["loss", "accuracy", "val_loss", "val_accuracy"]
    for key in ("loss", "accuracy"):
        assert history[key] == history.history[key] == [h[key] for h in history]
        assert history[f"val_{key}"] == history.history[f"val_{key}"] == [t[key] for t in tests]
    # The list of dicts, unchanged: no val_* in the records, a list's equality and JSON.
    assert set(history[-1]) == {"epoch", "loss", "accuracy"} and len(history) == EPOCHS
    records = [dict(h) for h in history]
    assert history == records and json.loads(json.dumps(history)) == records
    assert pickle.loads(pickle.dumps(history)).history == history.history


@pytest.mark.processes
def test_every_csv_row_has_its_epoch_s_validation(validated):
    """The validation of an epoch often reaches the driver before that epoch's last step commits
    (one worker's report of the step is still on its way): row 1 used to lose it."""
    run_dir, result = validated
    with open(run_dir / "logs" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3]
    for row, train_avg, test in zip(rows, result.history, result.test_history, strict=True):
        assert float(row["loss"]) == pytest.approx(train_avg["loss"])
        assert float(row["val_loss"]) == pytest.approx(test["loss"])
        assert float(row["val_accuracy"]) == pytest.approx(test["accuracy"])


@pytest.mark.processes
def test_tensorboard_logs_epoch_scalars_by_epoch_and_step_scalars_by_iteration(validated):
    from .test_display import scalars

    run_dir, result = validated
    events = scalars(run_dir / "tensorboard")
    for tag in ("epoch/loss", "epoch/accuracy", "val/loss", "val/accuracy", "samples_per_s"):
        assert [e.step for e in events.Scalars(tag)] == [1, 2, 3], tag
    assert [e.value for e in events.Scalars("val/loss")] == pytest.approx([t["loss"] for t in result.test_history])
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 3 * EPOCHS + 1))


@pytest.mark.processes
def test_a_run_without_validation_has_no_val_keys(run_dir):
    result = train(run_dir, test=False, tensorboard=False)
    assert result.test_history == []
    assert list(result.history.history) == ["loss", "accuracy"] and result.history.epoch == [0, 1, 2]


@pytest.mark.processes
def test_epochs_without_validation_have_nan_in_the_val_lists(run_dir):
    result = train(run_dir, validation_freq=2, tensorboard=False)
    assert [t["epoch"] for t in result.test_history] == [1]
    val_loss = result.history["val_loss"]
    assert math.isnan(val_loss[0]) and val_loss[1] == result.test_history[0]["loss"] and math.isnan(val_loss[2])
    assert len(result.history["loss"]) == len(val_loss) == EPOCHS


def test_history_by_int_slice_and_str():
    history = History([{"epoch": 0, "loss": 2.0}, {"epoch": 1, "loss": 1.0, "lr": 0.1}], [{"epoch": 1, "loss": 1.5}])
    assert history[0] == {"epoch": 0, "loss": 2.0} and history[1:] == [{"epoch": 1, "loss": 1.0, "lr": 0.1}]
    assert history["loss"] == [2.0, 1.0] and history.epoch == [0, 1]
    lr, val_loss = history["lr"], history["val_loss"]
    assert math.isnan(lr[0]) and lr[1] == 0.1  # a key only some epochs report: NaN in the others
    assert math.isnan(val_loss[0]) and val_loss[1] == 1.5
    with pytest.raises(KeyError, match="val_accuracy"):
        history["val_accuracy"]
    assert History() == [] and History().history == {}
