"""The driver's commit ledger (``driver/ledger.py``), driven in-process with real step reports.

What a user relies on (docs/architecture.md, "Invariants", "Elasticity", "Scale"): rank 0 reports
each step for its generation, and its report counts the step; when a generation ends, a member's
copy of a report that rank 0 did not send counts when its step lies below the resume unit, and
the others are redone; each step counts once, whoever's copy came; a rollback un-counts steps,
epoch averages and validations; and a step whose micro-batches were not computed exactly once
fails the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fabric_model.driver.ledger import ExactlyOnceError, Progress, ReplicaDivergenceError
from fabric_model.run.hooks import Hooks
from fabric_model.run.metrics_log import MetricsLog, read_records
from fabric_model.step.plan import Plan, Schedule
from fabric_model.transport import protocol as p

#: 40 samples, micro-batches of 4, 4 a step: steps of 16, 16 and 8 samples (4, 4 and 2 micro-batches).
PLAN = Plan(num_samples=40, items_per_micro_batch=4, micro_batches=4, seed=0)
SCHEDULE = Schedule(PLAN, epochs=2, validation_freq=1, has_test=True)  # 4 units an epoch: 3 steps, validation
NAMES = ["loss", "accuracy"]


class Recorder:
    """A driver logger: what the hooks pass on, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def record_step(self, metrics: dict[str, float], iteration: int, epoch: int, workers: int) -> None:
        self.calls.append(("step", iteration, epoch, workers, metrics))

    def log_train_metrics(self, metrics: dict[str, float], iteration: int, epoch: int, workers: int) -> None:
        self.calls.append(("train", iteration, epoch, workers, metrics))

    def log_test_metrics(self, metrics: dict[str, float], iteration: int, epoch: int) -> None:
        self.calls.append(("test", iteration, epoch, metrics))


class Ledger:
    """A ``Progress`` over a real metrics log in a temporary directory and real hooks."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "logs" / "metrics.jsonl"
        self.log = MetricsLog(self.path)
        self.recorder = Recorder()
        self.progress = Progress(PLAN, SCHEDULE, NAMES, self.log, Hooks([self.recorder]))

    def records(self, kind: str) -> list[dict[str, Any]]:
        """The log's records of ``kind``, once it is closed (step records are flushed once a second)."""
        self.log.close()
        return [r for r in read_records(self.path) if r["type"] == kind]


@pytest.fixture
def ledger(tmp_path: Path):
    ledger = Ledger(tmp_path)
    yield ledger
    ledger.log.close()


def samples(step: int) -> int:
    return PLAN.step_samples(0, step)


def report(
    step: int,
    rank: int,
    world: int,
    *,
    epoch: int = 0,
    generation: int = 0,
    micro_batches: tuple[int, ...] | None = None,
    loss: float = 0.5,
    accuracy: float = 0.75,
    computed: int | None = None,
) -> p.StepDone:
    """Rank ``rank``'s copy of a step's report: its plan share unless told, and the step's
    reduced sums (the micro-batches computed: the plan's unless told)."""
    n, count = samples(step), PLAN.num_micro_batches(epoch, step)
    if micro_batches is None:
        micro_batches = tuple(range(rank, count, world))
    computed = count if computed is None else computed
    return p.StepDone(generation, epoch, step, rank, world, micro_batches, (loss * n, accuracy * n, float(n)), computed)


def test_rank_0_s_report_counts_the_step_for_its_generation(ledger: Ledger):
    progress = ledger.progress
    assert progress.step_done(report(0, 0, 2)) == 1
    assert (progress.committed_unit, progress.iteration) == (1, 1)
    assert progress.step_done(report(1, 0, 2, loss=1.0)) == 2
    # The short last step has 2 micro-batches: a third member computes none.
    assert progress.step_done(report(2, 0, 3, generation=1, loss=2.0)) == 3
    assert progress.step_done(report(2, 0, 3, generation=1)) is None  # a report taken back twice

    # The epoch's averages are weighted by samples: (16 * 0.5 + 16 * 1.0 + 8 * 2.0) / 40.
    assert progress.train_history == [{"epoch": 0, "loss": pytest.approx(1.0), "accuracy": pytest.approx(0.75)}]
    step, train = [c for c in ledger.recorder.calls if c[1] == 1]
    assert step == ("step", 1, 0, 2, {"loss": 0.5, "accuracy": 0.75})
    assert train == ("train", 1, 0, 2, {"loss": 0.5, "accuracy": 0.75})
    records = ledger.records("train")
    assert [(r["step"], r["iteration"], r["workers"], r["micro_batches"]) for r in records] == [
        (0, 1, 2, {"0": [0, 2], "1": [1, 3]}),  # rank 1's share from the plan, the sum checked
        (1, 2, 2, {"0": [0, 2], "1": [1, 3]}),
        (2, 3, 3, {"0": [0], "1": [1], "2": []}),
    ]
    assert not any(r.get("inferred") for r in records)
    assert records[-1]["epoch_metrics"] == {"loss": pytest.approx(1.0), "accuracy": pytest.approx(0.75)}


def test_a_member_s_copy_counts_a_step_rank_0_did_not_report_when_its_generation_ends(ledger: Ledger):
    """Rank 0 died after the allreduce of step 1, before sending its report; rank 1's copy, sent
    with its position, counts the step once the generation ends at unit 2, after all rank 0 sent
    was read. Copies of steps counted already change nothing."""
    progress = ledger.progress
    assert progress.step_done(report(0, 0, 2)) == 1
    progress.copy(report(0, 1, 2))  # counted: nothing
    progress.copy(report(1, 1, 2, loss=1.0))
    assert progress.committed_unit == 1  # rank 0's report of step 1 may still be on its way
    assert progress.settle(resume_unit=2, upto_generation=0) == 2
    assert progress.settle(resume_unit=2, upto_generation=0) is None
    progress.copy(report(2, 0, 2, generation=1, loss=2.0))
    assert progress.settle(resume_unit=9, upto_generation=0) is None  # generation 1's copy stays
    assert progress.step_done(report(2, 0, 2, generation=1, loss=2.0)) == 3
    assert progress.settle(resume_unit=9, upto_generation=1) is None  # its step counted already
    assert progress.train_history == [{"epoch": 0, "loss": pytest.approx(1.0), "accuracy": pytest.approx(0.75)}]

    records = ledger.records("train")
    assert [(r["step"], r["iteration"], r["generation"], r.get("inferred", False)) for r in records] == [
        (0, 1, 0, False),
        (1, 2, 0, True),  # from a member's copy, when its generation ended
        (2, 3, 1, False),
    ]
    assert records[1]["micro_batches"] == {"0": [0, 2], "1": [1, 3]}
    assert records[1]["metrics"] == {"loss": 1.0, "accuracy": 0.75}


def test_a_copy_of_a_step_past_the_resume_unit_is_dropped_and_the_step_redone_once(ledger: Ledger):
    """A member saw the allreduce of step 1 succeed and was lost; the survivor's failed and it
    undid the step: the next generation resumes at unit 1, and only its report counts."""
    progress = ledger.progress
    progress.step_done(report(0, 0, 2))
    progress.copy(report(1, 1, 2, loss=9.0))
    assert progress.settle(resume_unit=1, upto_generation=0) is None
    assert progress.step_done(report(1, 0, 1, generation=1, loss=2.0)) == 2
    assert [r["micro_batches"] for r in ledger.records("train")] == [{"0": [0, 2], "1": [1, 3]}, {"0": [0, 1, 2, 3]}]
    assert [r["metrics"]["loss"] for r in ledger.records("train")] == [0.5, 2.0]


def commit_epoch_0_and_its_validation(ledger: Ledger) -> None:
    for step, loss in enumerate((0.5, 1.0, 2.0)):
        ledger.progress.step_done(report(step, 0, 1, loss=loss))
    ledger.progress.eval_done(p.EvalDone(0, (3.0, 2.0, 4.0)), workers=1)
    ledger.progress.step_done(report(0, 0, 1, epoch=1, loss=4.0))


def test_roll_back_uncommits_the_steps_their_epoch_average_and_the_validation(ledger: Ledger):
    """No holder of the state was left and the run went back to unit 2 (epoch 0's last step): that
    step, the validation and epoch 1's first step are redone; the epoch's average goes on from the
    steps that stay committed, counting the redone step once, with its new result."""
    progress = ledger.progress
    commit_epoch_0_and_its_validation(ledger)
    assert (progress.committed_unit, progress.iteration) == (5, 4)
    assert progress.train_history == [{"epoch": 0, "loss": pytest.approx(1.0), "accuracy": pytest.approx(0.75)}]
    assert progress.test_history == [{"epoch": 0, "loss": 0.75, "accuracy": 0.5}]

    progress.roll_back(2)
    assert (progress.committed_unit, progress.iteration) == (2, 2)
    assert progress.train_history == [] and progress.test_history == []

    assert progress.step_done(report(2, 0, 2, generation=1, micro_batches=(0,), loss=0.0)) == 3
    # (16 * 0.5 + 16 * 1.0 + 8 * 0.0) / 40: the first result of step 2 (2.0) is gone.
    assert progress.train_history == [{"epoch": 0, "loss": pytest.approx(0.6), "accuracy": pytest.approx(0.75)}]
    progress.eval_done(p.EvalDone(0, (1.0, 3.0, 4.0)), workers=2)  # the redone validation counts again
    assert progress.test_history == [{"epoch": 0, "loss": 0.25, "accuracy": 0.75}]
    progress.eval_done(p.EvalDone(0, (9.0, 9.0, 4.0)), workers=2)  # the other rank's report of it does not
    assert progress.test_history == [{"epoch": 0, "loss": 0.25, "accuracy": 0.75}]
    assert progress.iteration == 3

    # In the log, the redone step's record comes again, later (a reader keeps the later one).
    steps = [(r["epoch"], r["step"], r["iteration"], r["metrics"]["loss"]) for r in ledger.records("train")]
    assert steps == [(0, 0, 1, 0.5), (0, 1, 2, 1.0), (0, 2, 3, 2.0), (1, 0, 4, 4.0), (0, 2, 3, 0.0)]
    assert [r["metrics"]["loss"] for r in ledger.records("test")] == [0.75, 0.25]


def test_a_roll_back_to_a_new_epoch_restarts_its_average(ledger: Ledger):
    commit_epoch_0_and_its_validation(ledger)
    ledger.progress.roll_back(4)  # epoch 1's first step is redone; epoch 0 stays as it was
    assert ledger.progress.iteration == 3
    assert ledger.progress.step_done(report(0, 0, 1, epoch=1, generation=1, loss=3.0)) == 5
    assert ledger.records("train")[-1]["epoch_metrics"] == {"loss": 3.0, "accuracy": 0.75}
    assert len(ledger.progress.train_history) == 1 and len(ledger.progress.test_history) == 1


@pytest.mark.parametrize(
    ("wrong", "said"),
    [
        pytest.param({"computed": 5}, r"the generation 5 micro-batches, expected 4", id="a micro-batch twice"),
        pytest.param({"computed": 3}, r"the generation 3 micro-batches, expected 4", id="one missing"),
        pytest.param({"micro_batches": (0, 1)}, r"micro-batches \[0, 1\] \(the plan's: \[0, 2\]\)", id="not its share"),
    ],
)
def test_a_step_whose_micro_batches_were_not_each_computed_once_fails_the_run(
    ledger: Ledger, wrong: dict[str, Any], said: str
):
    """Invariant 1: the step is not committed, and the error says what was computed."""
    progress = ledger.progress
    with pytest.raises(ExactlyOnceError, match=rf"step 0 of epoch 0: rank 0 of 2 .*{said}"):
        progress.step_done(report(0, 0, 2, **wrong))
    assert (progress.committed_unit, progress.iteration) == (0, 0)
    assert ledger.records("train") == []


def test_a_step_counted_from_a_member_s_copy_is_checked_too(ledger: Ledger):
    ledger.progress.copy(report(0, 1, 2, computed=2))  # half the micro-batches
    with pytest.raises(ExactlyOnceError, match=r"2 micro-batches, expected 4"):
        ledger.progress.settle(resume_unit=1, upto_generation=0)


def test_replicas_that_finished_with_different_states_fail_the_run(ledger: Ledger):
    progress = ledger.progress
    total = SCHEDULE.total_units
    progress.finished(0, p.Finished("aaaa", total))
    progress.finished(1, p.Finished("bbbb", total))
    progress.finished(2, p.Finished("cccc", total - 3))  # left before the end: not compared
    with pytest.raises(ReplicaDivergenceError, match="different states"):
        progress.check_replicas()
    (end,) = ledger.records("end")
    assert end["replica_digests"] == {"0": "aaaa", "1": "bbbb"}


def test_a_validation_that_overtakes_its_epochs_last_step_reaches_the_hooks_after_it(ledger: Ledger):
    """A validation can reach the driver before its epoch's last step counts (a member's copy
    settled when its generation ended, say): loggers, the screen and metrics.csv see each epoch's
    training averages, then its validation, in epoch order."""
    progress = ledger.progress
    progress.step_done(report(0, 0, 1))
    progress.eval_done(p.EvalDone(0, (3.6, 3.2, 4.0)), workers=1)  # early: epoch 0 is not done
    progress.eval_done(p.EvalDone(1, (1.6, 3.6, 4.0)), workers=1)
    assert progress.test_history == [] and [c[0] for c in ledger.recorder.calls] == ["step", "train"]
    for epoch in (0, 1):
        for step in range(epoch == 0, 3):
            progress.step_done(report(step, 0, 1, epoch=epoch))
    order = [(c[0], c[2]) for c in ledger.recorder.calls if c[0] != "step"]
    runs = [x for i, x in enumerate(order) if i == 0 or order[i - 1] != x]  # one entry per run of equal calls
    assert runs == [("train", 0), ("test", 0), ("train", 1), ("test", 1)], order
    assert [(t["epoch"], t["loss"]) for t in progress.test_history] == [
        (0, pytest.approx(0.9)),
        (1, pytest.approx(0.4)),
    ]
