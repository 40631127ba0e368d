"""Run configuration: engine sizing, timeouts read from the environment, the train() knobs."""

from __future__ import annotations

import dataclasses
import os
import warnings
from datetime import timedelta

from ..transport.protocol import KEEP_FREED_MEMORY_ENV, SNAPSHOT_SECONDS_ENV, SNAPSHOT_SHARE_ENV, SNAPSHOT_STEPS_ENV

#: Environment variables that bound every blocking wait, in seconds. Each has a default here
#: and is read once, in the caller (:meth:`Timeouts.from_environment`), and sent to every
#: worker with the job, so that all workers of a job share the same bounds.
TIMEOUT_DEFAULTS: dict[str, float] = {
    # A spawned worker must connect to the driver and register within this time.
    "EDT_START_TIME_OUT": 120.0,
    # A collective (allreduce, broadcast) that takes longer than this is treated as failed.
    "EDT_COLLECTIVE_TIME_OUT": 120.0,
    # Workers leave within this time once the driver asks them to stop; then they are killed.
    "EDT_STOP_TIME_OUT": 10.0,
    # A worker silent this long (no heartbeat: frozen, SIGSTOPped) is removed, and killed if local.
    "EDT_HEARTBEAT_TIME_OUT": 10.0,
    # A joining worker waits this long for the generation and the state it pulls from a peer.
    "EDT_PULL_WEIGHT_TIME_OUT": 60.0,
    # After a failed collective, a worker waits this long for the driver's next generation.
    "EDT_RECOVERY_TIME_OUT": 120.0,
}


#: How often rank 0 sends the driver a snapshot of the state: every N committed steps, or once
#: T seconds have passed since the last one, whichever comes first (0 turns either off); the
#: steps' rule waits while snapshots would take more than SHARE of the time (0: never waits).
SNAPSHOT_DEFAULTS: dict[str, float] = {
    SNAPSHOT_STEPS_ENV: 100,
    SNAPSHOT_SECONDS_ENV: 30,
    SNAPSHOT_SHARE_ENV: 0.01,
}


def snapshot_setting(name: str) -> float:
    """A snapshot interval from the environment (a whole number of steps, or seconds), else its default."""
    raw = os.environ.get(name)
    if raw is None:
        return float(SNAPSHOT_DEFAULTS[name])
    steps, share = name.endswith("STEPS"), name.endswith("SHARE")
    try:
        value = int(raw) if steps else float(raw)
    except ValueError:
        value = -1
    if value < 0 or (share and value >= 1) or value != value:
        what = "a whole number of steps, 0 or more" if steps else "a number of seconds, 0 or more"
        what = "a fraction of the training time, 0 or more and below 1" if share else what
        raise ValueError(f"Expected the environment variable {name} to be {what}. Received: {name}={raw!r}")
    return float(value)


def keep_freed_memory_setting() -> bool:
    """``FABRIC_MODEL_KEEP_FREED_MEMORY``: ``1`` (default) or ``0``; read in the caller, before
    any worker starts (docs/architecture.md, "Worker memory")."""
    raw = os.environ.get(KEEP_FREED_MEMORY_ENV, "1").strip()
    if raw not in ("0", "1"):
        raise ValueError(
            f"Expected the environment variable {KEEP_FREED_MEMORY_ENV} to be 1 (workers keep freed memory for "
            f"their next step) or 0 (glibc's defaults). Received: {KEEP_FREED_MEMORY_ENV}={raw!r}"
        )
    return raw == "1"


def heartbeat_interval(heartbeat_timeout: float) -> float:
    """Seconds between a worker's heartbeats: a tenth of the heartbeat timeout, at most 1 s."""
    return min(1.0, heartbeat_timeout / 10)


def pull_failed_limit() -> int:
    """``EDT_PULL_FAILED_LIMITS`` (default 3): failed pulls after which a joining worker gives up."""
    raw = os.environ.get("EDT_PULL_FAILED_LIMITS", "3")
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"Expected EDT_PULL_FAILED_LIMITS to be a positive integer. Received: {raw!r}")
    return int(raw)


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Every bound of the job, in seconds, resolved once in the caller and shipped with the job."""

    start: float
    collective: float
    stop: float
    heartbeat: float
    pull: float
    recovery: float
    pull_failed_limit: int
    replace_workers: bool
    # The in-memory snapshot rank 0 uploads to the driver (docs/architecture.md, "Elasticity").
    snapshot_steps: int = int(SNAPSHOT_DEFAULTS[SNAPSHOT_STEPS_ENV])
    snapshot_seconds: float = SNAPSHOT_DEFAULTS[SNAPSHOT_SECONDS_ENV]
    snapshot_share: float = SNAPSHOT_DEFAULTS[SNAPSHOT_SHARE_ENV]

    @classmethod
    def from_environment(cls) -> Timeouts:
        """Read the ``EDT_*`` variables (defaults in :data:`TIMEOUT_DEFAULTS`); bad values raise here."""

        def seconds(name: str) -> float:
            return get_timeout(name).total_seconds()

        return cls(
            start=seconds("EDT_START_TIME_OUT"),
            collective=seconds("EDT_COLLECTIVE_TIME_OUT"),
            stop=seconds("EDT_STOP_TIME_OUT"),
            heartbeat=seconds("EDT_HEARTBEAT_TIME_OUT"),
            pull=seconds("EDT_PULL_WEIGHT_TIME_OUT"),
            recovery=seconds("EDT_RECOVERY_TIME_OUT"),
            pull_failed_limit=pull_failed_limit(),
            replace_workers=os.environ.get("EDT_REPLACE_WORKERS", "1") != "0",
            snapshot_steps=int(snapshot_setting(SNAPSHOT_STEPS_ENV)),
            snapshot_seconds=snapshot_setting(SNAPSHOT_SECONDS_ENV),
            snapshot_share=snapshot_setting(SNAPSHOT_SHARE_ENV),
        )


def get_timeout(name: str) -> timedelta:
    """The timeout named ``name``: the environment's value in seconds, else the default."""
    raw = os.environ.get(name)
    if raw is None:
        return timedelta(seconds=TIMEOUT_DEFAULTS[name])
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(
            f"Expected the environment variable {name} to be a number of seconds. Received: {name}={raw!r}"
        ) from None
    if seconds <= 0:
        raise ValueError(f"Expected {name} to be a positive number of seconds. Received: {name}={raw!r}")
    return timedelta(seconds=seconds)


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
        micro_batches: micro-batches per step (``global_batch / batch_size``).
        max_workers: the most workers that may be alive at once (``engines_number``).
        global_batch: samples per optimizer step, whatever the number of live workers.
    """

    micro_batches: int
    max_workers: int
    global_batch: int


def size_engines(batch_size: int, engines_number: int | None, effective_batch_size: int | None) -> EngineSizing:
    """Resolve the worker count and the global batch.

    - only ``engines_number``: global batch = ``batch_size * engines_number``, one
      micro-batch per worker;
    - only ``effective_batch_size``: one worker per micro-batch
      (``effective_batch_size / batch_size`` workers);
    - both: the global batch is ``effective_batch_size`` and ``engines_number`` caps the
      workers; with fewer workers than micro-batches each accumulates several (gradient
      accumulation). More workers than micro-batches would idle, so they are capped, with
      a warning. (Taking the larger of the two counts instead would rule out accumulation
      and oversubscribe the devices.)
    - neither: one worker per local GPU (1 without a GPU).
    """
    if effective_batch_size is not None:
        micro = effective_batch_size // batch_size
        engines = micro if engines_number is None else min(engines_number, micro)
        if engines_number is not None and engines_number > micro:
            warnings.warn(
                f"engines_number={engines_number} exceeds effective_batch_size / batch_size = {micro}: a step has only "
                f"{micro} micro-batches, so {micro} worker(s) will be used.",
                stacklevel=3,
            )
        return EngineSizing(micro, engines, effective_batch_size)
    engines = engines_number if engines_number is not None else max(1, local_device_count())
    return EngineSizing(engines, engines, batch_size * engines)


def _usable_cores() -> int:
    """Cores this process may run on (taskset, cgroup cpusets), not all the host has."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_worker(workers_on_host: int, cpu_count: int | None = None) -> int:
    """A fair share of this host's cores for each CPU worker's intra-op threads (at least 1)."""
    cores = cpu_count if cpu_count is not None else _usable_cores()
    return max(1, cores // max(1, workers_on_host))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything ``train()`` decided, shipped to every worker."""

    epochs: int
    batch_size: int
    sizing: EngineSizing
    seed: int
    num_dataloader_threads: int | None  # None: chosen by the worker (data.loader_threads)
    validation_freq: int
    checkpoint_freq: int
    timeouts: Timeouts
    backend: str  # "gloo" or "nccl"
    keep_freed_memory: bool = True  # worker/allocator.py
