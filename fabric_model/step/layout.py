"""Where each part of the flat step buffer lives: one collective carries a whole step.

A leaf module of plain integers (no framework import), shared by the adapters that fill the buffer
and the loop that reads the step's result; see docs/architecture.md, "The step".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

#: A member told to leave (docs/architecture.md, "Preemption") votes this much more than one
#: that asks to switch for a newcomer: the sum says how many members leave (while fewer than
#: this many vote, the float32 sum stays exact).
LEAVE_VOTE = 1024.0
#: A member told by the driver that the job stops (a preempted job whose optimizer state is
#: sharded) votes this much more: one such vote makes every member leave after the step, together.
#: Above any sum of leave votes of up to 8,000 members (8,000 * 1,025 < 2 ** 23); float32 sums
#: of several are inexact past 2 ** 24, but never below it.
STOP_VOTE = float(1 << 23)
#: ``StepResult.leaving`` when a member voted to stop: more than any group has members.
EVERYONE = 1 << 30


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What a finished step reports.

    Attributes:
        stats: the stat sums (loss, metrics..., in ``stat_names`` order) then the step's sample
            count, summed over the group: what the driver averages.
        switch: whether some member voted to end the generation after this step.
        leaving: how many members voted to leave after it (a preemption notice); ``EVERYONE``
            when one voted to stop the job.
        micro_batches: how many micro-batches the members computed, summed over the group: the
            driver's exactly-once check (driver/ledger.py).
        snapshot: whether rank 0 asked every member to gather a snapshot before the next unit
            (a sharded optimizer state: only rank 0's clock decides, state/uploader.py).
        grad_norm: the reduced gradient's L2 norm before clipping, where ``gradient_clip_norm``
            clipped it (the same on every member); None otherwise.
    """

    stats: list[float]
    switch: bool
    leaving: int = 0
    micro_batches: int = 0
    snapshot: bool = False
    grad_norm: float | None = None


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """The offsets of the step buffer, laid out as::

        [ gradients | forward-updated buffer deltas | got-gradient flags |
          stat sums (loss, metrics...) | sample count | micro-batches computed | snapshot vote |
          switch vote ]

    Gradients and buffer deltas are already weighted by each micro-batch's share of the step;
    a flag is 1 where some micro-batch produced the parameter's gradient; each member writes
    how many micro-batches it computed; rank 0 writes 1 to the snapshot vote where every member
    is to gather a snapshot next; the switch vote is 1 where a member asks to switch
    generation, and ``1 + LEAVE_VOTE`` where it leaves after the step. Everything is summed by
    one allreduce.

    Attributes:
        n_gradients: elements of all trainable parameters.
        n_buffers: elements of the forward-updated buffers (BatchNorm statistics).
        n_flags: one per trainable parameter.
        n_stats: loss and metrics.
    """

    n_gradients: int
    n_buffers: int
    n_flags: int
    n_stats: int

    #: What follows the stat sums: the sample count, then the loop's ``LOOP_SLOTS`` values
    #: (micro-batches computed, snapshot vote, switch vote).
    LOOP_SLOTS = 3

    @property
    def size(self) -> int:
        """Elements of the whole buffer."""
        return self.n_gradients + self.n_buffers + self.n_flags + self.n_stats + 1 + self.LOOP_SLOTS

    @property
    def gradients(self) -> slice:
        return slice(0, self.n_gradients)

    @property
    def buffers(self) -> slice:
        return slice(self.n_gradients, self.n_gradients + self.n_buffers)

    @property
    def flags(self) -> slice:
        start = self.buffers.stop
        return slice(start, start + self.n_flags)

    @property
    def stat_sums(self) -> slice:
        start = self.flags.stop
        return slice(start, start + self.n_stats)

    @property
    def count(self) -> int:
        """Index of the sample count."""
        return self.stat_sums.stop

    @property
    def computed(self) -> int:
        """Index of the count of micro-batches computed."""
        return self.count + 1

    @property
    def snapshot(self) -> int:
        """Index of the snapshot vote."""
        return self.count + 2

    @property
    def vote(self) -> int:
        """Index of the switch vote (the last element)."""
        return self.count + 3

    @property
    def tail(self) -> slice:
        """Stat sums, sample count, micro-batches and vote: what the step reports."""
        return slice(self.stat_sums.start, self.size)

    @property
    def eval_size(self) -> int:
        """Elements of a validation's sums: stat sums then sample count (no vote)."""
        return self.n_stats + 1

    def tail_only(self) -> StepLayout:
        """The layout of a buffer that holds only the tail (a step with nothing to exchange)."""
        return StepLayout(0, 0, 0, self.n_stats)

    def result(self, tail: Sequence[float]) -> StepResult:
        """The step's result from the values of ``tail`` (as a list of floats)."""
        values = list(tail)
        expected = self.n_stats + 1 + self.LOOP_SLOTS
        if len(values) != expected:
            raise ValueError(f"expected {expected} tail values, got {len(values)}")
        computed, snapshot, vote = values[-3:]
        leaving = EVERYONE if vote >= STOP_VOTE else int(vote // LEAVE_VOTE)
        return StepResult(values[:-3], vote > 0, leaving, int(round(computed)), snapshot > 0)
