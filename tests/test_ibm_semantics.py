"""IBM EDT's semantics in the library itself (issue 13): what scripts written for EDT rely on.

Real FabricModel runs with 1-2 worker processes on tiny data made here.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from fabric_model import Callback, FabricModel
from fabric_model.launchers.local import LocalLauncher

from .helpers import MLP, Lazily, fresh_model_and_optimizer, make_data

keras = Lazily("keras")  # at a test's first use: collecting this module imports no TensorFlow

DATA = make_data(96)
TEST = make_data(4, seed=1)  # with batch 8 and 2 workers, rank 1's test shard is empty


class LossAccLogger:
    """IBM's older logger: ``acc`` arrives in percent (their scripts divide it by 100)."""

    def __init__(self) -> None:
        self.train: list[tuple[float, float, int, int]] = []
        self.test: list[tuple[float, float, int]] = []

    def log_train_metrics(self, loss, acc, completed_batch, worker=0):
        self.train.append((loss, acc / 100.0, completed_batch, worker))

    def log_test_metrics(self, loss, acc, completed_batch, worker=0):
        self.test.append((loss, acc / 100.0, completed_batch))


class MetricsFormLogger:
    """IBM's second older form: (metrics, completed_batch, epoch, worker=0)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict, int, int]] = []

    def log_train_metrics(self, metrics, completed_batch, epoch, worker=0):
        self.calls.append(("train", dict(metrics), completed_batch, epoch))

    def log_test_metrics(self, metrics, completed_batch, epoch):
        self.calls.append(("test", dict(metrics), completed_batch, epoch))


class SavingCallback(Callback):
    def on_epoch_end(self, epoch, save_model=False):  # IBM's signature
        self.saw = (epoch, save_model)


def ibm_fn_test(model, test_iter, fn_args):
    """As IBM's samples: one float, the mean loss; divides by the count (fails on an empty shard)."""
    total, count = 0.0, 0
    for x, y in test_iter:
        total += float(F.cross_entropy(model(x), y, reduction="sum"))
        count += len(y)
    return total / count


def ibm_step(model, data, eva, train_loader, fn_args):
    inputs, target = data
    output = model(inputs)
    loss = F.cross_entropy(output, target)
    loss.backward()
    return eva(output, target), loss


@pytest.mark.processes
def test_datasets_function_keyword_default_accuracy_and_old_logger_in_percent(run_dir):
    model, opt = fresh_model_and_optimizer()
    logger = LossAccLogger()
    fm = FabricModel(
        model,
        datasets_function=lambda: (DATA, TEST),
        loss_function=F.cross_entropy,
        optimizer=opt,
        driver_logger=logger,
        user_callback=[SavingCallback()],
    )
    result = fm.train(2, 8, 2, seed=3, run_dir=run_dir)
    assert set(result.history[-1]) >= {"loss", "accuracy"}
    assert 0.0 <= result.history[-1]["accuracy"] <= 1.0
    assert set(result.test_history[-1]) >= {"loss", "accuracy"}
    accs = [acc for _, acc, _, _ in logger.train]
    # In percent: after the script's /100 a fraction again (a fraction passed as is would read ~0.003).
    assert all(0.0 <= a <= 1.0 for a in accs) and max(accs) > 0.1
    assert logger.train[-1][3] == 2  # the driver's logger: the live worker count
    assert len(logger.test) == 2 and 0.0 <= logger.test[-1][1] <= 1.0


@pytest.mark.processes
def test_eva_is_callable_and_fn_test_returning_a_float_is_the_loss(run_dir):
    """A custom step's eva(outputs, labels) is the accuracy as a fraction; fn_test's float is the loss;
    the rank whose test shard is empty does not call fn_test (IBM's divides by zero there)."""
    model, opt = fresh_model_and_optimizer()
    logger = MetricsFormLogger()
    fm = FabricModel(
        model,
        lambda: (DATA, TEST),
        F.cross_entropy,
        opt,
        fn_step_train=ibm_step,
        fn_test=ibm_fn_test,
        driver_logger=logger,
    )
    result = fm.train(2, 8, 2, seed=3, run_dir=run_dir)
    assert 0.0 <= result.history[-1]["accuracy"] <= 1.0  # eva's fraction, through the step
    model.eval()  # no dropout, as fn_test runs
    with torch.no_grad():
        expected = float(F.cross_entropy(model(torch.stack([x for x, _ in TEST])), torch.tensor([y for _, y in TEST])))
    assert result.test_history[-1]["loss"] == pytest.approx(expected, rel=1e-5)
    kinds = {c[0] for c in logger.calls}
    assert kinds == {"train", "test"}
    _, metrics, completed_batch, epoch = logger.calls[-1]
    assert "loss" in metrics and epoch == 1 and completed_batch > 0


def failing_fn_test(model, test_iter, fn_args):
    raise ZeroDivisionError("fn_test failed on purpose")


@pytest.mark.processes
def test_a_failing_fn_test_fails_the_job(run_dir):
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(model, lambda: (DATA, DATA[:16]), F.cross_entropy, opt, fn_test=failing_fn_test)
    with pytest.raises(ZeroDivisionError, match="on purpose"):
        fm.train(1, 8, 2, seed=3, run_dir=run_dir)


@pytest.mark.processes
def test_regression_output_shows_no_default_accuracy(run_dir):
    torch.manual_seed(0)
    model = torch.nn.Linear(12, 1)
    data = [(x, torch.tensor([float(y)])) for x, y in DATA]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    result = FabricModel(model, lambda: (data, None), F.mse_loss, opt).train(1, 8, 1, seed=3, run_dir=run_dir)
    assert set(result.history[-1]) == {"epoch", "loss"} or "accuracy" not in result.history[-1]


@pytest.mark.processes
def test_an_empty_metrics_list_shows_the_loss_alone(run_dir):
    """metrics=None is IBM's default accuracy; metrics=[] asks for none (as Keras' metrics=[])."""
    model, opt = fresh_model_and_optimizer()
    result = FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt, metrics=[]).train(
        1, 8, 1, seed=3, run_dir=run_dir
    )
    assert set(result.history[-1]) == {"epoch", "loss"}


@pytest.mark.processes
def test_engines_number_is_capped_by_the_cores(run_dir, monkeypatch, capfd):
    """A script's default of 16 starts at most one worker per usable core on a CPU-only host."""
    monkeypatch.delenv("FABRIC_MODEL_CPU_WORKERS", raising=False)
    cores = len(os.sched_getaffinity(0))
    model, opt = fresh_model_and_optimizer()
    result = FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt).train(1, 2, 16, seed=3, run_dir=run_dir)
    assert 1 <= len(result.replica_digests) <= min(16, cores) and len(set(result.replica_digests.values())) == 1
    err = capfd.readouterr().err
    if cores < 16:
        workers = f"{cores} workers" if cores > 1 else "1 worker"
        assert f"[fabric-model] starting {workers} on CPU" in err and "engines_number=16" in err


@pytest.mark.processes
def test_constructor_names_and_aliases():
    model, opt = fresh_model_and_optimizer()
    with pytest.raises(TypeError, match="`get_datasets` and `datasets_function`"):
        FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt, get_datasets=lambda: (DATA, None))
    with pytest.raises(TypeError, match="datasets_function"):
        FabricModel(model, (DATA, None), F.cross_entropy, opt)
    fm = FabricModel(model, loss_function=F.cross_entropy, optimizer=opt, get_datasets=lambda: (DATA, None))
    assert fm.datasets_function() == (DATA, None)
    assert isinstance(model, MLP)


def test_launcher_gives_workers_the_cuda_devices_the_process_started_with(monkeypatch, tmp_path):
    from fabric_model.setup import devices

    launcher = LocalLauncher(("127.0.0.1", 1), b"x" * 32, lambda i: tmp_path / f"{i}.log", threads=1)
    monkeypatch.setattr(devices, "_CUDA_VISIBLE_AT_START", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a TF script hides the GPUs from its driver
    assert launcher._environment()["CUDA_VISIBLE_DEVICES"] == "3"
    monkeypatch.setattr(devices, "_CUDA_VISIBLE_AT_START", None)
    assert "CUDA_VISIBLE_DEVICES" not in launcher._environment()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setattr(devices, "_CUDA_VISIBLE_AT_START", "1")  # a cluster's allocation is kept
    assert launcher._environment()["CUDA_VISIBLE_DEVICES"] == "1"


def _recording_flow(directory: str):
    """``datasets_function`` of a Keras script: ``ImageDataGenerator().flow(x, y, shuffle=True)``,
    appending the sample indices of every batch it builds to ``<directory>/flow-<pid>.txt``."""

    def datasets():
        import numpy as np
        from tensorflow.keras.preprocessing.image import ImageDataGenerator

        rng = np.random.default_rng(0)
        x = rng.normal(size=(48, 4, 4, 1)).astype("float32")
        y = (x.reshape(48, -1).sum(1) > 0).astype("int64")
        flow = ImageDataGenerator().flow(x, y, batch_size=8, shuffle=True)
        build = flow._get_batches_of_transformed_samples

        def recording(index_array):
            with open(os.path.join(directory, f"flow-{os.getpid()}.txt"), "a") as f:
                f.write(" ".join(str(int(i)) for i in index_array) + "\n")
            return build(index_array)

        flow._get_batches_of_transformed_samples = recording
        return flow, None

    return datasets


@pytest.mark.processes
def test_keras_flow_with_shuffle_uses_every_item_once_per_epoch_on_two_workers(run_dir, tmp_path):
    reads = tmp_path / "reads"
    reads.mkdir()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4, 4, 1)), keras.layers.Flatten(), keras.layers.Dense(2)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    epochs = 2
    # One loader thread: batches are built, and their lines written, in the plan's order (with
    # more, the next epoch's first batch may be written before this epoch's last one).
    result = FabricModel(model, _recording_flow(str(reads)), loss, "sgd").train(
        epochs, 8, 2, seed=5, run_dir=run_dir, num_dataloader_threads=1
    )
    assert len(result.replica_digests) == 2 and len(set(result.replica_digests.values())) == 1
    # The samples each worker transformed, in order (one sample a call: each after its own seeds).
    per_worker = {int(f.stem.split("-")[1]): [int(i) for i in f.read_text().split()] for f in reads.glob("flow-*.txt")}
    per_worker.pop(os.getpid(), None)  # the caller's check of the first batch
    assert len(per_worker) == 2
    # 6 batches of 8 an epoch, 2 per step: each worker builds 3 an epoch (24 samples), in the plan's order.
    orders = []
    for epoch in range(epochs):
        used = [i for samples in per_worker.values() for i in samples[24 * epoch : 24 * epoch + 24]]
        assert sorted(used) == list(range(48)), f"epoch {epoch}: every sample exactly once"
        orders.append(used)
    assert orders[0] != orders[1]  # shuffled again for the next epoch


@pytest.mark.processes
def test_a_custom_step_s_accuracy_reaches_old_loggers_in_percent_and_a_loss_only_fn_test_shows_no_metric(run_dir):
    """IBM's custom-step samples: ``acc = eva(outputs, labels)`` is a fraction, named ``accuracy``, and
    their ``log_train_metrics(loss, acc, ...)`` divides it by 100, as on the default path; an
    ``fn_test`` returning the mean loss alone shows no validation metric (no ``val_metric=nan``)."""
    model, opt = fresh_model_and_optimizer()
    logger = LossAccLogger()
    fm = FabricModel(
        model,
        lambda: (DATA, TEST),
        F.cross_entropy,
        opt,
        fn_step_train=ibm_step,
        fn_test=ibm_fn_test,
        driver_logger=logger,
    )
    result = fm.train(2, 8, 2, seed=3, run_dir=run_dir)
    assert set(result.history[-1]) == {"epoch", "loss", "accuracy"}
    accs = [acc for _, acc, _, _ in logger.train]
    assert all(0.0 <= a <= 1.0 for a in accs) and max(accs) > 0.1  # unscaled, /100 would leave < 0.01
    assert set(result.test_history[-1]) == {"epoch", "loss"}
    assert len(logger.test) == 2 and all(acc != acc for _, acc, _ in logger.test)  # NaN: a number IBM's /100 takes
    metrics_log = (run_dir / "logs" / "metrics.jsonl").read_text()
    assert '"metric"' not in metrics_log and "NaN" not in metrics_log
