"""Run configuration: engine sizing, the bounds and snapshot cadence read from the environment, the train() knobs."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, NamedTuple

from ..settings import registry as settings
from ..settings.profile_window import ProfileWindow
from .cores import usable_cores


def keep_freed_memory_setting() -> bool:
    """``FABRIC_MODEL_KEEP_FREED_MEMORY``: ``1`` (default) or ``0``; read in the caller, before
    any worker starts (docs/architecture.md, "Worker memory")."""
    return settings.KEEP_FREED_MEMORY.get()


def heartbeat_interval(heartbeat_timeout: float) -> float:
    """Seconds between a worker's heartbeats: a tenth of the heartbeat timeout, at most 1 s."""
    return min(1.0, heartbeat_timeout / 10)


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Every bound of the job, in seconds (the ``EDT_*`` settings), resolved once in the caller and
    shipped with the job, so that all workers of a job share the same bounds."""

    start: float
    collective: float
    stop: float
    heartbeat: float
    pull: float
    recovery: float
    pull_failed_limit: int
    replace_workers: bool
    #: How long workers wait for a vanished driver to come back (``FABRIC_MODEL_DRIVER_WAIT``).
    driver_wait: float = 0.0

    @classmethod
    def from_environment(cls) -> Timeouts:
        """Read the ``EDT_*`` variables (defaults in :mod:`.settings`); bad values raise here."""
        return cls(
            start=settings.START_TIMEOUT.get(),
            collective=settings.COLLECTIVE_TIMEOUT.get(),
            stop=settings.STOP_TIMEOUT.get(),
            heartbeat=settings.HEARTBEAT_TIMEOUT.get(),
            pull=settings.PULL_TIMEOUT.get(),
            recovery=settings.RECOVERY_TIMEOUT.get(),
            pull_failed_limit=settings.PULL_FAILED_LIMITS.get(),
            replace_workers=settings.REPLACE_WORKERS.get(),
            driver_wait=settings.DRIVER_WAIT.get(),
        )


@dataclasses.dataclass(frozen=True)
class Preemption:
    """What a notice to leave is and how long leaving may take (docs/elasticity.md, "Preemption"):
    the signals that mean it, and the grace within which a worker finishes its step and the
    driver saves and exits."""

    signals: tuple[str, ...] = settings.PREEMPT_SIGNALS.default
    grace: float = settings.PREEMPT_GRACE.default

    @classmethod
    def from_environment(cls) -> Preemption:
        return cls(signals=settings.PREEMPT_SIGNALS.get(), grace=settings.PREEMPT_GRACE.get())


@dataclasses.dataclass(frozen=True)
class SnapshotCadence:
    """How often rank 0 sends the driver an in-memory snapshot of the state (docs/architecture.md,
    "Elasticity"): every ``steps`` committed steps, or once ``seconds`` have passed since the last
    one, whichever comes first (0 turns either off); the steps' rule waits while snapshots would
    take more than ``share`` of the time (0: never waits)."""

    steps: int = settings.SNAPSHOT_STEPS.default
    seconds: float = settings.SNAPSHOT_SECONDS.default
    share: float = settings.SNAPSHOT_SHARE.default

    @classmethod
    def from_environment(cls) -> SnapshotCadence:
        """Read the ``FABRIC_MODEL_SNAPSHOT_*`` variables; bad values raise here."""
        return cls(
            steps=settings.SNAPSHOT_STEPS.get(),
            seconds=settings.SNAPSHOT_SECONDS.get(),
            share=settings.SNAPSHOT_SHARE.get(),
        )


def local_device_count() -> int:
    """Number of local accelerators (CUDA GPUs); 0 on a machine without one."""
    try:
        import torch  # here, not at the top: `import fabric_model` stays free of torch
    except ImportError:  # pragma: no cover - torch is a hard dependency of the collective layer
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclasses.dataclass(frozen=True)
class EngineSizing:
    """How many micro-batches make a step, and how many workers may run at once.

    Attributes:
        micro_batches: micro-batches per step (``global_batch / per_micro_batch``).
        max_workers: the most workers that may be alive at once (``engines_number``).
        global_batch: samples per optimizer step, whatever the number of live workers.
    """

    micro_batches: int
    max_workers: int
    global_batch: int


def size_engines(per_micro_batch: int, engines_number: int | None, effective_batch: int | None) -> EngineSizing:
    """Resolve the worker count and the global batch, counted in dataset items: ``per_micro_batch``
    items a micro-batch (``batch_size`` samples, or 1 of a dataset that yields whole batches) and
    ``effective_batch`` items a step (``effective_batch_size`` in such items).

    - only ``engines_number``: global batch = ``per_micro_batch * engines_number``, one
      micro-batch per worker;
    - only ``effective_batch_size``: one worker per micro-batch
      (``effective_batch / per_micro_batch`` workers);
    - both: the global batch is ``effective_batch_size`` and ``engines_number`` caps the
      workers; with fewer workers than micro-batches each accumulates several (gradient
      accumulation). More workers than micro-batches would idle, so they are capped, with
      a warning. (Taking the larger of the two counts instead would rule out accumulation
      and oversubscribe the devices.)
    - neither: one worker per local GPU (1 without a GPU).
    """
    if effective_batch is not None:
        micro = effective_batch // per_micro_batch
        engines = micro if engines_number is None else min(engines_number, micro)
        if engines_number is not None and engines_number > micro:
            warnings.warn(
                f"engines_number={engines_number} exceeds effective_batch_size / batch_size = {micro}: a step has only "
                f"{micro} micro-batches, so {micro} worker(s) will be used.",
                stacklevel=3,
            )
        return EngineSizing(micro, engines, effective_batch)
    engines = engines_number if engines_number is not None else max(1, local_device_count())
    return EngineSizing(engines, engines, per_micro_batch * engines)


def threads_per_worker(workers_on_host: int, cpu_count: int | None = None) -> int:
    """A fair share of this host's cores for each CPU worker's intra-op threads (at least 1)."""
    cores = cpu_count if cpu_count is not None else usable_cores()
    return max(1, cores // max(1, workers_on_host))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything ``train()`` decided, shipped to every worker."""

    epochs: int
    batch_size: int
    sizing: EngineSizing
    num_dataloader_threads: int | None  # None: chosen by the worker (data.loader_threads)
    validation_freq: int
    checkpoint_freq: int
    timeouts: Timeouts
    snapshots: SnapshotCadence
    backend: str  # "gloo" or "nccl"
    #: The job's workers train on GPUs (a worker on a host without one is refused: worker/job_loading.py).
    on_gpus: bool = False
    keep_freed_memory: bool = True  # worker/allocator.py
    #: Replicas compare state fingerprints every this many steps and after each epoch (0: at the
    #: end only): docs/architecture.md, "Replica checks". Read once in the caller, so all compare alike.
    replica_check_steps: int = 0
    preemption: Preemption = Preemption()
    #: A sharded test set's shard lengths, as the caller counted them (streams/datasets.py); empty otherwise.
    test_shard_lengths: tuple[int, ...] = ()
    #: The global steps rank 0 profiles (``train(profile=...)``: fabric_model/profiling/), None for none.
    profile: ProfileWindow | None = None
    #: The model's parameters that need no gradient and hold the job's values (the driver fills them
    #: in): what travels leaves them out (docs/architecture.md, "State that does not change").
    frozen: tuple[str, ...] = ()
    #: Each member holds and updates its slices of the optimizer state only (docs/elasticity.md,
    #: "Sharded optimizer state").
    shard_optimizer_state: bool = False
    #: Processes per worker reading its micro-batches (0: threads; frameworks/torch/reader_processes.py).
    num_dataloader_processes: int = 0
    #: Also checkpoint after every this many optimizer steps of the run (0: at epoch ends only:
    #: state/checkpoint.py, ``checkpoint_due``).
    checkpoint_steps: int = 0


class LoopOptions(NamedTuple):
    """``train``'s knobs of the loop, as given (checked by :func:`~fabric_model.setup.checks.check_train_arguments`)."""

    num_dataloader_threads: Any
    validation_freq: Any
    checkpoint_freq: Any
    keep_checkpoints: Any
    deterministic: Any = False
    profile: Any = None
    shard_optimizer_state: Any = False
    num_dataloader_processes: Any = None
    checkpoint_steps: Any = 0
