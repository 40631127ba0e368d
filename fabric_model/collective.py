"""The collective layer: one ``torch.distributed`` process group per generation.

Shared by both frameworks (Keras tensors cross in through DLPack). A membership change is
a new ``configure`` call on the same object, not a process restart (DESIGN §2, §4).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, hung past the timeout, or the group was aborted."""


class Collective:
    """A re-configurable communicator over a TCPStore hosted by the driver."""

    def __init__(self, store_address: tuple[str, int], backend: str, timeout: timedelta) -> None:
        self.backend = backend
        self.timeout = timeout
        self._store = dist.TCPStore(
            store_address[0], store_address[1], is_master=False, timeout=timeout, wait_for_workers=False
        )
        self.generation = -1
        self.rank = 0
        self.world_size = 1
        self._configured = False

    def configure(self, generation: int, rank: int, world_size: int) -> None:
        """Join the process group of ``generation`` as ``rank`` of ``world_size``."""
        self.shutdown()
        store = dist.PrefixStore(f"generation/{generation}/", self._store)
        dist.init_process_group(
            self.backend, store=store, rank=rank, world_size=world_size, timeout=self.timeout
        )
        self.generation, self.rank, self.world_size = generation, rank, world_size
        self._configured = True
        log.debug("joined generation %d as rank %d/%d", generation, rank, world_size)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place across the group (a no-op for a group of one)."""
        if self.world_size == 1:
            return
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        except RuntimeError as exc:  # gloo/NCCL report peer loss and timeouts this way
            raise CollectiveError(str(exc)) from exc

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Copy ``tensor`` from rank ``src`` to every rank, in place."""
        if self.world_size == 1:
            return
        try:
            dist.broadcast(tensor, src=src)
        except RuntimeError as exc:
            raise CollectiveError(str(exc)) from exc

    def shutdown(self) -> None:
        """Leave the current group, if any."""
        if self._configured and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a group whose peer died may not tear down cleanly
                log.debug("destroy_process_group failed: %r", exc)
        self._configured = False


def default_backend(device: Optional[str]) -> str:
    """NCCL for CUDA devices, gloo otherwise."""
    return "nccl" if device is not None and device.startswith("cuda") else "gloo"
