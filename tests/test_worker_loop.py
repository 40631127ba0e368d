"""The worker's training loop (``worker/loop.py``) in-process: a real torch adapter and model, with
autospec fakes of the control channel, the inbox and the collective (no process, no socket).

What a user relies on (docs/architecture.md, "The step", "Elasticity"): each step's report names
the micro-batches this member computed; an abort from the driver abandons the step in flight
without a trace on the weights and the next generation redoes it; a voted switch ends the
generation after the step; every generation change re-forms the collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from fabric_model.context import WorkerContext
from fabric_model.frameworks.torch.adapter import TorchAdapter
from fabric_model.run.hooks import Hooks
from fabric_model.setup.config import EngineSizing, SnapshotCadence, Timeouts, TrainConfig
from fabric_model.setup.job import Job
from fabric_model.step.plan import Plan
from fabric_model.transport import protocol as p
from fabric_model.transport.collective import Collective, CollectiveError
from fabric_model.transport.control import Channel
from fabric_model.worker.inbox import REPORT_WITHIN, Inbox
from fabric_model.worker.loop import TrainingLoop

RECOVERY = 7.0  # seconds a worker waits for its next generation (EDT_RECOVERY_TIME_OUT)
SETTINGS = p.CheckpointSettings("checkpoints", "torch", -1)


@pytest.fixture(autouse=True)
def keep_torch_threads() -> Iterator[None]:
    """The adapter sets torch's intra-op threads, as a worker does; the test process keeps its own."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@dataclasses.dataclass
class Worker:
    """A training loop and the fakes it talks through."""

    loop: TrainingLoop
    model: nn.Module
    channel: Any  # an autospec of Channel
    inbox: Any  # an autospec of Inbox
    collective: Any  # an autospec of Collective

    def reports(self) -> list[p.StepDone]:
        """Every step report, held back (``send_soon``) or sent at once, in order."""
        return [c.args[0] for c in self.channel.mock_calls if c.args and isinstance(c.args[0], p.StepDone)]

    def left(self) -> list[p.LeftGeneration]:
        return [c.args[0] for c in self.channel.send.call_args_list if isinstance(c.args[0], p.LeftGeneration)]

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}


def fake_collective(world_size: int) -> Any:
    """A collective whose ``configure`` takes the new group's place, and whose allreduce leaves this
    rank's buffer as the sum (peers adding nothing)."""
    collective = mock.create_autospec(Collective, instance=True)
    collective.generation, collective.rank, collective.world_size = -1, 0, world_size
    collective.device = torch.device("cpu")

    def configure(generation: int, rank: int, world_size: int) -> None:
        collective.generation, collective.rank, collective.world_size = generation, rank, world_size

    collective.configure.side_effect = configure
    collective.all_reduce_start.return_value = None
    collective.wait.return_value = True
    return collective


def make_worker(
    *,
    samples: int = 20,
    batch_size: int = 4,
    micro_batches: int = 2,
    epochs: int = 1,
    world_size: int = 1,
    callbacks: tuple[Any, ...] = (),
) -> Worker:
    """A worker set up as ``worker/main.py`` sets one up, before it enters its first generation."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    adapter = TorchAdapter(model, optimizer, F.cross_entropy, metrics=[])
    adapter.setup("cpu", 1)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(samples, 4, generator=g), torch.randint(0, 3, (samples,), generator=g))
    plan = Plan(samples, batch_size, micro_batches, seed=5)
    timeouts = Timeouts(
        start=5, collective=5, stop=5, heartbeat=5, pull=5, recovery=RECOVERY, pull_failed_limit=1, replace_workers=True
    )
    config = TrainConfig(
        epochs=epochs,
        batch_size=batch_size,
        sizing=EngineSizing(micro_batches, micro_batches, plan.global_batch),
        num_dataloader_threads=0,
        validation_freq=1,
        checkpoint_freq=0,
        timeouts=timeouts,
        snapshots=SnapshotCadence(steps=0, seconds=0, share=0),  # no uploads
        backend="gloo",
    )
    job = Job(adapter=adapter, get_datasets=lambda: (data, None), hooks=Hooks(callbacks=callbacks))
    channel = mock.create_autospec(Channel, instance=True)
    inbox = mock.create_autospec(Inbox, instance=True)
    inbox.pending_generation = inbox.abort_generation = -1  # what the reader thread sets
    inbox.stop_together = None
    collective = fake_collective(world_size)
    loop = TrainingLoop(job, config, plan, channel, inbox, collective, (data, None), WorkerContext(0))
    return Worker(loop, model, channel, inbox, collective)


def entering(generation: int, resume_unit: int, rank: int = 0, world_size: int = 1) -> p.EnterGeneration:
    return p.EnterGeneration(generation, rank, world_size, resume_unit, -1, SETTINGS)


def undisturbed_weights() -> dict[str, torch.Tensor]:
    worker = make_worker()
    worker.loop.enter(entering(0, 0))
    worker.loop.run_joined()
    return worker.weights()


class AtStep:
    """A callback that runs ``action`` before step ``step`` (once)."""

    def __init__(self, step: int, action: Callable[[], None]) -> None:
        self.step, self.action = step, action

    def on_batch_begin(self, step: int) -> None:
        if step == self.step:
            self.action()
            self.step = -1


def test_a_lone_worker_reports_every_step_with_its_micro_batches_and_holds_the_reports_briefly():
    """20 samples, micro-batches of 4, 2 a step: steps of 8, 8 and 4 samples."""
    worker = make_worker()
    worker.loop.enter(entering(0, 0))
    worker.loop.run_joined()

    reports = worker.reports()
    assert [(r.generation, r.epoch, r.step, r.rank, r.world_size, r.micro_batches) for r in reports] == [
        (0, 0, 0, 0, 1, (0, 1)),
        (0, 0, 1, 0, 1, (0, 1)),
        (0, 0, 2, 0, 1, (0,)),
    ]
    assert [r.stats[-1] for r in reports] == [8.0, 8.0, 4.0]  # the sample count closes the step's sums
    # A lone worker's reports share frames (docs/architecture.md, "What a step costs beyond the math").
    assert worker.channel.send_soon.call_args_list == [mock.call(r, within=REPORT_WITHIN) for r in reports]
    assert worker.left() == [] and worker.loop.next_unit == 4  # 3 steps and the validation slot
    worker.collective.configure.assert_called_once_with(0, 0, 1)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_member_of_a_larger_group_computes_its_share_and_rank_0_reports_each_step_at_once(rank: int):
    """Rank ``rank`` of 2, 4 micro-batches a step (the last step has 2): its share of each. Rank 0
    reports each step for the generation as it ends; every member keeps its copy, which it
    would send with its position when leaving (docs/architecture.md, "Scale")."""
    worker = make_worker(samples=40, micro_batches=4, world_size=2)
    worker.loop.enter(entering(0, 0, rank=rank, world_size=2))
    worker.loop.run_joined()

    kept = list(worker.loop.sent_reports)
    share = [(0, 2), (0, 2), (0,)] if rank == 0 else [(1, 3), (1, 3), (1,)]
    assert [(r.step, r.rank, r.world_size, r.micro_batches) for r in kept] == [
        (step, rank, 2, mbs) for step, mbs in enumerate(share)
    ]
    assert [r.stats[-1] for r in kept] == [8.0, 8.0, 4.0]  # this rank's samples (peers add theirs)
    assert worker.reports() == (kept if rank == 0 else [])
    worker.channel.send_soon.assert_not_called()
    assert worker.collective.all_reduce_start.called  # the step's sums went through the group


def test_an_abort_mid_step_abandons_the_step_and_the_next_generation_redoes_it():
    """The driver aborts generation 0 while step 1's first micro-batch is done: the step is undone
    (gradient and BatchNorm statistics), the worker reports where it got, enters generation 1
    through a new group and redoes step 1; the weights are those of an undisturbed run."""
    worker = make_worker()
    train_micro_batch = worker.loop.adapter.train_micro_batch
    calls: list[int] = []

    def then_abort(*args: Any, **kwargs: Any) -> None:
        train_micro_batch(*args, **kwargs)
        calls.append(1)
        if len(calls) == 3:  # step 1, micro-batch 0
            worker.inbox.abort_generation = 0  # as the inbox thread does on Abort(0)

    worker.inbox.expect.side_effect = [entering(1, 1)]
    with mock.patch.object(worker.loop.adapter, "train_micro_batch", side_effect=then_abort):
        worker.loop.enter(entering(0, 0))
        worker.loop.run_joined()

    assert [(r.generation, r.step, r.micro_batches) for r in worker.reports()] == [
        (0, 0, (0, 1)),
        (1, 1, (0, 1)),
        (1, 2, (0,)),
    ]
    (left,) = worker.left()
    assert (left.generation, left.next_unit, left.failed) == (0, 1, True)
    assert "aborted" in left.reason
    worker.inbox.expect.assert_called_once_with(p.EnterGeneration, RECOVERY)
    assert worker.collective.configure.call_args_list == [mock.call(0, 0, 1), mock.call(1, 0, 1)]
    names = [c[0] for c in worker.collective.mock_calls if c[0] in ("configure", "shutdown")]
    assert names == ["configure", "shutdown", "configure"]  # the old group is gone before the new one forms
    assert len(calls) == 6  # 5 micro-batches, and step 1's first one twice
    reference = undisturbed_weights()
    assert all(torch.equal(worker.weights()[k], reference[k]) for k in reference)


def test_a_failed_collective_undoes_the_step_and_a_failure_while_entering_waits_for_the_next_generation():
    """Step 1's allreduce fails (a peer died): the worker reports where it got; forming generation 1
    fails too, so it reports that and enters generation 2, skipping a late answer for generation 1."""
    worker = make_worker()
    worker.collective.wait.side_effect = [True, CollectiveError("peer 1 closed the connection")] + [True] * 10
    formed = worker.collective.configure.side_effect

    def configure(generation: int, rank: int, world_size: int) -> None:
        formed(generation, rank, world_size)
        if generation == 1:
            raise CollectiveError("forming generation 1 failed: the store fenced us out")

    worker.collective.configure.side_effect = configure
    worker.inbox.expect.side_effect = [entering(1, 1), entering(1, 1), entering(2, 1)]
    worker.loop.enter(entering(0, 0))
    worker.loop.run_joined()

    assert [(left.generation, left.next_unit, left.failed, left.reason) for left in worker.left()] == [
        (0, 1, True, "peer 1 closed the connection"),
        (1, 1, True, "forming generation 1 failed: the store fenced us out"),
    ]
    assert [c.args for c in worker.collective.configure.call_args_list] == [(0, 0, 1), (1, 0, 1), (2, 0, 1)]
    assert [(r.generation, r.step) for r in worker.reports()] == [(0, 0), (2, 1), (2, 2)]
    reference = undisturbed_weights()
    assert all(torch.equal(worker.weights()[k], reference[k]) for k in reference)


def test_a_join_vote_ends_the_generation_after_the_step_and_the_loop_goes_on_in_the_next():
    """A worker waits to join (JoinPending(1) arrives before step 1): the members vote in step 1's
    allreduce, stop after it, and go on from unit 2 in generation 1 (a group of 2: rank 0 keeps
    its share of the micro-batches). Nothing is redone."""
    fakes: dict[str, Any] = {}
    worker = make_worker(callbacks=(AtStep(1, lambda: setattr(fakes["inbox"], "pending_generation", 1)),))
    fakes["inbox"] = worker.inbox  # as the inbox thread does on JoinPending(1)
    worker.inbox.expect.side_effect = [entering(1, 2, rank=0, world_size=2)]
    worker.loop.enter(entering(0, 0))
    worker.loop.run_joined()

    (left,) = worker.left()
    assert (left.generation, left.next_unit, left.failed, left.reason) == (0, 2, False, "switch")
    assert [(r.generation, r.step, r.world_size, r.micro_batches) for r in worker.reports()] == [
        (0, 0, 1, (0, 1)),
        (0, 1, 1, (0, 1)),
        (1, 2, 2, (0,)),
    ]
    assert worker.collective.configure.call_args_list == [mock.call(0, 0, 1), mock.call(1, 0, 2)]
