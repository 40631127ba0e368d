"""What ``train()`` decides before any worker starts: its checked arguments, the run's sizing,
and the job as every worker receives it. Errors name the argument, what was received and
what is accepted."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import warnings
from typing import TYPE_CHECKING, Any

from ..frameworks.shipping import dumps as dump_job
from ..run.rundir import RunDirectory
from ..settings.registry import DETERMINISTIC_THREADS, DIVERGENCE_CHECK_STEPS, SMALL_STEP_FLOPS
from ..setup.checks import check_batch_level
from ..setup.config import (
    EngineSizing,
    LoopOptions,
    Preemption,
    SnapshotCadence,
    Timeouts,
    TrainConfig,
    keep_freed_memory_setting,
    size_engines,
    threads_per_worker,
)
from ..setup.devices import collective_backend, workers_per_gpu
from ..setup.job import Job
from ..step.data import is_batch_level
from .unpicklable import Unpicklable, find_unpicklable

if TYPE_CHECKING:
    from ..driver.driver import DriverSetup

log = logging.getLogger(__name__)

#: A job larger than this is shipped with a warning: data captured by datasets_function travels with it.
LARGE_JOB_BYTES = 256 * 2**20


def size_run(
    train_set: Any, batch_size: int, engines_number: int | None, effective_batch_size: int | None
) -> tuple[int, EngineSizing]:
    """(dataset items per micro-batch, the engines' sizing)."""
    # A batch-level dataset (keras.utils.PyDataset) yields whole batches: the plan counts
    # its items, each item is one micro-batch, and batch_size must be the dataset's own.
    batch_level = is_batch_level(train_set)
    items_per_micro_batch = 1 if batch_level else batch_size
    if batch_level:
        check_batch_level(train_set, batch_size)
    sizing = size_engines(
        items_per_micro_batch,
        engines_number,
        None if effective_batch_size is None else effective_batch_size // batch_size * items_per_micro_batch,
    )
    return items_per_micro_batch, sizing


def serialize_job(job: Job) -> bytes:
    """The job every worker receives, cloudpickled once; a job that cannot travel fails here."""
    try:
        payload = dump_job(job)
    except Exception as exc:
        raise TypeError(_unpicklable_message(job, exc)) from exc
    if len(payload) > LARGE_JOB_BYTES:
        warnings.warn(
            f"The job sent to each worker is {len(payload) / 2**20:,.0f} MiB. Data captured by datasets_function "
            "(or tensors that are views of a larger tensor) travel with it. HINT: load or build the data inside "
            "datasets_function, and .clone() tensor slices.",
            stacklevel=5,
        )
    return payload


def _unpicklable_message(job: Job, exc: Exception) -> str:
    """One message naming the part of the job that failed, as the user names it, and what works instead."""
    part = find_unpicklable(job)
    if part is None:  # only the whole fails (objects fine alone, not together)
        part = Unpicklable("the job (model, optimizer, datasets_function, loss_function, metrics, loggers)", job, exc)
        what = part.path
    else:
        cls = type(part.obj)
        what = f"`{part.path}` (a {'' if cls.__module__ == 'builtins' else cls.__module__ + '.'}{cls.__qualname__})"
    return f"Could not serialize the job for the workers: {what} cannot be pickled: {part.error!r}. HINT: {part.hint()}"


def train_config(epoch_number: int, batch_size: int, sizing: EngineSizing, loop: LoopOptions, gpus: int) -> TrainConfig:
    """What every worker is told of the run, its bounds included."""
    return TrainConfig(
        epochs=epoch_number,
        batch_size=batch_size,
        sizing=sizing,
        num_dataloader_threads=loop.num_dataloader_threads,
        validation_freq=loop.validation_freq,
        checkpoint_freq=loop.checkpoint_freq,
        timeouts=Timeouts.from_environment(),  # read once, here; every worker gets the same bounds
        snapshots=SnapshotCadence.from_environment(),
        preemption=Preemption.from_environment(),
        backend=collective_backend(gpus, workers_per_gpu()),  # as the workers will see the GPUs
        on_gpus=gpus > 0,
        keep_freed_memory=keep_freed_memory_setting(),
        replica_check_steps=DIVERGENCE_CHECK_STEPS.get(),
        shard_optimizer_state=bool(loop.shard_optimizer_state),
        num_dataloader_processes=loop.num_dataloader_processes or 0,
        checkpoint_steps=loop.checkpoint_steps,
    )


def slot_devices(count: int, gpus: int) -> list[str | None]:
    """One device per worker slot: the local GPUs in turn (``count`` is capped at ``gpus`` times
    ``FABRIC_MODEL_WORKERS_PER_GPU``), else the CPU."""
    return [f"cuda:{i % gpus}" if gpus else "cpu" for i in range(count)]


def open_run(run_dir: str | os.PathLike[str] | None, setup: DriverSetup) -> RunDirectory:
    """The run directory, created, with ``run.json`` recording the call that started (or resumed) it."""
    run = RunDirectory.resolve(run_dir).create()
    config, plan = dataclasses.asdict(setup.config), dataclasses.asdict(setup.plan)
    record = {"framework": setup.framework, "config": config, "plan": plan, "started": time.time()}
    if setup.data is not None:
        record["data"] = setup.data  # a sharded dataset's shards, samples, counting time and skipped shards
    run.write_run_record(record)
    return run


#: The variable's name, as benchmarks/bench_deterministic.py imports it (declared in :mod:`.settings`).
DETERMINISTIC_THREADS_ENV = DETERMINISTIC_THREADS.name


def deterministic_threads() -> int:
    """The intra-op thread count of ``deterministic=True`` (``$FABRIC_MODEL_DETERMINISTIC_THREADS``, default 1):
    one count for any number of workers, since a GEMM may block, and round, differently with another thread count."""
    return DETERMINISTIC_THREADS.get()


#: A training step's operations per forward operation: the forward, then the backward's two
#: products (the inputs' gradients and the weights') for each of its products.
STEP_PER_FORWARD = 3


def micro_batch_flops(first_forward: int | None, first_items: int, items_per_micro_batch: int) -> float | None:
    """A training micro-batch's FLOPs, from the first batch's forward (``first_items`` dataset
    items; frameworks/torch/flops.py) scaled to ``items_per_micro_batch``; None where not counted."""
    if first_forward is None or first_items < 1:
        return None
    return STEP_PER_FORWARD * first_forward * items_per_micro_batch / first_items


def worker_threads(
    deterministic: bool, ray_cluster: Any, gpus: int, max_workers: int, step_flops: float | None = None
) -> tuple[int, str]:
    """Intra-op threads per CPU worker, and why: a fixed count when deterministic, one for a CPU
    step of fewer than ``$FABRIC_MODEL_SMALL_STEP_FLOPS`` (``step_flops``: a micro-batch's, where
    counted), else a fair share of the cores (docs/architecture.md, "Intra-op threads")."""
    if deterministic:
        return deterministic_threads(), "deterministic=True fixes them"
    share = int(ray_cluster.threads) if ray_cluster else threads_per_worker(1 if gpus else max_workers)
    small = SMALL_STEP_FLOPS.get()
    if share > 1 and not gpus and step_flops is not None and step_flops < small:
        # A chain of small operations: a second thread's fork and join cost more than it saves.
        return 1, f"a micro-batch's step is about {step_flops:.3g} FLOPs, under {SMALL_STEP_FLOPS.name}={small:g}"
    return share, "a share of the cores"


def make_deterministic(framework: str, adapter: Any, max_micro_batches: int) -> Any:
    """The adapter of ``deterministic=True``: the framework chooses its exact step sums."""
    from ..frameworks import framework_named

    return framework_named(framework).deterministic(adapter, max_micro_batches)
