"""Replicas that diverge end the run early, named, with rank 0's state handed back: see
docs/architecture.md, "Replica checks" (invariant 4).

A callback perturbs one weight on rank 1 only, after one step: the replicas still apply the same
reduced gradient, so from then on exactly that tensor differs. The fast tests of the fingerprint
and of the driver's comparison are in tests/test_replica_checks.py.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F

from fabric_model import Callback, FabricModel, worker_context
from fabric_model.driver.replicas import ReplicaDivergenceError

from .helpers import fresh_model_and_optimizer, make_data, records

pytestmark = pytest.mark.processes

DATA = make_data(240)
BATCH, GLOBAL, EPOCHS = 16, 32, 10  # 8 steps an epoch (the last one short), 2 workers
STEPS_PER_EPOCH = 8
STEP_AT_LEAST = 0.01  # seconds: how far training gets before it stops is then counted in few steps
CHECK_STEPS = 3
PERTURBED_AT = 1  # the global step after which rank 1's fc1.weight moves


class PerturbOnRankOne(Callback):
    """Adds a constant to rank 1's ``fc1.weight`` once, after global step ``at``; every step takes
    ``STEP_AT_LEAST``."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_batch_end(self, step: int) -> None:
        context = worker_context()
        assert context is not None  # in a worker
        if context.rank == 1 and context.global_step == self.at:
            with torch.no_grad():
                self.model.fc1.weight.add_(1e-3)
        time.sleep(STEP_AT_LEAST)


def train_diverging(run_dir, monkeypatch: pytest.MonkeyPatch, check_steps: int, epochs: int):
    """Train 2 workers with rank 1 perturbed; returns the error, the model, its initial state."""
    monkeypatch.setenv("FABRIC_MODEL_DIVERGENCE_CHECK_STEPS", str(check_steps))
    model, opt = fresh_model_and_optimizer()
    initial = copy.deepcopy(model.state_dict())
    fm = FabricModel(
        model, lambda: (DATA, None), F.cross_entropy, opt, user_callback=[PerturbOnRankOne(PERTURBED_AT)], metrics=[]
    )
    with pytest.raises(ReplicaDivergenceError) as caught:
        fm.train(epochs, BATCH, 2, effective_batch_size=GLOBAL, seed=7, run_dir=run_dir, verbose=0)
    return caught.value, model, initial, fm


def assert_handed_back(error: ReplicaDivergenceError, model: torch.nn.Module, initial: dict, run_dir) -> None:
    """Rank 0's state was written as the run's model, loaded into the user's, and the error says so."""
    path = run_dir / "model" / "model.pt"
    assert path.is_file() and error.model_path == str(path)
    assert str(path) in str(error) and "loaded into the model" in str(error)
    assert any(not torch.equal(model.state_dict()[k], initial[k]) for k in initial)  # trained, not initial


@pytest.mark.timeout(90)
def test_a_divergence_is_caught_within_the_first_epoch_named_and_rank_0_s_state_written(run_dir, monkeypatch):
    error, model, initial, fm = train_diverging(run_dir, monkeypatch, CHECK_STEPS, EPOCHS)

    divergence = error.divergence
    assert divergence is not None and divergence.tensors == ["model/fc1.weight"]
    assert "model/fc1.weight" in str(error) and "worker 1 differs from worker 0" in str(error)
    # Compared after global step 2, the first check after the perturbation...
    assert divergence.where == "after epoch 0, step 2 (generation 0)"
    assert "Training stopped; worker 0's state (rank 0, after epoch " in str(error)
    # ...and stopped soon after, long before the end (the driver's Abort reaches the workers within steps).
    assert len(records(run_dir, "train")) < EPOCHS * STEPS_PER_EPOCH // 2
    assert records(run_dir, "end") == []  # the run did not end: it was stopped
    assert_handed_back(error, model, initial, run_dir)
    assert fm.run_dir == run_dir  # download() finds the model written


@pytest.mark.timeout(90)
def test_without_checks_during_training_the_end_names_the_tensor_and_writes_rank_0_s_state(run_dir, monkeypatch):
    error, model, initial, _ = train_diverging(run_dir, monkeypatch, check_steps=0, epochs=1)

    assert error.divergence is not None and error.divergence.tensors == ["model/fc1.weight"]
    assert "at the end of training" in str(error) and "model/fc1.weight" in str(error)
    assert "Worker 0's final state was written to" in str(error)
    assert len(records(run_dir, "train")) == STEPS_PER_EPOCH  # trained to the end
    assert_handed_back(error, model, initial, run_dir)
