"""Evaluation of a torch model on a worker's test shard: the user's ``fn_test`` or the loss and metrics."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ...step.layout import StepLayout
from .batches import scalar, to_device
from .calling import ModelCall, model_loss
from .ibm import test_result
from .precision import GradientStep


class TorchEvaluation:
    """The evaluation half of :class:`~.torch_adapter.TorchAdapter` (a mixin: it reads the adapter's fields)."""

    model: Any  # a torch.nn.Module (IBM custom steps add methods to it)
    device: torch.device
    metrics: list[Callable[[Any, Any], Any]]
    loss_function: Callable[[Any, Any], Any] | None
    call: ModelCall
    stat_names: list[str]
    step_fn: Callable[..., Any] | None
    test_fn: Callable[..., Any] | None
    fn_args: Any
    grad_step: GradientStep  # its autocast: evaluation runs in the training's precision

    @property
    def step_layout(self) -> StepLayout:
        """The step buffer's layout (the adapter's): its stats' sizes give the evaluation's."""
        raise NotImplementedError

    def evaluate_batches(self, batches: Iterator[tuple[Any, Any]]) -> torch.Tensor:
        """Stat sums over ``(indices, batch)`` pairs: the user's ``fn_test`` if given."""
        if self.test_fn is None:
            total = torch.zeros(self.step_layout.eval_size, dtype=torch.float64)
            for indices, batch in batches:
                total += self._evaluate_batch(batch, len(indices))
            return total
        first = next(batches, None)
        if first is None:  # an empty test shard: no call (IBM's fn_test divides by its count); zero samples
            return torch.zeros(self.step_layout.eval_size, dtype=torch.float64)
        count = 0

        def test_iter() -> Iterator[tuple[Any, Any]]:
            nonlocal count
            for indices, batch in itertools.chain([first], batches):
                count += len(indices)
                yield self.call.split(to_device(batch, self.device))

        self.model.eval()
        try:
            with torch.no_grad(), self.grad_step.autocast(self.device):
                result = self.test_fn(self.model, test_iter(), self.fn_args)
        finally:
            self.model.train()
        values = [float(scalar(v, torch.device("cpu"))) for v in test_result(result)]
        values = (values + [float("nan")] * len(self.stat_names))[: len(self.stat_names)]
        return torch.tensor([v * count for v in values] + [count], dtype=torch.float64)

    def compute_loss(self, output: Any, target: Any) -> Any:
        """The user's ``loss_function(output, target)``, or the loss the model computed (``loss_function=None``)."""
        if self.loss_function is None:
            return model_loss(output)
        return self.loss_function(output, target)

    @torch.no_grad()
    def _evaluate_batch(self, batch: Any, num_samples: int) -> torch.Tensor:
        """Stat sums (loss, metrics...) and the sample count over one test batch, float64 on the CPU."""
        self.model.eval()
        try:
            inputs, target = self.call.split(to_device(batch, self.device))
            with self.grad_step.autocast(self.device):
                output = self.call(self.model, inputs)
                loss = float(self.compute_loss(output, target))
            n = num_samples
            metrics = [float(m(output, target)) for m in self.metrics]
            if self.step_fn is not None:  # stats are (loss, metric): the first metric, if any, stands for it
                metrics = metrics[:1] or [float("nan")]
            values = [loss] + metrics
            return torch.tensor([v * n for v in values] + [n], dtype=torch.float64)
        finally:
            self.model.train()
