"""Progress: committed steps, the exactly-once check, epoch averages, history, replica digests.

Rank 0 alone reports each step, for its whole generation (docs/architecture.md, "Scale"), and
its report commits the step: every member contributed to the step's allreduce. Members that
leave a generation send their copy of their last step's report with their position, for when
rank 0 died before sending it; copies wait for the generation's end, when everything rank 0
sent has been read, and commit the steps below the next generation's resume unit (some member
holds their result). When a step rank 0 reported was lost with every member that finished it
(its allreduce failed on the survivors), membership rolls the run back to where they are.
Every committed step must have had its micro-batches computed exactly once (invariant 1,
docs/architecture.md, "Invariants"): the reporter computed its plan share, and the count of
micro-batches computed, summed in the step's allreduce, is the step's.
"""

from __future__ import annotations

from ..run.hooks import Hooks
from ..run.metrics_log import MetricsLog
from ..step.metrics import EpochAverage, stat_means, validation_means
from ..step.plan import Plan, Schedule, plan_shares
from ..transport import protocol as p
from .replicas import Divergence, ReplicaDivergenceError, compare


class ExactlyOnceError(AssertionError):
    """A committed step's micro-batches were not computed exactly once (a framework bug)."""


class CommittedUnit:
    """How far training got: every unit below ``unit`` is committed. One record, shared by the
    ledger (which advances it as steps commit), membership (which resumes a generation from it,
    and lowers it when no holder of the state was left) and the state book (which keeps the
    newest saved state at or below it): docs/architecture.md, "Elasticity"."""

    def __init__(self, unit: int = 0) -> None:
        self.unit = unit

    def advance(self, unit: int) -> None:
        """Units below ``unit`` are committed too (it never moves back here)."""
        self.unit = max(self.unit, unit)

    def roll_back(self, unit: int) -> None:
        """The run goes back to ``unit`` (no holder of the committed state was left), or a resumed run starts there."""
        self.unit = unit


class Progress:
    """Where training stands, and its record.

    Args:
        plan, schedule: the run's plan and schedule.
        stat_names: "loss" and the metrics, in the order of the step's stat sums.
        metrics: the run's metrics log (a record per committed step, validation and the end).
        hooks: the driver's hooks (the user's logger or the progress display).
    """

    def __init__(
        self, plan: Plan, schedule: Schedule, stat_names: list[str], metrics: MetricsLog, hooks: Hooks
    ) -> None:
        self.plan, self.schedule, self.stat_names = plan, schedule, stat_names
        self.metrics, self.hooks = metrics, hooks
        self.iteration = 0  # steps committed
        self.committed = CommittedUnit()  # the run's one record of it (shared with membership and the state book)
        self.train_history: list[dict[str, float]] = []
        self.test_history: list[dict[str, float]] = []
        self.replica_digests: dict[int, str] = {}
        self.replica_fingerprints: dict[int, dict[str, int]] = {}  # per tensor, to name what differs
        self.done_units: dict[int, int] = {}  # worker id -> next_unit when it finished
        # Members' copies of reports, by (generation, unit), until their generation's end (settle).
        self._pending: dict[tuple[int, int], p.StepDone] = {}
        self._average = EpochAverage(stat_names)
        self._stats: dict[tuple[int, int], tuple[float, ...]] = {}  # (epoch, step) -> committed sums
        # Validations that came before their epoch's last step was committed (rank 0's report
        # can overtake another worker's step reports): held, so every hook sees them in order.
        self._early_evals: dict[int, tuple[p.EvalDone, int]] = {}

    def start_at(self, unit: int, train_history: list[dict[str, float]], test_history: list[dict[str, float]]) -> None:
        """A resumed run: the position and the history below ``unit`` (replayed from the log)."""
        self.committed.roll_back(unit)
        self.iteration = self.schedule.steps_before(unit)
        self.train_history, self.test_history = train_history, test_history

    def restart_at(
        self,
        unit: int,
        history: tuple[list[dict[str, float]], list[dict[str, float]]],
        epoch_steps: list[tuple[int, int, dict[str, float]]],
    ) -> None:
        """A restarted driver took back workers ahead of the state it resumed from: the position,
        history and epoch so far of the vanished driver's last committed step instead."""
        self._pending.clear()
        self._early_evals.clear()
        self._stats.clear()
        self._average = EpochAverage(self.stat_names)
        self.start_at(unit, *history)
        self.resume_epoch(epoch_steps)

    def resume_epoch(self, steps: list[tuple[int, int, dict[str, float]]]) -> None:
        """A run resumed inside an epoch: the epoch's average goes on from its steps done before, their
        sums rebuilt from their records (each step's means times its samples: the same to rounding)."""
        for epoch, step, means in steps:
            n = float(self.plan.step_samples(epoch, step))
            sums = tuple(float(means.get(name, float("nan"))) * n for name in self.stat_names) + (n,)
            self._stats[(epoch, step)] = sums
            self._average.add(epoch, sums)

    def roll_back(self, unit: int) -> None:
        """No holder of the committed state was left and the run went back to ``unit``: the steps
        and validations from there on are un-committed; their replays' records supersede the
        first ones (in the log, the later record of a step wins, as on resume)."""
        steps = self.plan.steps_per_epoch
        self.start_at(
            unit,
            [h for h in self.train_history if self.schedule.unit(int(h["epoch"]), steps - 1) < unit],
            [h for h in self.test_history if self.schedule.unit(int(h["epoch"]), steps) < unit],
        )
        self._pending.clear()
        self._early_evals.clear()  # their epochs' last steps were not committed: redone, revalidated
        self._stats = {k: v for k, v in self._stats.items() if self.schedule.unit(*k) < unit}
        # The epoch average goes on from the sums of the epoch's steps that stay committed.
        epoch = unit // self.schedule.units_per_epoch
        self._average = EpochAverage(self.stat_names)
        for (e, _), sums in sorted(self._stats.items()):
            if e == epoch:
                self._average.add(e, sums)

    def step_done(self, message: p.StepDone) -> int | None:
        """Rank 0's report of a step (or one a restarted driver took back); returns the new
        committed unit when the step commits."""
        if self.schedule.unit(message.epoch, message.step) < self.committed.unit:
            return None  # counted already: a report taken back twice
        return self._commit(message, inferred=False)

    def copy(self, message: p.StepDone) -> None:
        """A member's copy of its last step's report, sent as it left the generation: held until
        the generation's end (``settle``), when rank 0's report of it, if it sent one, has come."""
        unit = self.schedule.unit(message.epoch, message.step)
        if unit >= self.committed.unit:
            self._pending.setdefault((message.generation, unit), message)

    def settle(self, resume_unit: int, upto_generation: int) -> int | None:
        """Settle the copies of ended generations' reports; returns the committed unit if it moved.

        A step below ``resume_unit`` whose report rank 0 did not send completed in an allreduce
        that the member holding the furthest state saw succeed: it is committed. Steps at or past
        it will be redone, so their copies are dropped.
        """
        moved = None
        for key in sorted(self._pending):
            generation, unit = key
            if generation > upto_generation:
                continue
            report = self._pending.pop(key)
            if self.committed.unit <= unit < resume_unit:
                moved = self._commit(report, inferred=True)
        return moved

    def _commit(self, report: p.StepDone, inferred: bool) -> int:
        epoch, step, world = report.epoch, report.step, report.world_size
        n = self.plan.num_micro_batches(epoch, step)
        shares = plan_shares(n, world)
        if tuple(report.micro_batches) != shares.get(report.rank) or report.computed != n:
            share = list(shares[report.rank]) if report.rank in shares else None
            raise ExactlyOnceError(
                f"step {step} of epoch {epoch}: rank {report.rank} of {world} computed micro-batches "
                f"{list(report.micro_batches)} (the plan's: {share}) and the generation "
                f"{report.computed} micro-batches, expected {n}"
            )
        stats = report.stats
        step_metrics = stat_means(self.stat_names, stats)
        if report.grad_norm is not None:  # the step's own, not averaged over the epoch
            step_metrics["grad_norm"] = report.grad_norm
        self.iteration += 1
        self.committed.advance(self.schedule.unit(epoch, step) + 1)
        self._stats[(epoch, step)] = stats
        averages = self._average.add(epoch, stats)
        if step == self.plan.steps_per_epoch - 1:
            self.train_history.append({"epoch": epoch, **averages})
        self.metrics.train(
            epoch=epoch,
            step=step,
            iteration=self.iteration,
            generation=report.generation,
            workers=world,
            metrics=step_metrics,
            epoch_metrics=averages,
            micro_batches=shares,
            inferred=inferred,
        )
        self.hooks.record_step(step_metrics, self.iteration, epoch, world)
        self.hooks.log_train_metrics(averages, self.iteration, epoch, world)
        if step == self.plan.steps_per_epoch - 1 and epoch in self._early_evals:
            self.eval_done(*self._early_evals.pop(epoch))
        return self.committed.unit

    @property
    def committed_unit(self) -> int:
        """Every unit below this is committed."""
        return self.committed.unit

    def eval_done(self, message: p.EvalDone, workers: int) -> None:
        """A validation's result (every rank reports it; the first report of an epoch counts)."""
        epoch = message.epoch
        if any(t["epoch"] == epoch for t in self.test_history):
            return  # a validation redone after a generation change
        if self.committed.unit <= self.schedule.unit(epoch, self.plan.steps_per_epoch - 1):
            self._early_evals.setdefault(epoch, (message, workers))  # until the epoch's last step
            return
        metrics = validation_means(self.stat_names, message.stats)
        iteration = (epoch + 1) * self.plan.steps_per_epoch  # validation follows the epoch's last step
        self.test_history.append({"epoch": epoch, **metrics})
        self.metrics.test(epoch=epoch, iteration=iteration, workers=workers, metrics=metrics)
        self.hooks.log_test_metrics(metrics, iteration, epoch)

    def finished(self, worker_id: int, message: p.Finished) -> None:
        self.done_units[worker_id] = message.next_unit
        self.replica_digests[worker_id] = message.digest
        self.replica_fingerprints[worker_id] = message.fingerprint

    def check_replicas(self, reference: int | None = None) -> None:
        """Invariant 4: every replica that finished holds the same weights and optimizer state;
        else ``ReplicaDivergenceError`` names the tensors in which each differs from
        ``reference``'s (the replica whose state is handed back; default: the lowest id)."""
        total = self.schedule.total_units
        finished = {w: d for w, d in self.replica_digests.items() if self.done_units.get(w, -1) >= total}
        # A callback stopped every replica early (worker/loop.py, "_stopping"): fewer steps than the
        # schedule's (counted from the run's start, so a resumed run's too), the last one's epoch.
        steps = self.schedule.epochs * self.plan.steps_per_epoch
        stopped = max(self.iteration - 1, 0) // self.plan.steps_per_epoch if self.iteration < steps else None
        self.metrics.end(iteration=self.iteration, replica_digests=finished, stopped_after_epoch=stopped)
        self.replica_digests = finished
        if len(set(finished.values())) > 1:
            divergence = self._divergence(finished, reference)
            raise ReplicaDivergenceError(f"replicas ended with different states: {divergence.describe()}", divergence)

    def _divergence(self, digests: dict[int, str], reference: int | None) -> Divergence:
        first = reference if reference in digests else min(digests)
        order = [first, *sorted(w for w in digests if w != first)]
        where = "at the end of training"
        found = compare({w: self.replica_fingerprints.get(w, {}) for w in order}, where)
        # Digests cover every byte; fingerprints could (rarely) agree where digests do not.
        return found or Divergence(first, {w: [] for w in order if digests[w] != digests[first]}, where)
