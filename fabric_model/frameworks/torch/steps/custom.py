"""The user's own step (``fn_step_train``): its backward fills a scratch gradient, added here.

IBM's custom steps compute their loss and call backward themselves and return ``(metric,
loss)``; ``optimizer.step()`` is refused inside them (frameworks/torch/ibm.py): the update is
the framework's, once per global step. The scratch is added into the step buffer with the
micro-batch's weight, so the step's gradient is the sample-weighted mean as for the model's
own loss.
"""

from __future__ import annotations

from typing import Any

import torch

from ....profiling import phases as ph
from ..batches import scalar
from ..ibm import forbidden_step
from .exact import ExactStep
from .replicated import ReplicatedStep


class CustomMicroBatches:
    """A micro-batch computed by the user's step (a mixin before a strategy in the bases)."""

    adapter: Any
    buffer: Any
    params: list[torch.Tensor]
    buf_start: list[torch.Tensor]
    write_flags: Any
    add_buffer_deltas: Any

    def learn(self, inputs: Any, target: Any, share: float, num_samples: int, last: bool) -> None:
        with self.adapter.phases(ph.FORWARD):  # the user's step: forward and backward
            self._custom(inputs, target, share, num_samples)

    def _custom(self, inputs: Any, target: Any, weight: float, n: int) -> None:
        adapter, buffer = self.adapter, self.buffer
        buffer.materialize()
        scratch = buffer.make_scratch()
        scratch.zero_()
        offset = 0
        for p in self.params:
            p.grad = scratch[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        optimizer = adapter.optimizer
        shadowed = "step" in vars(optimizer)
        previous = vars(optimizer).get("step")
        optimizer.step = forbidden_step
        try:
            with adapter.grad_step.autocast(adapter.device):  # bf16-mixed (float16 is refused with a custom step)
                data = (inputs, target)
                metric, loss = adapter.step_fn(adapter.model, data, adapter.eva, adapter.train_set, adapter.fn_args)
        finally:
            if shadowed:
                optimizer.step = previous
            else:
                del optimizer.step
        self.write_flags()
        offset = 0
        for p in self.params:  # the user may have replaced .grad (clipping does not)
            if p.grad is not None and p.grad.data_ptr() != scratch[offset].data_ptr():
                scratch[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
            offset += p.numel()
        views = buffer.views
        with torch.no_grad():
            buffer.flat[: scratch.numel()].add_(scratch, alpha=weight)
            buffer.attach()
            self.add_buffer_deltas(weight)
            views.stats[0] += scalar(loss, adapter.device) * n
            views.stats[1] += scalar(metric, adapter.device) * n
            views.sample_count.add_(n)


class CustomStep(CustomMicroBatches, ReplicatedStep):
    """The user's step, reduced as the replicated step's buckets (launched after it, not during)."""


class ExactCustomStep(CustomMicroBatches, ExactStep):
    """The user's step with ``deterministic=True``: each micro-batch's term summed exactly."""

    fresh_alone = False  # its backward writes a scratch, never fresh gradients
