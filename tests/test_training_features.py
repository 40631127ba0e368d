"""Training features (docs/architecture.md, "Training features"): learning-rate schedulers that
survive kills and resumes, callbacks' ``logs`` and early stopping on every replica alike,
the best checkpoints by a monitored metric, and evaluate/predict after training."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F

from fabric_model import BestCheckpoints, Callback, EarlyStopping, FabricModel, worker_context
from fabric_model.state.checkpoint import list_checkpoints
from fabric_model.testing import FaultInjector, HoldForJoin, Kill

from .helpers import fresh_model_and_optimizer, make_data, max_rel_diff, records, reference_train

SEED, BATCH, GLOBAL = 7, 8, 24
DATA = make_data(240)  # 10 steps an epoch
TEST = DATA[:40]
STEPS = 10


def one_cycle(opt: torch.optim.Optimizer, epochs: int) -> torch.optim.lr_scheduler.OneCycleLR:
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.3, total_steps=epochs * STEPS)


class StepThenSchedule:
    """The plain loop's optimizer: ``step()`` steps the optimizer, then its per-step scheduler."""

    def __init__(self, opt: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.opt, self.scheduler = opt, scheduler

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> None:
        self.opt.step()
        self.scheduler.step()


def scheduled_reference(epochs: int) -> tuple[dict, list[float]]:
    model, opt = fresh_model_and_optimizer()
    scheduler = one_cycle(opt, epochs)
    shim = StepThenSchedule(opt, scheduler)
    reference_train(model, shim, DATA, seed=SEED, epochs=epochs, batch_size=BATCH, micro_batches=GLOBAL // BATCH)
    return copy.deepcopy(model.state_dict()), scheduler.get_last_lr()


def scheduled_model(epochs: int, **kwargs):
    model, opt = fresh_model_and_optimizer()
    scheduler = one_cycle(opt, epochs)
    fm = FabricModel(
        model,
        lambda: (DATA, TEST),
        F.cross_entropy,
        opt,
        lr_scheduler={"scheduler": scheduler, "interval": "step"},
        **kwargs,
    )
    return fm, model, scheduler


@pytest.mark.processes
def test_a_per_step_scheduler_gives_torch_s_learning_rates_through_a_kill_and_a_resume(run_dir, tmp_path):
    """OneCycleLR stepped per step: the weights and the last learning rate of the plain loop,
    with a worker killed mid-epoch and replaced (its replacement pulls the scheduler's state),
    and across a resume (the scheduler's state is in the checkpoint)."""
    epochs = 3
    reference, last_lr = scheduled_reference(epochs)
    injector = FaultInjector([Kill(worker=1, step=14)], tmp_path)
    fm, model, scheduler = scheduled_model(epochs, worker_logger_callback=injector)
    fm.train(epochs, BATCH, 2, effective_batch_size=GLOBAL, seed=SEED, run_dir=run_dir)
    assert (tmp_path / "fault-0").exists()
    assert max_rel_diff(model.state_dict(), reference) < 1e-5
    assert scheduler.get_last_lr() == pytest.approx(last_lr, rel=1e-12)
    assert scheduler.last_epoch == epochs * STEPS

    resumed_dir = tmp_path / "resumed"
    first, _, _ = scheduled_model(epochs)
    first.train(2, BATCH, 1, effective_batch_size=GLOBAL, seed=SEED, run_dir=resumed_dir)
    second, model, scheduler = scheduled_model(epochs)  # a fresh scheduler: its state comes from the checkpoint
    second.train(epochs, BATCH, 1, effective_batch_size=GLOBAL, run_dir=resumed_dir, resume=True)
    assert max_rel_diff(model.state_dict(), reference) < 1e-5
    assert scheduler.get_last_lr() == pytest.approx(last_lr, rel=1e-12)


class LogsRecorder(Callback):
    """Writes each ``on_epoch_end``'s logs to a file per worker process."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        with open(os.path.join(self.directory, f"logs-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps({"epoch": epoch, **(logs or {})}) + "\n")


@pytest.mark.processes
def test_early_stopping_stops_every_replica_at_the_same_step(run_dir, tmp_path):
    """A min_delta nothing can beat: the first epoch sets the best, the second fails to improve
    and patience=1 stops there, on both workers, one of them a replacement for a killed worker;
    the callbacks saw the driver's training averages and validation metrics as ``logs``."""
    logs_dir = tmp_path / "logs"
    logs_dir.mkdir()
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(
        model,
        lambda: (DATA, TEST),
        F.cross_entropy,
        opt,
        # The replacement joins mid-epoch 1: it pulls the EarlyStopping state and the epoch's sums.
        worker_logger_callback=FaultInjector([Kill(worker=1, step=3), HoldForJoin(13)], tmp_path),
        user_callback=[LogsRecorder(str(logs_dir)), EarlyStopping(monitor="val_loss", patience=1, min_delta=1e9)],
    )
    result = fm.train(6, BATCH, 2, effective_batch_size=GLOBAL, seed=SEED, run_dir=run_dir)
    assert [h["epoch"] for h in result.history] == [0, 1]
    assert [h["epoch"] for h in result.test_history] == [0, 1]
    assert len(result.replica_digests) == 2 and len(set(result.replica_digests.values())) == 1
    assert records(run_dir, "end")[-1]["stopped_after_epoch"] == 1
    generations = records(run_dir, "generation")
    assert len(generations) == 3 and len(generations[-1]["members"]) == 2  # start, the kill, the join
    for path in logs_dir.iterdir():  # every worker that reached an epoch's end saw the same logs
        for line in path.read_text().splitlines():
            logs = json.loads(line)
            epoch = logs["epoch"]
            assert logs["loss"] == pytest.approx(result.history[epoch]["loss"], rel=1e-9)
            assert logs["val_loss"] == pytest.approx(result.test_history[epoch]["loss"], rel=1e-9)
            assert logs["val_accuracy"] == pytest.approx(result.test_history[epoch]["accuracy"], rel=1e-9)


class StopAfter(Callback):
    """Stops training after global step ``last``; the stop travels in its state, so a joining
    worker's copy says it too."""

    def __init__(self, last: int) -> None:
        self.last = last

    def state_dict(self) -> dict[str, bool]:
        return {"stop_training": self.stop_training}

    def load_state_dict(self, state: dict[str, bool]) -> None:
        self.stop_training = state["stop_training"]

    def on_batch_end(self, step: int) -> None:
        context = worker_context()
        if context is not None and context.global_step >= self.last:
            self.stop_training = True


@pytest.mark.processes
def test_a_stop_at_the_step_a_join_follows_ends_training_there(run_dir, tmp_path):
    """The join a hold after step 4 lets in is voted at step 5, where the callback stops: the stop
    wins, training ends after step 5 (the switch went first once, and the new generation took one
    more step before its members asked their callbacks)."""
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(
        model,
        lambda: (DATA, None),
        F.cross_entropy,
        opt,
        worker_logger_callback=FaultInjector([Kill(worker=1, step=1), HoldForJoin(4)], tmp_path),
        user_callback=[StopAfter(5)],
    )
    fm.train(2, BATCH, 2, effective_batch_size=GLOBAL, seed=SEED, run_dir=run_dir)
    assert [r["iteration"] for r in records(run_dir, "train")] == [1, 2, 3, 4, 5, 6]
    assert records(run_dir, "end")[-1]["stopped_after_epoch"] == 0  # inside the first epoch


class StopsAt:
    """A driver logger that asks ``fm`` to stop once it sees step ``iteration`` committed."""

    def __init__(self, iteration: int) -> None:
        self.iteration, self.fm, self.seen = iteration, None, []

    def record_step(self, metrics, iteration, epoch, workers) -> None:
        self.seen.append(iteration)
        if iteration == self.iteration:
            self.fm.stop_training()


@pytest.mark.processes
def test_stop_training_from_the_caller_ends_at_a_completed_step_with_its_state(run_dir, tmp_path):
    """``stop_training()`` from a driver logger after step 3, on two deterministic workers: train()
    returns normally at a step every worker completed, each step recorded once, and the weights are
    bitwise those of a run that a callback stopped after the same number of steps."""
    model, opt = fresh_model_and_optimizer()
    logger = StopsAt(3)
    fm = FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt, driver_logger_callback=logger)
    logger.fm = fm
    fm.train(3, BATCH, 2, effective_batch_size=GLOBAL, seed=SEED, run_dir=run_dir, deterministic=True)
    done = [r["iteration"] for r in records(run_dir, "train")]
    assert 3 <= len(done) < 3 * STEPS and done == list(range(1, len(done) + 1))
    assert logger.seen == done and records(run_dir, "end")[-1]["iteration"] == len(done)

    reference, ref_opt = fresh_model_and_optimizer()
    fm2 = FabricModel(
        reference, lambda: (DATA, None), F.cross_entropy, ref_opt, user_callback=[StopAfter(len(done) - 1)]
    )
    fm2.train(3, BATCH, 1, effective_batch_size=GLOBAL, seed=SEED, run_dir=tmp_path / "ref", deterministic=True)
    assert [r["iteration"] for r in records(tmp_path / "ref", "train")] == done
    for name, tensor in reference.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


class StopsAtBegin:
    """A driver logger that asks ``fm`` to stop before any worker has started."""

    fm = None

    def on_train_begin(self) -> None:
        self.fm.stop_training()


@pytest.mark.processes
def test_stop_training_asked_before_the_workers_start_waits_for_them_and_ends_normally(run_dir):
    model, opt = fresh_model_and_optimizer()
    logger = StopsAtBegin()
    fm = FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt, driver_logger_callback=logger)
    logger.fm = fm
    result = fm.train(3, BATCH, 2, effective_batch_size=GLOBAL, seed=SEED, run_dir=run_dir)
    done = records(run_dir, "end")[-1]["iteration"]
    assert done == len(records(run_dir, "train")) < 3 * STEPS and (run_dir / "model").is_dir()
    assert len(result.history.history.get("loss", [])) <= done // STEPS


@pytest.mark.processes
def test_best_checkpoints_are_kept_and_evaluate_and_predict_use_the_trained_model(run_dir):
    """keep_checkpoints=1 with the best by val_loss in "max" mode (the worst, so it is an old one):
    the best epoch's checkpoint stays next to the newest, named in best.json. Then evaluate() gives
    the last validation's numbers and predict() the model's outputs."""
    model, opt = fresh_model_and_optimizer()
    best = BestCheckpoints("val_loss", "max", keep=1)
    fm = FabricModel(model, lambda: (DATA, TEST), F.cross_entropy, opt, user_callback=[best])
    result = fm.train(4, BATCH, 1, effective_batch_size=GLOBAL, seed=SEED, run_dir=run_dir, keep_checkpoints=1)
    units_per_epoch = STEPS + 1
    losses = [t["loss"] for t in result.test_history]
    best_epoch = max(range(4), key=lambda e: (losses[e], -e))
    kept = [u for u, _ in list_checkpoints(run_dir / "checkpoints")]
    assert kept == sorted({(best_epoch + 1) * units_per_epoch - 1, 4 * units_per_epoch - 1})
    record = json.loads((run_dir / "checkpoints" / "best.json").read_text())
    assert record["monitor"] == "val_loss" and record["mode"] == "max"
    assert record["best"][0]["unit"] == (best_epoch + 1) * units_per_epoch - 1
    assert record["best"][0]["value"] == pytest.approx(losses[best_epoch])

    evaluated = fm.evaluate()  # the test dataset of datasets_function
    assert evaluated == pytest.approx({k: v for k, v in result.test_history[-1].items() if k != "epoch"}, rel=1e-5)
    outputs = fm.predict(TEST, batch_size=16)
    assert model.training  # left as it was
    with torch.no_grad():
        expected = model.eval()(torch.stack([x for x, _ in TEST]))
    assert outputs.shape == (40, 3) and torch.allclose(outputs, expected, atol=1e-6)


@pytest.mark.processes
def test_feature_arguments_fail_in_the_caller_naming_the_argument(run_dir):
    model, opt = fresh_model_and_optimizer()
    _, other = fresh_model_and_optimizer()
    with pytest.raises(ValueError, match="`lr_scheduler` to be built on the optimizer"):
        FabricModel(model, lambda: (DATA, TEST), F.cross_entropy, opt, lr_scheduler=one_cycle(other, 1))
    with pytest.raises(ValueError, match="interval"):
        FabricModel(
            model,
            lambda: (DATA, TEST),
            F.cross_entropy,
            opt,
            lr_scheduler={"scheduler": one_cycle(opt, 1), "interval": "x"},
        )
    fm = FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt, user_callback=[EarlyStopping("val_loss")])
    with pytest.raises(ValueError, match="user_callback EarlyStopping.*val_ metrics need a test dataset"):
        fm.train(1, BATCH, 1, run_dir=run_dir)
    fm = FabricModel(model, lambda: (DATA, TEST), F.cross_entropy, opt, user_callback=[BestCheckpoints("val_f1")])
    with pytest.raises(ValueError, match="`user_callback BestCheckpoints` to be one of"):
        fm.train(1, BATCH, 1, run_dir=run_dir)
    with pytest.raises(ValueError, match="`mode` to be 'min', 'max' or 'auto'"):
        BestCheckpoints("val_loss", "best")
    fm = FabricModel(model, lambda: (DATA, TEST), F.cross_entropy, opt)
    with pytest.raises(RuntimeError, match="call train\\(\\) first"):
        fm.evaluate(TEST)
    assert not run_dir.exists()  # nothing started


def test_the_loop_state_round_trips_through_weights_only_and_logs_reach_only_who_takes_them():
    """No processes: the scheduler (ReduceLROnPlateau on logs), the epoch's sums and EarlyStopping's
    state survive torch.save / torch.load(weights_only=True) inside the optimizer state; on_epoch_end
    gets ``logs`` only where it has a ``logs`` parameter (IBM's signature is called with the epoch)."""
    import io

    from fabric_model.run.hooks import Hooks
    from fabric_model.step.loop_state import LoopState, check_lr_scheduler

    def make():
        model, opt = fresh_model_and_optimizer()
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        scheduling = check_lr_scheduler(plateau, opt, "torch")
        return opt, plateau, LoopState(["loss", "accuracy"], scheduling, [EarlyStopping("val_loss")])

    opt, plateau, state = make()
    state.step_done(0, [6.0, 3.0, 4.0])
    state.step_done(0, [2.0, 1.0, 4.0])
    logs = state.epoch_logs(0, [1.0, 2.0, 4.0])
    assert logs == {"loss": 1.0, "accuracy": 0.5, "val_loss": 0.25, "val_accuracy": 0.5}
    for value in (1.0, 2.0):  # no better: the learning rate halves
        state.epoch_done({"val_loss": value})
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    state.callbacks[0].on_epoch_end(0, {"val_loss": 1.0})
    state.callbacks[0].on_epoch_end(1, {"val_loss": 2.0})
    assert state.should_stop(None)

    buffer = io.BytesIO()
    torch.save(state.pack(opt.state_dict()), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    other_opt, other_plateau, other = make()
    other_opt.load_state_dict(other.unpack(loaded))
    assert other_plateau.state_dict() == plateau.state_dict() and other_opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert other.epoch_logs(0, None) == {"loss": 1.0, "accuracy": 0.5}
    assert other.callbacks[0].state_dict() == state.callbacks[0].state_dict()

    class Ibm(Callback):
        def on_epoch_end(self, epoch, save_model=False):
            self.saw = (epoch, save_model)

    class Keras(Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.saw = (epoch, logs)

    ibm, keras_style = Ibm(), Keras()
    Hooks([], [ibm, keras_style]).on_epoch_end(3, {"loss": 1.0})
    assert ibm.saw == (3, False) and keras_style.saw == (3, {"loss": 1.0})
