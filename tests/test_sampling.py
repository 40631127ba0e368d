"""A training dataset's own epoch order and loss weights (fabric_model/step/sampling.py): what
``FabricTrainer`` builds Trainer's sampler order and ``num_items_in_batch`` on. In-process checks,
then two workers against a plain loop that takes the same order and weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.utils.data import default_collate

from fabric_model import FabricModel
from fabric_model.setup.checks import check_datasets
from fabric_model.step.plan import Plan
from fabric_model.step.sampling import (
    ItemWeights,
    MicroBatchWeights,
    SampleWeights,
    SeededOrder,
    order_of,
    weighting_of,
)

from .helpers import max_rel_diff

SEED, BATCH, MICRO = 3, 4, 3  # a step of 12 samples in 3 micro-batches
N = 30  # the epoch's last step short: 6 samples, 2 micro-batches


class Masked:
    """Samples ``(x, y)`` whose ``y`` holds 4 targets, ``-1`` where masked: sample ``i`` has
    ``counts[i]`` targets; the loss is the mean over the micro-batch's unmasked targets."""

    def __init__(self, n: int = N, shift: int = 0) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 5, generator=g)
        y = torch.randn(n, 4, generator=g)
        self.counts = 1 + (np.arange(n) * 7) % 4
        for i, c in enumerate(self.counts):
            y[i, c:] = -1.0
        self.y, self.shift = y, shift
        self.loss_weighting = ItemWeights(self.counts)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]

    def epoch_order(self, epoch: int) -> np.ndarray:
        # Not the plan's: reversed, rotated by the epoch.
        return np.roll(np.arange(len(self.x))[::-1], epoch + self.shift)


def masked_mean(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    mask = target != -1.0
    return ((output - target) ** 2)[mask].mean()


def test_the_default_is_the_plans_order_and_samples():
    plan = Plan(N, BATCH, MICRO, SEED)
    order = order_of(list(range(N)), plan)
    assert isinstance(order, SeededOrder) and isinstance(weighting_of([], N), SampleWeights)
    assert weighting_of([], N).micro(np.arange(5)) == 5
    assert weighting_of([], N).step_total(plan, order, 0, 2) == plan.step_samples(0, 2) == 6


def test_item_and_micro_batch_weights_sum_over_the_whole_step():
    data = Masked()
    plan = Plan(N, BATCH, MICRO, SEED)
    order = order_of(data, plan)
    perm = order.permutation(1)
    assert list(perm) == list(np.roll(np.arange(N)[::-1], 1))
    for step in range(plan.steps_per_epoch):
        step_indices = np.concatenate(
            [plan.micro_batch_indices(1, step, j, perm) for j in range(plan.num_micro_batches(1, step))]
        )
        assert data.loss_weighting.step_total(plan, order, 1, step) == data.counts[step_indices].sum()
    assert MicroBatchWeights().step_total(plan, order, 0, 2) == 2  # the short last step: 2 micro-batches
    assert MicroBatchWeights().micro(np.arange(2)) == 1.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"epoch_order": lambda epoch: [0, 1, 1]}, r"epoch_order\(0\)` to be a permutation of range\(3\).*3 indices"),
        ({"epoch_order": lambda epoch: [0, 1]}, r"Received: 2 indices"),
        ({"loss_weighting": ItemWeights([1, 2])}, r"one count per sample \(3\). Received: 2 counts"),
        ({"loss_weighting": "tokens"}, r"`loss_weighting` to be a .*Weighting.*Received: str"),
    ],
)
def test_a_wrong_order_or_weighting_fails_in_the_caller(change, message):
    class Data(list):
        pass

    data = Data([(torch.zeros(2), torch.zeros(1))] * 3)
    for name, value in change.items():
        setattr(data, name, value)
    with pytest.raises((ValueError, TypeError), match=message):
        check_datasets(lambda: (data, None))
    with pytest.raises(ValueError, match="non-negative"):
        ItemWeights([1, -1])


def reference(model: nn.Module, opt: torch.optim.Optimizer, data: Masked, epochs: int) -> list[float]:
    """The plain loop: the dataset's order, each step's gradient that of its items' mean loss;
    returns each epoch's loss, the mean over its items."""
    plan = Plan(len(data), BATCH, MICRO, SEED)
    losses = []
    for epoch in range(epochs):
        summed, items = 0.0, 0
        perm = data.epoch_order(epoch)
        for step in range(plan.steps_per_epoch):
            opt.zero_grad()
            micro = [plan.micro_batch_indices(epoch, step, j, perm) for j in range(plan.num_micro_batches(epoch, step))]
            total = sum(data.counts[idx].sum() for idx in micro)
            for idx in micro:
                x, y = default_collate([data[int(i)] for i in idx])
                output = model(x)
                mask = y != -1.0
                loss = ((output - y) ** 2)[mask].sum()
                (loss / total).backward()
                summed += loss.item()
            items += total
            opt.step()
        losses.append(summed / items)
    return losses


@pytest.mark.processes
def test_two_workers_train_as_a_loop_over_the_datasets_order_and_item_weights(run_dir):
    torch.manual_seed(0)
    model = nn.Linear(5, 4)
    ref = nn.Linear(5, 4)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fm = FabricModel(model, lambda: (Masked(), None), masked_mean, opt, metrics=[])
    result = fm.train(2, BATCH, 2, effective_batch_size=BATCH * MICRO, seed=SEED, run_dir=run_dir)
    losses = reference(ref, torch.optim.SGD(ref.parameters(), lr=0.1), Masked(), 2)
    assert max_rel_diff(model.state_dict(), ref.state_dict()) < 1e-5
    # The epoch's loss is the mean over its items, as the gradient's.
    assert [h["loss"] for h in result.history] == pytest.approx(losses, rel=1e-5)
