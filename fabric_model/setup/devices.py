"""Which devices this host offers a job's workers, and how many workers to start on them.

IBM's ``engines_number`` was the most GPUs a job may use, so the number of workers started is
``min(engines_number, devices)``; the global batch stays what ``engines_number`` asked for, by
gradient accumulation (the plan's micro-batches do not change, only ``max_workers``).

``CUDA_VISIBLE_DEVICES``: TensorFlow scripts set it to ``""`` in the driver before importing
TensorFlow, to keep the driver off the GPU. That choice is the driver's own: when the value
differs from the one the process started with (``/proc/self/environ``, else the value when
``fabric_model`` was imported), the workers get the starting value back (or none), and the GPUs
are counted as they will see them. A value set before the process started (a cluster's
allocation) is kept.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from typing import Any

from ..settings.registry import CPU_WORKERS, CUDA_VISIBLE, LOCAL_WORKERS, WORKERS_PER_GPU, Setting
from .config import EngineSizing
from .cores import usable_cores

log = logging.getLogger("fabric_model")

_UNSET = "\0unset"  # not a value an environment variable can hold


def _starting_value(setting: Setting[str | None]) -> str | None:
    """``setting`` as this process's environment held it at exec time (Linux), else at import."""
    try:
        with open("/proc/self/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return setting.get()
    prefix = setting.name.encode() + b"="
    for entry in entries:
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


_CUDA_VISIBLE_AT_START = _starting_value(CUDA_VISIBLE)


def cuda_visible_for_workers(current: str | None = _UNSET) -> tuple[bool, str | None]:
    """(changed by the script?, the value workers get: None means unset)."""
    now = CUDA_VISIBLE.get() if current == _UNSET else current
    if now == _CUDA_VISIBLE_AT_START:
        return False, now
    return True, _CUDA_VISIBLE_AT_START


def worker_gpu_count() -> int:
    """CUDA GPUs the workers will see (0 without torch or a GPU)."""
    changed, value = cuda_visible_for_workers()
    if not changed:
        from .config import local_device_count

        return local_device_count()
    # torch in this process honours the script's value; count as the workers will, in a child.
    env = dict(os.environ)
    env.pop(CUDA_VISIBLE.name, None)
    if value is not None:
        env[CUDA_VISIBLE.name] = value
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        return int(out.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


def cpu_workers_from_environment() -> int | None:
    """``FABRIC_MODEL_CPU_WORKERS`` as a positive int, or None when unset."""
    return CPU_WORKERS.get()


def workers_per_gpu() -> int:
    """``FABRIC_MODEL_WORKERS_PER_GPU``: how many local workers may share one GPU (default 1)."""
    return WORKERS_PER_GPU.get()


def collective_backend(gpus: int, per_gpu: int = 1) -> str:
    """NCCL when every worker has a GPU of its own, else gloo (on CUDA tensors where workers
    share a GPU: NCCL refuses two ranks on one device, "Duplicate GPU detected")."""
    return "nccl" if gpus and per_gpu == 1 else "gloo"


@dataclasses.dataclass(frozen=True)
class WorkerCap:
    """How many workers start, on what, and a one-line reason."""

    workers: int
    device: str  # "gpu" or "cpu"
    capped: bool
    line: str


def cap_workers(requested: int, *, gpus: int, cores: int, cpu_workers: int | None, per_gpu: int = 1) -> WorkerCap:
    """``min(requested, devices)``: GPUs (``per_gpu`` workers each) where there are any, else
    usable cores or ``cpu_workers``."""
    if gpus > 0:
        shared = f", {WORKERS_PER_GPU.name}={per_gpu}" if per_gpu > 1 else ""
        limit, device, what = gpus * per_gpu, "gpu", f"{gpus} GPU(s){shared}"
    elif cpu_workers is not None:
        limit, device, what = cpu_workers, "cpu", f"{CPU_WORKERS.name}={cpu_workers}"
    else:
        limit, device, what = max(1, cores), "cpu", f"{cores} usable CPU core(s), no GPU"
    workers = max(1, min(requested, limit))
    capped = workers < requested
    why = (
        f"engines_number={requested} is capped by {what}; the global batch is kept by gradient accumulation"
        if capped
        else f"engines_number={requested}, {what}"
    )
    if capped and device == "cpu" and cpu_workers is None:
        why += f" (set {CPU_WORKERS.name}=N for more CPU workers)"
    elif capped and device == "gpu":
        why += f" (set {WORKERS_PER_GPU.name}=N to share each GPU among N workers)"
    said = f"{workers} worker{'s' if workers != 1 else ''} on {device.upper()}"
    return WorkerCap(workers, device, capped, f"[fabric-model] starting {said}: {why}.")


def report(cap: WorkerCap) -> None:
    """The one line: logged at INFO always, also printed to stderr when the cap applied."""
    log.info(cap.line)
    if cap.capped:
        print(cap.line, file=sys.stderr, flush=True)


def place_workers(sizing: EngineSizing, ray_cluster: Any = None) -> tuple[EngineSizing, int]:
    """The sizing and the GPUs per worker: local workers are capped by this host's devices (the
    micro-batches stay: fewer workers accumulate more of them); on Ray, ``engines_number`` actors
    are asked for, and those without room wait for it (pending)."""
    if ray_cluster is not None:
        return sizing, ray_cluster.gpus_per_worker
    gpus = worker_gpu_count()
    return _cap_by_devices(sizing, gpus), gpus


def _cap_by_devices(sizing: EngineSizing, gpus: int) -> EngineSizing:
    """``engines_number`` as a cap on the devices; says in one line how many workers start, and why."""
    cpu_workers = cpu_workers_from_environment()  # read once, here, in the caller
    per_gpu = workers_per_gpu()
    cap = cap_workers(sizing.max_workers, gpus=gpus, cores=usable_cores(), cpu_workers=cpu_workers, per_gpu=per_gpu)
    local = LOCAL_WORKERS.get()
    if local is not None and local < cap.workers:
        cap = local_cap(cap, local, sizing.max_workers)
    report(cap)
    return dataclasses.replace(sizing, max_workers=cap.workers)


def local_cap(cap: WorkerCap, local: int, requested: int) -> WorkerCap:
    """``FABRIC_MODEL_LOCAL_WORKERS``: fewer workers on the driver's host, or none; the rest of
    ``engines_number`` join from other hosts (``fabric-model worker``), and are waited for."""
    rest = requested - local
    line = (
        f"[fabric-model] starting {local} worker{'s' if local != 1 else ''} on this host "
        f"({LOCAL_WORKERS.name}={local}); "
        f"{rest} more of engines_number={requested} may join from other hosts "
        "(fabric-model worker --join RUN_DIR/join.json)."
    )
    return WorkerCap(local, cap.device, True, line)
