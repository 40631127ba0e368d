"""Unpickling the job in a worker, a CUDA state mapped to the CPU on a host without a GPU.

The job travels cloudpickled, the model's and optimizer's tensors in it as torch pickles them:
each storage saved with its device, and loaded back onto it. A model the caller had on a GPU
would then fail to unpickle on a worker whose host has none (a CPU host started by hand, a
CPU-only Ray node), with torch's message about deserializing on a CUDA device. Here such
storages load onto the CPU instead, and :func:`fit_device` decides where the worker trains: a
job whose workers train on GPUs takes no CPU worker, which is refused with its host named; a
job of CPU workers trains the state on the CPU, and the worker says so in one line
(docs/clusters.md, "Devices").
"""

from __future__ import annotations

import io
import logging
import pickle
import socket
from typing import Any

from ..setup.config import local_device_count

log = logging.getLogger("fabric_model")


class HostUnfit(RuntimeError):
    """This host cannot run the job's worker (not an error in the user's code: the job goes on)."""


class _JobUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose torch storages load onto the CPU where torch sees no CUDA device."""

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.mapped: set[str] = set()  # the CUDA devices whose storages were mapped to the CPU
        self._cuda: bool | None = None

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.storage" and name == "_load_from_bytes":
            return self._load_storage
        return super().find_class(module, name)

    def _load_storage(self, data: bytes) -> Any:
        import torch

        if self._cuda is None:
            self._cuda = torch.cuda.is_available()
        if self._cuda:
            return torch.load(io.BytesIO(data), weights_only=False)  # what torch's own reducer does

        def to_cpu(storage: Any, location: str) -> Any:
            if location.startswith("cuda"):
                self.mapped.add(location)
            return storage

        return torch.load(io.BytesIO(data), map_location=to_cpu, weights_only=False)


def load_job(payload: bytes) -> tuple[Any, set[str]]:
    """The unpickled job, and the CUDA devices whose state was mapped to the CPU (empty where
    this host has a GPU or the state was on the CPU)."""
    unpickler = _JobUnpickler(io.BytesIO(payload))
    return unpickler.load(), unpickler.mapped


def fit_device(
    given: str | None, mapped: set[str], on_gpus: bool, gpus: int | None = None, host: str | None = None
) -> str:
    """The device this worker trains on: ``given`` (``--device``, or the driver's slot), else a
    GPU of this host where the job's workers train on GPUs (``cuda:0`` of those it sees), else
    the CPU. ``mapped``: the CUDA devices whose state was mapped to the CPU; ``gpus``: this host's
    (counted when None).

    A job on GPUs takes no CPU worker: its replica's steps would not give the GPU replicas' bits
    (the replica checks would halt the job) and NCCL takes no CPU tensor. Such a worker, or one
    given a GPU its host lacks, is refused with :class:`HostUnfit`, naming the host; the job goes
    on without it. A job of CPU workers trains a state mapped from CUDA on the CPU, and says so."""
    if gpus is None and (on_gpus or (given or "cpu") != "cpu"):  # a CPU job asks torch nothing
        gpus = local_device_count()
    device = given or ("cuda:0" if on_gpus and gpus else "cpu")
    if (device == "cpu" and not on_gpus) or (device != "cpu" and gpus):
        if mapped:
            log.warning(
                "host %s has no GPU: the job's model state, on %s in the caller, is mapped to the CPU and trains there",
                host or socket.gethostname(),
                ", ".join(sorted(mapped)),
            )
        return device
    host = host or socket.gethostname()
    if gpus:  # on_gpus, and told to use the CPU
        raise HostUnfit(
            f"this worker on host {host} was given device 'cpu', but the job's workers train on GPUs: "
            "give it a GPU (--device cuda:N), or no --device for this host's first."
        )
    where = f"host {host} has no GPU (torch sees no CUDA device)"
    fix = "start this worker on a host with a GPU, or train the whole job on CPUs"
    if device != "cpu":
        raise HostUnfit(f"{where}, but this worker was given device {device!r}: {fix}.")
    raise HostUnfit(f"{where}, but the job's workers train on GPUs: {fix}.")
