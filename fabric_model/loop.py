"""The worker's training loop: the steps of DESIGN §3 for one generation of workers."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Hashable, Iterator, Optional

import numpy as np
import torch

from . import control
from .adapters.base import FrameworkAdapter
from .callbacks import call_hook, stat_means
from .collective import Collective
from .config import TrainConfig
from .control import Channel
from .data import PrefetchLoader
from .plan import Plan, assigned_micro_batches, epoch_permutation, eval_batches, micro_batch_seed

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Job:
    """What the driver ships to every worker (cloudpickled as one object, so the optimizer
    keeps pointing at the model's own parameters after unpickling)."""

    adapter: FrameworkAdapter
    get_datasets: Callable[[], tuple[Any, Any]]
    worker_logger: Optional[Any] = None


class TrainingLoop:
    """Runs the plan from a position to the end, as ``rank`` of ``world_size``."""

    def __init__(
        self,
        job: Job,
        config: TrainConfig,
        plan: Plan,
        channel: Channel,
        collective: Collective,
        train_set: Any,
        test_set: Any,
    ) -> None:
        self.job, self.config, self.plan = job, config, plan
        self.adapter = job.adapter
        self.channel = channel
        self.collective = collective
        self.train_set, self.test_set = train_set, test_set
        self.iterations = 0  # steps this worker took part in

    # -- schedule -------------------------------------------------------------------------
    def _schedule(self, start_epoch: int) -> Iterator[tuple[Hashable, np.ndarray]]:
        """The micro-batches this rank computes, in order, from ``start_epoch`` on."""
        rank, world = self.collective.rank, self.collective.world_size
        for epoch in range(start_epoch, self.config.epochs):
            perm = epoch_permutation(self.plan.seed, epoch, self.plan.num_samples)
            for step in range(self.plan.steps_per_epoch):
                for j in assigned_micro_batches(self.plan.num_micro_batches(epoch, step), rank, world):
                    yield (epoch, step, j), self.plan.micro_batch_indices(epoch, step, j, perm)

    # -- the loop -------------------------------------------------------------------------
    def run(self, start_epoch: int = 0) -> None:
        loader = PrefetchLoader(self.train_set, self.adapter.collate, self.config.num_dataloader_threads)
        call_hook(self.job.worker_logger, "on_train_begin")
        try:
            batches = loader.iterate(self._schedule(start_epoch))
            for epoch in range(start_epoch, self.config.epochs):
                for step in range(self.plan.steps_per_epoch):
                    self._step(epoch, step, batches)
                if self.test_set is not None and (epoch + 1) % self.config.validation_freq == 0:
                    self._validate(epoch)
        finally:
            loader.close()
        call_hook(self.job.worker_logger, "on_train_end")

    def _step(self, epoch: int, step: int, batches: Iterator[tuple[Hashable, np.ndarray, Any]]) -> None:
        plan, adapter = self.plan, self.adapter
        step_samples = plan.step_samples(epoch, step)
        mine = assigned_micro_batches(plan.num_micro_batches(epoch, step), self.collective.rank, self.collective.world_size)
        adapter.begin_step()
        for j in mine:
            key, indices, batch = next(batches)
            assert key == (epoch, step, j), f"loader out of order: {key} != {(epoch, step, j)}"
            adapter.train_micro_batch(batch, len(indices), step_samples, micro_batch_seed(plan.seed, epoch, step, j))
        self.collective.all_reduce_sum(adapter.step_buffer)
        stats = adapter.finish_step()
        self.iterations += 1
        report: dict[str, Any] = {
            "generation": self.collective.generation,
            "epoch": epoch,
            "step": step,
            "rank": self.collective.rank,
            "micro_batches": list(mine),
        }
        if self.collective.rank == 0:
            report["stats"] = stats
        self.channel.send(control.STEP, report)
        if self.job.worker_logger is not None:
            metrics = stat_means(adapter.stat_names, stats)
            call_hook(self.job.worker_logger, "log_train_metrics", metrics, self.iterations, epoch, self.collective.world_size)

    def _validate(self, epoch: int) -> None:
        adapter = self.adapter
        sums = torch.zeros(len(adapter.stat_names) + 1, dtype=torch.float64)
        loader = PrefetchLoader(self.test_set, adapter.collate, self.config.num_dataloader_threads)
        try:
            chunks = eval_batches(len(self.test_set), self.config.batch_size, self.collective.rank, self.collective.world_size)
            for _, indices, batch in loader.iterate((i, idx) for i, idx in enumerate(chunks)):
                sums += adapter.evaluate(batch, len(indices))
        finally:
            loader.close()
        reduced = sums.to(adapter.step_buffer.device)
        self.collective.all_reduce_sum(reduced)
        stats = reduced.cpu().tolist()
        if self.collective.rank == 0:
            self.channel.send(control.EVAL, {"epoch": epoch, "stats": stats})
        if self.job.worker_logger is not None:
            call_hook(self.job.worker_logger, "log_test_metrics", stat_means(adapter.stat_names, stats), self.iterations, epoch)
