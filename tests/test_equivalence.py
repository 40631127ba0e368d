"""Data-parallel training gives the single-process result: see docs/architecture.md, "Invariants" (1, 2, 4)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.step.plan import Plan

from .helpers import (
    IndexRecordingDataset,
    accuracy,
    fresh_model_and_optimizer,
    make_data,
    max_rel_diff,
    reads_by_pid,
    records,
    reference_train,
    sample_indices_of_steps,
)

pytestmark = pytest.mark.processes

SEED, EPOCHS, BATCH, GLOBAL = 1234, 2, 16, 48  # 250 samples: the last step of each epoch is short
DATA = make_data(250)


@pytest.fixture(scope="module")
def reference_state():
    model, opt = fresh_model_and_optimizer()
    reference_train(model, opt, DATA, seed=SEED, epochs=EPOCHS, batch_size=BATCH, micro_batches=GLOBAL // BATCH)
    return copy.deepcopy(model.state_dict())


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_weights_equal_single_process_loop(workers, reference_state, run_dir, tmp_path):
    reads = tmp_path / "reads"
    reads.mkdir()
    dataset = IndexRecordingDataset(DATA, str(reads))
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(model, lambda: (dataset, DATA[:50]), F.cross_entropy, opt, metrics=[accuracy])
    result = fm.train(
        EPOCHS, BATCH, workers, effective_batch_size=GLOBAL, seed=SEED, run_dir=run_dir, num_dataloader_threads=2
    )

    # Invariant 2: the user's model holds the trained weights, equal to the reference loop's.
    assert max_rel_diff(model.state_dict(), reference_state) <= 1e-5
    # Invariant 4: all replicas end identical (weights and optimizer state).
    assert len(result.replica_digests) == workers
    assert len(set(result.replica_digests.values())) == 1
    # Invariant 1: every sample exactly once per epoch, by the committed steps' own reports...
    plan = Plan(len(DATA), BATCH, GLOBAL // BATCH, SEED)
    train = records(run_dir, "train")
    assert len(train) == EPOCHS * plan.steps_per_epoch
    assert {r["workers"] for r in train} == {workers}
    used = sample_indices_of_steps(plan, train)
    for epoch in range(EPOCHS):
        assert sorted(used[epoch]) == list(range(len(DATA)))
    # ...and by what the workers actually read from the dataset (the caller reads sample 0 once
    # to check it; every worker read comes from its plan).
    worker_reads = [i for pid, idx in reads_by_pid(reads).items() if pid != os.getpid() for i in idx]
    assert sorted(worker_reads) == sorted(list(range(len(DATA))) * EPOCHS)


def test_optimizer_state_returns_to_the_caller(run_dir):
    model, opt = fresh_model_and_optimizer()
    FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt).train(1, BATCH, 2, seed=SEED, run_dir=run_dir)
    momentum = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    assert all(m is not None and m.abs().sum() > 0 for m in momentum)


class BNNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(12, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def test_batchnorm_statistics_do_not_depend_on_worker_count(tmp_path):
    """Buffers follow the step rule: float ones the sample-weighted mean of the step's micro-batches'
    changes, integer counters the sum (one per micro-batch, as a plain accumulation loop counts)."""
    states = []
    for workers in (1, 3):
        torch.manual_seed(0)
        model = BNNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt).train(
            1, BATCH, workers, effective_batch_size=GLOBAL, seed=SEED, run_dir=tmp_path / f"w{workers}"
        )
        states.append(model.state_dict())
    assert max_rel_diff(states[1], states[0]) <= 1e-5
    plan = Plan(len(DATA), BATCH, 3, SEED)
    micro_batches = sum(plan.num_micro_batches(0, step) for step in range(plan.steps_per_epoch))
    assert int(states[0]["bn.num_batches_tracked"]) == int(states[1]["bn.num_batches_tracked"]) == micro_batches


class UnusedAndConstants(torch.nn.Module):
    """A parameter the forward never uses, and buffers the forward never changes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(12, 3)
        self.unused = torch.nn.Linear(3, 3)
        self.register_buffer("counter", torch.tensor([2**25 + 1], dtype=torch.int64))
        self.register_buffer("third", torch.tensor([1 / 3], dtype=torch.float64))
        self.register_buffer("scale", torch.tensor([0.7]))

    def forward(self, x):
        return self.fc(x) * self.scale


def test_untouched_parameters_and_buffers_stay_exact(run_dir):
    torch.manual_seed(0)
    model = UnusedAndConstants()
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt).train(2, BATCH, 2, seed=SEED, run_dir=run_dir)
    after = model.state_dict()
    # As on one device after zero_grad(): no gradient, so neither weight decay nor momentum moves it.
    assert torch.equal(after["unused.weight"], before["unused.weight"])
    assert not torch.equal(after["fc.weight"], before["fc.weight"])
    for name in ("counter", "third", "scale"):
        assert torch.equal(after[name], before[name]) and after[name].dtype == before[name].dtype, name
