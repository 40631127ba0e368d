"""Elastic membership (docs/architecture.md, "Elasticity"): workers die, hang and join; the result does not change."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.step.plan import Plan
from fabric_model.testing import FailCollective, FaultInjector, Hang, HoldForJoin, Kill, WorkerStarter

from .helpers import (
    fresh_model_and_optimizer,
    make_data,
    max_rel_diff,
    records,
    reference_train,
    sample_indices_of_steps,
)

pytestmark = pytest.mark.processes

SEED, EPOCHS, BATCH, GLOBAL = 99, 3, 8, 24
DATA = make_data(240)  # 10 steps an epoch, 30 in all
PLAN = Plan(len(DATA), BATCH, GLOBAL // BATCH, SEED)
TOTAL_STEPS = EPOCHS * PLAN.steps_per_epoch


@pytest.fixture(scope="module")
def undisturbed():
    model, opt = fresh_model_and_optimizer()
    reference_train(model, opt, DATA, seed=SEED, epochs=EPOCHS, batch_size=BATCH, micro_batches=GLOBAL // BATCH)
    return copy.deepcopy(model.state_dict())


@pytest.fixture(scope="module")
def undisturbed_adam(tmp_path_factory):
    # Adam divides by sqrt(v), which magnifies float32 summation-order noise in near-zero
    # gradients (2 workers sum (g0 + g2) + g1, one worker (g0 + g1) + g2) by a factor that
    # depends on the CPU's kernels (5e-4 relative on one machine, under 1e-4 on another); with
    # deterministic=True the comparison is exact on any machine.
    run_dir = tmp_path_factory.mktemp("adam")
    model, _ = train(run_dir / "run", run_dir, workers=2, adam=True, deterministic=True)
    return copy.deepcopy(model.state_dict())


@pytest.fixture
def no_replacement(monkeypatch):
    monkeypatch.setenv("EDT_REPLACE_WORKERS", "0")


def train(
    run_dir, marker_dir, faults=(), joins=(), workers=3, adam=False, step_delay=0.0, driver_logger=None, **kwargs
):
    model, opt = fresh_model_and_optimizer(adam=adam)
    injector = FaultInjector(faults, marker_dir, step_delay=step_delay)
    starter = WorkerStarter(run_dir, joins, inner=driver_logger)
    try:
        result = FabricModel(
            model,
            lambda: (DATA, DATA[:40]),
            F.cross_entropy,
            opt,
            worker_logger_callback=injector,
            driver_logger_callback=starter,
        ).train(EPOCHS, BATCH, workers, effective_batch_size=GLOBAL, seed=SEED, run_dir=run_dir, **kwargs)
    finally:
        starter.close()
    return model, result


def assert_invariants(run_dir, result, model, reference, tolerance=1e-5):
    train_records = records(run_dir, "train")
    steps = sorted((r["epoch"], r["step"]) for r in train_records)
    assert steps == sorted((e, s) for e in range(EPOCHS) for s in range(PLAN.steps_per_epoch))  # each step once
    used = sample_indices_of_steps(PLAN, train_records)
    for epoch in range(EPOCHS):
        assert sorted(used[epoch]) == list(range(len(DATA))), f"epoch {epoch}: not every sample exactly once"
    assert len(set(result.replica_digests.values())) == 1, result.replica_digests
    assert max_rel_diff(model.state_dict(), reference) <= tolerance


def generations(run_dir):
    return records(run_dir, "generation")


@pytest.mark.parametrize("seed", range(10))
def test_kill_join_kill_keeps_the_result(seed, undisturbed, run_dir, tmp_path, no_replacement):
    rng = random.Random(seed)
    first, second = rng.sample([0, 1, 2], 2)
    kill1 = rng.randrange(1, 8)
    join_at = kill1 + rng.randrange(1, 3)  # the driver starts a worker once join_at steps are committed
    kill2 = rng.randrange(join_at + 3, 26)  # the join lands after step join_at + 1 (HoldForJoin)
    faults = [
        Kill(first, kill1, rng.choice(["before_allreduce", "after_step"])),
        HoldForJoin(join_at),
        Kill(second, kill2),
    ]
    model, result = train(run_dir, tmp_path, faults, joins=[join_at])
    assert_invariants(run_dir, result, model, undisturbed)
    sizes = [g["workers"] for g in generations(run_dir)]
    assert sizes[0] == 3 and 2 in sizes and sizes.count(3) >= 2, f"kill, join, kill not all seen: {sizes}"


def test_hung_worker_is_removed_within_the_bound(undisturbed, run_dir, tmp_path, monkeypatch, no_replacement):
    monkeypatch.setenv("EDT_HEARTBEAT_TIME_OUT", "3")
    model, result = train(run_dir, tmp_path, [Hang(1, 4)])
    assert_invariants(run_dir, result, model, undisturbed)
    gens = generations(run_dir)
    assert any("heartbeat" in g["reason"] for g in gens), gens
    hung_at = next(r["time"] for r in records(run_dir, "train") if r["epoch"] == 0 and r["step"] == 3)
    removed_at = next(g["time"] for g in gens if "heartbeat" in g["reason"])
    assert removed_at - hung_at < 3 + 5  # the bound, plus slack for a loaded machine


def test_all_but_one_killed(undisturbed, run_dir, tmp_path, no_replacement):
    model, result = train(run_dir, tmp_path, [Kill(0, 3), Kill(2, 11, "after_step")])
    assert_invariants(run_dir, result, model, undisturbed)
    assert generations(run_dir)[-1]["workers"] == 1
    assert len(result.replica_digests) == 1


def test_failed_collective_is_retried_by_the_same_workers(undisturbed, run_dir, tmp_path):
    model, result = train(run_dir, tmp_path, [FailCollective(1, 6)])
    assert_invariants(run_dir, result, model, undisturbed)
    assert [g["workers"] for g in generations(run_dir)] == [3, 3]


def test_a_lost_worker_is_replaced(undisturbed, run_dir, tmp_path):
    model, result = train(run_dir, tmp_path, [Kill(1, 2), HoldForJoin(3)])
    assert_invariants(run_dir, result, model, undisturbed)
    sizes = [g["workers"] for g in generations(run_dir)]
    assert sizes[:2] == [3, 2] and sizes[-1] == 3, sizes  # the replacement joined
    assert len(result.replica_digests) == 3


def test_join_moves_adam_state(undisturbed_adam, run_dir, tmp_path, no_replacement):
    faults = [Kill(1, 2), HoldForJoin(4)]
    model, result = train(run_dir, tmp_path, faults, joins=[4], workers=2, adam=True, deterministic=True)
    assert_invariants(run_dir, result, model, undisturbed_adam, tolerance=0.0)  # bitwise: the joiner pulled the moments
    sizes = [g["workers"] for g in generations(run_dir)]
    assert sizes[-1] == 2 and 1 in sizes, sizes
    assert any(g["source_rank"] >= 0 for g in generations(run_dir))  # state was pulled


def loss_failing_on_rank0_of_step5(output, target):
    from fabric_model import worker_context

    ctx = worker_context()
    if ctx is not None and ctx.global_step == 5 and ctx.rank == 0:
        raise ValueError("bad batch at step 5")
    return F.cross_entropy(output, target)


def test_same_user_error_again_and_again_fails_the_job(run_dir):
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(model, lambda: (DATA, None), loss_failing_on_rank0_of_step5, opt)
    with pytest.raises(ValueError, match="bad batch at step 5"):
        fm.train(EPOCHS, BATCH, 3, seed=SEED, run_dir=run_dir)
    assert torch.is_tensor(next(model.parameters()))
