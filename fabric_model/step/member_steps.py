"""Which micro-batches of each step a member computes, for the steps of one generation.

The plan answers it for any step (:func:`~.plan.assigned_micro_batches` of
:meth:`~.plan.Plan.num_micro_batches`), in a dozen Python calls; the loop asks twice a step (its
reads and its step). Every step of map-style data but an epoch's last one or two holds the
global batch, so that answer is computed once a generation (docs/architecture.md, "What a step
costs beyond the math").
"""

from __future__ import annotations

from .plan import Plan, assigned_micro_batches


class MemberSteps:
    """The micro-batches rank ``rank`` of ``world_size`` computes in each step."""

    def __init__(self, plan: Plan, rank: int, world_size: int) -> None:
        self.plan, self.rank, self.world_size = plan, rank, world_size
        #: Steps ``0 .. full_steps - 1`` of every epoch hold the global batch (``Plan.step_samples``),
        #: in ``plan.micro_batches`` micro-batches; a sharded dataset's steps are the plan's to say.
        self.full_steps = 0 if plan.sharded_data else plan.num_samples // plan.global_batch
        #: This member's micro-batches of such a step.
        self.full = tuple(assigned_micro_batches(plan.micro_batches, rank, world_size))

    def mine(self, epoch: int, step: int) -> tuple[int, ...]:
        """This member's micro-batches of ``step`` in ``epoch`` (a caller tests ``full_steps`` first)."""
        if step < self.full_steps:
            return self.full
        return tuple(assigned_micro_batches(self.plan.num_micro_batches(epoch, step), self.rank, self.world_size))
