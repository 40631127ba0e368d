"""The pure parts, no processes: plan, engine sizing, averaging, digests, errors."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

from fabric_model.errors import RemoteTraceback, WorkerError, encode_exception, rebuild_exception
from fabric_model.setup.config import size_engines, threads_per_worker
from fabric_model.step.digest import state_digest
from fabric_model.step.metrics import EpochAverage, stat_means
from fabric_model.step.plan import (
    MicroBatchSeeds,
    Plan,
    assigned_micro_batches,
    epoch_permutation,
    eval_batches,
    generator_seed,
    micro_batch_seed,
    micro_batch_seeds,
)


def test_plan_cuts_every_epoch_into_exactly_once_micro_batches():
    plan = Plan(num_samples=103, items_per_micro_batch=8, micro_batches=3, seed=7)
    assert plan.global_batch == 24 and plan.steps_per_epoch == 5
    assert plan.step_samples(0, 4) == 7 and plan.num_micro_batches(0, 4) == 1
    for epoch in range(2):
        seen = [
            int(i)
            for s in range(plan.steps_per_epoch)
            for j in range(plan.num_micro_batches(epoch, s))
            for i in plan.micro_batch_indices(epoch, s, j)
        ]
        assert sorted(seen) == list(range(103))


def test_permutation_depends_on_seed_and_epoch_only():
    a = epoch_permutation(1, 0, 50)
    assert np.array_equal(a, epoch_permutation(1, 0, 50))
    assert not np.array_equal(a, epoch_permutation(1, 1, 50))
    assert not np.array_equal(a, epoch_permutation(2, 0, 50))


@pytest.mark.parametrize("seed", [0, 7, 2**31 - 1, 2**32 - 1, 2**32, 2**45 + 3])
def test_the_seeds_of_a_block_of_steps_are_micro_batch_seed_s(seed):
    """The loop looks seeds up in a table made a block of steps at a time (vectorised
    SeedSequence arithmetic): each must be micro_batch_seed's, or runs would change."""
    rng = np.random.default_rng(seed % 1000)
    for epoch in (0, 1, 2**32 - 1, int(rng.integers(1, 10**6))):
        steps = np.concatenate([np.arange(5), rng.integers(0, 2**32, size=5)])
        table = micro_batch_seeds(seed, epoch, steps, 3)
        assert table.tolist() == [[micro_batch_seed(seed, epoch, int(s), j) for j in range(3)] for s in steps]
    plan = Plan(num_samples=50_000, items_per_micro_batch=4, micro_batches=3, seed=seed)  # 4,167 steps: 5 blocks
    seeds = MicroBatchSeeds(plan)
    for epoch, step, j in ((0, 0, 0), (0, 2100, 2), (0, 4166, 1), (1, 3, 1), (0, 5, 0)):  # blocks, epochs, back
        assert seeds(epoch, step, j) == micro_batch_seed(seed, epoch, step, j)


def test_micro_batch_seeds_are_distinct_and_stable():
    seeds = {micro_batch_seed(0, e, s, j) for e in range(3) for s in range(10) for j in range(4)}
    assert len(seeds) == 120
    assert micro_batch_seed(5, 1, 2, 3) == micro_batch_seed(5, 1, 2, 3)
    assert all(0 <= s < 2**63 for s in seeds)


def test_generator_seeds_differ_by_name_and_micro_batch_and_are_stable():
    seeds = [micro_batch_seed(0, 0, s, 0) for s in range(50)]
    names = ["noise", "block.noise", "blocks.0.gen", "blocks.1.gen"]
    derived = {generator_seed(s, n) for s in seeds for n in names}
    assert len(derived) == 200 and not derived & set(seeds)  # no stream shared, none the global one's
    assert all(0 <= d < 2**63 for d in derived)
    assert generator_seed(seeds[3], "noise") == generator_seed(seeds[3], "noise")


def test_the_generators_a_model_owns_are_found_once_each_by_their_path():
    import torch

    from fabric_model.frameworks.torch.generators import OwnedGenerators, owned_generators

    shared = torch.Generator()

    class Leaf(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gen = shared
            self.pool = [torch.Generator(), 3]
            self.by_name = {"a": torch.Generator()}

    class Top(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.noise = torch.Generator()
            self.blocks = torch.nn.ModuleList([Leaf(), Leaf()])

    model = Top()
    names = [n for n, _ in owned_generators(model)]
    assert names == [
        "noise",
        "blocks.0.gen",
        "blocks.0.pool.0",
        "blocks.0.by_name.a",
        "blocks.1.pool.0",
        "blocks.1.by_name.a",
    ]
    owned = OwnedGenerators(model)
    owned.seed(12345)
    first = torch.rand(3, generator=model.blocks[1].pool[0])
    owned.seed(12345)
    assert torch.equal(torch.rand(3, generator=model.blocks[1].pool[0]), first)
    assert not OwnedGenerators(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("k", [1, 2, 3, 5, 7])
def test_assignment_divides_micro_batches_among_any_worker_count(k):
    got = sorted(j for r in range(k) for j in assigned_micro_batches(5, r, k))
    assert got == list(range(5))


def test_eval_batches_cover_the_test_set_once():
    got = sorted(int(i) for r in range(3) for b in eval_batches(50, 8, r, 3) for i in b)
    assert got == list(range(50))


def test_engine_sizing():
    assert size_engines(32, 2, None) == type(size_engines(32, 2, None))(2, 2, 64)
    s = size_engines(32, None, 128)
    assert (s.micro_batches, s.max_workers, s.global_batch) == (4, 4, 128)
    s = size_engines(32, 2, 128)  # fewer workers than micro-batches: accumulation
    assert (s.micro_batches, s.max_workers, s.global_batch) == (4, 2, 128)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = size_engines(32, 8, 128)
    assert (s.micro_batches, s.max_workers) == (4, 4) and "exceeds" in str(caught[0].message)
    assert size_engines(16, None, None).max_workers >= 1


def test_threads_are_shared_fairly():
    assert threads_per_worker(2, cpu_count=2) == 1
    assert threads_per_worker(3, cpu_count=16) == 5
    assert threads_per_worker(4, cpu_count=2) == 1


def test_epoch_average_is_sample_weighted_and_resets_each_epoch():
    avg = EpochAverage(["loss", "acc"])
    avg.add(0, [10.0, 5.0, 10])  # 10 samples, mean loss 1.0
    got = avg.add(0, [30.0, 0.0, 10])  # 10 samples, mean loss 3.0
    assert got == {"loss": 2.0, "acc": 0.25}
    assert avg.add(1, [4.0, 4.0, 4]) == {"loss": 1.0, "acc": 1.0}
    assert stat_means(["loss"], [0.0, 0]) != stat_means(["loss"], [0.0, 0])  # nan when empty


def test_digest_sees_every_value():
    import torch

    a = {"w": torch.ones(3), "opt": {"step": 1}}
    assert state_digest(a) == state_digest({"w": torch.ones(3), "opt": {"step": 1}})
    assert state_digest(a) != state_digest({"w": torch.tensor([1.0, 1.0, 1.0 + 1e-7]), "opt": {"step": 1}})
    assert state_digest(a) != state_digest({"w": torch.ones(3), "opt": {"step": 2}})


def test_rebuilt_exception_keeps_type_and_remote_traceback():
    exc = rebuild_exception(encode_exception(KeyError("x")), "Traceback...\nKeyError: 'x'", "worker 1")
    assert isinstance(exc, KeyError) and isinstance(exc.__cause__, RemoteTraceback)
    assert "worker 1 failed" in exc.__cause__.text

    class Unpicklable(Exception):
        def __init__(self, a, b):
            super().__init__(a)

    exc = rebuild_exception(encode_exception(Unpicklable(1, 2)), "Traceback...\nUnpicklable: 1", "worker 0")
    assert isinstance(exc, WorkerError) and "Unpicklable: 1" in str(exc)


def _cap(requested: int, **kw: int | None) -> tuple[int, str, bool]:
    from fabric_model.setup.devices import cap_workers

    c = cap_workers(requested, **kw)  # type: ignore[arg-type]
    return c.workers, c.device, c.capped


def test_engines_number_is_a_cap_on_the_devices():
    """IBM's engines_number is the most devices a job may use; the global batch is kept by accumulation."""
    from fabric_model.setup.devices import cap_workers

    cap = cap_workers(16, gpus=0, cores=2, cpu_workers=None)  # a script's default of 16 on a 2-core host
    assert (cap.workers, cap.device, cap.capped) == (2, "cpu", True)
    assert "starting 2 workers on CPU" in cap.line and "FABRIC_MODEL_CPU_WORKERS" in cap.line
    assert _cap(16, gpus=4, cores=2, cpu_workers=None) == (4, "gpu", True)
    assert _cap(2, gpus=8, cores=2, cpu_workers=None) == (2, "gpu", False)
    assert _cap(3, gpus=0, cores=2, cpu_workers=3) == (3, "cpu", False)  # asked for explicitly
    assert _cap(1, gpus=0, cores=1, cpu_workers=None) == (1, "cpu", False)
    s = size_engines(32, 16, None)  # the plan keeps 16 micro-batches whatever the cap
    assert (s.micro_batches, s.global_batch) == (16, 512)


def test_workers_may_share_a_gpu_and_then_reduce_over_gloo(monkeypatch):
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): shared GPUs reduce over gloo."""
    from fabric_model.setup.devices import cap_workers, collective_backend, workers_per_gpu

    assert _cap(3, gpus=1, cores=2, cpu_workers=None, per_gpu=2) == (2, "gpu", True)
    assert _cap(2, gpus=1, cores=2, cpu_workers=None, per_gpu=2) == (2, "gpu", False)
    assert "FABRIC_MODEL_WORKERS_PER_GPU" in cap_workers(2, gpus=1, cores=2, cpu_workers=None).line
    assert (collective_backend(1), collective_backend(4), collective_backend(0)) == ("nccl", "nccl", "gloo")
    assert collective_backend(1, per_gpu=2) == "gloo"
    assert workers_per_gpu() == 1
    monkeypatch.setenv("FABRIC_MODEL_WORKERS_PER_GPU", "0")
    with pytest.raises(ValueError, match="FABRIC_MODEL_WORKERS_PER_GPU='0'"):
        workers_per_gpu()


def test_cpu_workers_variable_is_checked(monkeypatch):
    from fabric_model.setup.devices import cpu_workers_from_environment

    monkeypatch.setenv("FABRIC_MODEL_CPU_WORKERS", "3")
    assert cpu_workers_from_environment() == 3
    monkeypatch.setenv("FABRIC_MODEL_CPU_WORKERS", "many")
    with pytest.raises(ValueError, match="FABRIC_MODEL_CPU_WORKERS='many'"):
        cpu_workers_from_environment()
    monkeypatch.delenv("FABRIC_MODEL_CPU_WORKERS")
    assert cpu_workers_from_environment() is None


def test_workers_get_cuda_visible_devices_as_the_process_started(monkeypatch):
    """A script's CUDA_VISIBLE_DEVICES="" is its driver's own; a value from before the process started is kept."""
    from fabric_model.setup import devices

    monkeypatch.setattr(devices, "_CUDA_VISIBLE_AT_START", "0,1")
    assert devices.cuda_visible_for_workers("0,1") == (False, "0,1")  # a cluster's allocation
    assert devices.cuda_visible_for_workers("") == (True, "0,1")  # the script hid the GPUs from itself
    monkeypatch.setattr(devices, "_CUDA_VISIBLE_AT_START", None)
    assert devices.cuda_visible_for_workers("") == (True, None)  # unset again for the workers
    assert devices.cuda_visible_for_workers(None) == (False, None)


def test_the_step_vote_says_whether_to_switch_and_how_many_members_leave():
    """A join vote is 1, a leave vote 1 + LEAVE_VOTE (docs/architecture.md, "Preemption"); the
    float32 sum of a step's votes tells both apart. Rank 0's snapshot vote has its own element."""
    import torch

    from fabric_model.step.layout import LEAVE_VOTE, StepLayout

    layout = StepLayout(0, 0, 0, 1)
    for joins, leaves in [(0, 0), (3, 0), (0, 1), (2, 3), (0, 7)]:
        tail = torch.zeros(layout.size, dtype=torch.float32)
        tail[layout.vote] = sum(
            [torch.tensor(1.0)] * joins + [torch.tensor(1.0 + LEAVE_VOTE)] * leaves, torch.tensor(0.0)
        )
        tail[layout.computed] = joins + leaves  # the micro-batches computed, summed alike
        result = layout.result(tail.tolist())
        assert (result.switch, result.leaving) == (joins + leaves > 0, leaves) and not result.snapshot
        assert result.micro_batches == joins + leaves and len(result.stats) == 2  # the loss sum, the count
        # Rank 0's snapshot vote (a sharded state's gather) rides beside them, switching nothing.
        tail[layout.snapshot] = 1.0
        result = layout.result(tail.tolist())
        assert result.snapshot and (result.switch, result.leaving) == (joins + leaves > 0, leaves)


def test_one_vote_to_stop_makes_every_member_leave_whatever_the_others_voted():
    """A member told that the job stops (a sharded state's preemption) votes 1 + LEAVE_VOTE +
    STOP_VOTE: with any other votes, of up to 8,000 members, every member leaves."""
    import torch

    from fabric_model.step.layout import EVERYONE, LEAVE_VOTE, STOP_VOTE, StepLayout

    layout = StepLayout(0, 0, 0, 1)
    stop = 1.0 + LEAVE_VOTE + STOP_VOTE
    for joins, leaves, stops in [(0, 0, 1), (5, 2, 1), (0, 0, 3), (0, 7999, 1), (1, 0, 7999)]:
        tail = torch.zeros(layout.size, dtype=torch.float32)
        votes = torch.tensor([1.0] * joins + [1.0 + LEAVE_VOTE] * leaves + [stop] * stops, dtype=torch.float32)
        tail[layout.vote] = votes.sum()
        result = layout.result(tail.tolist())
        assert result.switch and result.leaving == EVERYONE > 8000
    tail = torch.zeros(layout.size, dtype=torch.float32)
    tail[layout.vote] = torch.full((8000,), 1.0 + LEAVE_VOTE).sum()  # leave votes alone never read as a stop
    assert layout.result(tail.tolist()).leaving < EVERYONE


def test_a_plan_reads_back_from_a_record_written_before_its_field_was_renamed():
    """Checkpoints and run.json written when Plan's items per micro-batch were named batch_size still resume."""
    plan = Plan(100, 4, 2, 7)
    record = dataclasses.asdict(plan)
    assert Plan.from_record(record) == plan
    record["batch_size"] = record.pop("items_per_micro_batch")
    assert Plan.from_record(record) == plan
