"""The corpus' harness: train a real model with FabricModel on 1 and 2 engines (deterministic) and
by hand, as its user would write the loop, and compare.

The hand-written loop follows the README's "What a step means": each global batch of
``BATCH * ENGINES`` samples in the plan's order, cut into micro-batches of ``BATCH``, the
gradient of the global batch's mean loss accumulated micro-batch by micro-batch, dropout seeded
per micro-batch, one optimizer step; one intra-op thread, as a deterministic worker has. Buffers
follow the step's rule: every micro-batch's forward starts from the step's buffers; a float
buffer ends at the step's value plus the sample-weighted mean of the micro-batches' changes (the
statistics of one forward over the global batch), an integer one plus their sum (a counter
counts every micro-batch).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import default_collate

from fabric_model import FabricModel
from fabric_model.step.plan import Plan, epoch_permutation, micro_batch_seed

SEED, BATCH, ENGINES = 3, 4, 2


@dataclasses.dataclass
class Case:
    """One corpus model: how to build it, its data, and how its user computes a loss by hand."""

    build: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]]  # seeded inside
    data: list[Any]
    loss_function: Callable[[Any, Any], Any] | None  # what FabricModel is given (None: the model's own)
    hand_loss: Callable[[torch.nn.Module, Any], torch.Tensor]  # the user's own loop: model and collated batch
    epochs: int = 3
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # more FabricModel arguments
    # what the user's loop seeds besides torch's global generator before a micro-batch (model, seed)
    seed_own: Callable[[torch.nn.Module, int], None] | None = None


@dataclasses.dataclass
class Trained:
    state: dict[str, torch.Tensor]
    train_history: list[dict[str, float]]
    model: torch.nn.Module


def train(case: Case, engines: int, run_dir: Path, **train_kwargs: Any) -> Trained:
    """``case`` trained by FabricModel on ``engines`` workers, the global batch ``BATCH * ENGINES``."""
    model, optimizer = case.build()
    data = case.data
    fm = FabricModel(model, lambda: (data, None), case.loss_function, optimizer, metrics=[], **case.kwargs)
    train_kwargs.setdefault("deterministic", True)
    result = fm.train(
        case.epochs,
        BATCH,
        engines,
        effective_batch_size=BATCH * ENGINES,
        seed=SEED,
        run_dir=run_dir,
        verbose=0,
        tensorboard=False,
        **train_kwargs,
    )
    return Trained(full_state(model, optimizer), result.history, model)


def by_hand(case: Case) -> Trained:
    """``case`` trained by the loop its user would write (module docstring), in this process."""
    model, optimizer = case.build()
    plan = Plan(len(case.data), BATCH, ENGINES, SEED)
    collate = case.kwargs.get("fn_batch_collate", default_collate)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        model.train()
        for epoch in range(case.epochs):
            order = epoch_permutation(SEED, epoch, len(case.data))
            for step in range(plan.steps_per_epoch):
                optimizer.zero_grad()
                total = plan.step_samples(epoch, step)
                start = {n: b.detach().clone() for n, b in model.named_buffers()}
                changes = {n: torch.zeros(b.shape) for n, b in start.items()}
                for j in range(plan.num_micro_batches(epoch, step)):
                    indices = plan.micro_batch_indices(epoch, step, j, order)
                    batch = collate([case.data[int(i)] for i in indices])
                    with torch.no_grad():
                        for n, b in model.named_buffers():
                            b.copy_(start[n])
                    seed = micro_batch_seed(SEED, epoch, step, j)
                    torch.manual_seed(seed)
                    if case.seed_own is not None:
                        case.seed_own(model, seed)
                    share = len(indices) / total
                    (case.hand_loss(model, batch) * share).backward()
                    for n, b in model.named_buffers():
                        change = (b.detach() - start[n]).float()
                        changes[n] += change * share if b.is_floating_point() else change
                with torch.no_grad():
                    for n, b in model.named_buffers():
                        total_change = changes[n] if b.is_floating_point() else changes[n].round().to(b.dtype)
                        b.copy_(start[n] + total_change)
                optimizer.step()
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)
    return Trained(full_state(model, optimizer), [], model)


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The weights, buffers and the optimizer's per-parameter tensors, by name."""
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, per_param in optimizer.state.items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                state[f"optimizer.{names.get(id(p), '?')}.{key}"] = value.detach().clone()
    return copy.deepcopy(state)


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names of the tensors that are not bitwise equal (or present in one state only)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return [k for k in a if not torch.equal(a[k], b[k])]


def loss_fell(trained: Trained) -> bool:
    """The last epoch's mean loss is below the first's."""
    losses = [h["loss"] for h in trained.train_history]
    return len(losses) >= 2 and losses[-1] < losses[0]
