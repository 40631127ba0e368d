"""The collective layer: one ``torch.distributed`` process group per generation.

Shared by both frameworks. A membership change is a new ``configure`` call on the same
object, not a process restart (docs/architecture.md, "Elasticity").

The group objects are created directly (not as torch's global default group), so an
operation that will never finish can be *abandoned*: gloo's ``abort()`` does not wake a
rank blocked in an allreduce, so every operation is waited on in short slices, and between
slices the worker checks whether the driver asked it to give up (a peer was lost or froze).
An abandoned group is kept alive (its destructor would wait on the stuck operation) and
the caller must stop using the tensors it handed over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import nccl

log = logging.getLogger(__name__)

#: How often a worker blocked in a collective checks for an abort request. A survivor waiting
#: on another survivor (not on the dead peer, whose socket errors at once) learns of the loss
#: only here, so this bounds the kill -> next step time; a wake-up that finds nothing costs
#: microseconds.
_WAIT_SLICE = timedelta(seconds=0.01)


class _Works:
    """Several operations waited on as one (``Collective._wait`` waits on it in slices)."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self._works:  # one already finished returns at once when waited on again
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, hung past the timeout, or the driver aborted it."""


class Collective:
    """A re-configurable communicator over the driver's rendezvous store.

    Args:
        store: the rendezvous store (a :class:`~fabric_model.transport.store.client.RemoteStore` in a
            worker); generation ``g`` uses its keys under ``generation/{g}/``.
        backend: ``"gloo"`` or ``"nccl"``.
        timeout: the longest one operation may take.
        device: where tensors of this worker live.
        should_abort: asked between wait slices with the current generation; True makes
            the operation in flight fail with :class:`CollectiveError`.
    """

    def __init__(
        self,
        store: dist.Store,
        backend: str,
        timeout: timedelta,
        device: str = "cpu",
        should_abort: Callable[[int], bool] = lambda generation: False,
    ) -> None:
        self.backend = backend
        self.device = torch.device(device)
        self.timeout = timeout
        self.should_abort = should_abort
        self._store = store
        self._group: Any = None
        self._abandoned: list[Any] = []
        self.generation = -1
        self.rank = 0
        self.world_size = 1

    def configure(self, generation: int, rank: int, world_size: int) -> None:
        """Join the process group of ``generation`` as ``rank`` of ``world_size``."""
        self.shutdown()
        self.generation, self.rank, self.world_size = generation, rank, world_size
        if self.should_abort(generation):
            raise CollectiveError(f"generation {generation} was aborted before it formed")
        store = dist.PrefixStore(f"generation/{generation}/", self._store)
        if world_size == 1:
            return  # nothing to exchange: no group, no sockets
        try:
            if self.backend == "nccl":
                nccl.prepare()  # its watchdog must not end a survivor (nccl.py)
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = nccl.watchdog_timeout(self.timeout)  # past our deadline: our abort first
                self._group = dist.ProcessGroupNCCL(store, rank, world_size, options)
            else:
                self._group = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
        except RuntimeError as exc:  # a peer died or froze before the group formed, or the store fenced us out
            raise CollectiveError(f"forming generation {generation} failed: {exc}") from exc
        log.debug("joined generation %d as rank %d/%d", generation, rank, world_size)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place across the group (a no-op for a group of one)."""
        if self.world_size > 1:
            self._wait(self._group.allreduce([tensor]), "allreduce")

    def all_reduce_start(self, tensor: torch.Tensor) -> Any:
        """Start summing ``tensor`` in place; pass the result to ``wait`` (None for a group of one)."""
        return self._start_all_reduce(tensor, None)

    def all_reduce_max_start(self, tensor: torch.Tensor) -> Any:
        """Start the elementwise max of ``tensor`` in place, as ``all_reduce_start`` (deterministic mode)."""
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
        return self._start_all_reduce(tensor, options)

    def _start_all_reduce(self, tensor: torch.Tensor, options: Any) -> Any:
        """The allreduce with ``options`` (default: sum), unless the group is one or the driver aborted."""
        if self.world_size == 1:
            return None
        if self.should_abort(self.generation):
            self._abandon()
            raise CollectiveError(f"allreduce of generation {self.generation} aborted by the driver")
        return self._group.allreduce([tensor]) if options is None else self._group.allreduce([tensor], options)

    def all_gather_start(self, output: torch.Tensor, tensor: torch.Tensor) -> Any:
        """Start gathering every rank's ``tensor`` into ``output[rank]`` (``output`` has one
        row per rank), as ``all_reduce_start`` (deterministic mode's ordered sum).

        On gloo, one broadcast from each rank: steps measured 1.05-1.4x faster than with gloo's
        allgather. Not point to point: a gloo send/recv cannot be
        polled, and a wait on one that times out closes the connection, so it could not be
        waited on in abortable slices."""
        output[self.rank].copy_(tensor.view_as(output[self.rank]))
        if self.world_size == 1:
            return None
        if self.should_abort(self.generation):
            self._abandon()
            raise CollectiveError(f"allgather of generation {self.generation} aborted by the driver")
        if self.backend == "nccl":
            return self._group._allgather_base(output.view(-1), tensor.view(-1))
        return _Works([self._group.broadcast(output[root], root) for root in range(self.world_size)])

    def spread_start(self, output: torch.Tensor, tensor: torch.Tensor) -> Any:
        """``all_gather_start`` for the updated slices of a sharded optimizer state, after the step's
        update (frameworks/torch/sharded.py): a seam of its own for tests' faults."""
        return self.all_gather_start(output, tensor)

    def wait(self, work: Any) -> None:
        """Wait for an operation from ``all_reduce_start`` (abortable, bounded)."""
        if work is not None:
            self._wait(work, "allreduce")

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Copy ``tensor`` from rank ``src`` to every rank, in place."""
        if self.world_size > 1:
            self._wait(self._group.broadcast(tensor, src), "broadcast")

    def broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        """Send ``data`` from rank ``src`` to every rank; others pass None and get it back."""
        if self.world_size == 1:
            assert data is not None
            return data
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=self.device)
        self.broadcast(size, src)
        if self.rank == src:
            assert data is not None
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        else:
            buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(buffer, src)
        return data if self.rank == src and data is not None else buffer.cpu().numpy().tobytes()

    def _wait(self, work: Any, what: str) -> None:
        if self.should_abort(self.generation):
            self._abandon()
            raise CollectiveError(f"{what} of generation {self.generation} aborted by the driver")
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            try:
                if self.backend == "nccl":
                    done = work.is_completed()  # NCCL's wait(timeout) would tear the communicator down
                    if done:
                        work.wait()
                        return
                    time.sleep(0.001)
                else:
                    work.wait(_WAIT_SLICE)
                    return
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower():
                    self._abandon()
                    raise CollectiveError(f"{what} failed: {exc}") from exc
            if self.should_abort(self.generation):
                self._abandon()
                raise CollectiveError(f"{what} of generation {self.generation} aborted by the driver")
            if time.monotonic() > deadline:
                self._abandon()
                raise CollectiveError(f"{what} timed out after {self.timeout} (EDT_COLLECTIVE_TIME_OUT)")

    def _abandon(self) -> None:
        if self._group is not None:
            if self.backend == "nccl":
                try:  # frees the communicator; a stuck kernel returns (nccl.py)
                    self._group.abort()
                except RuntimeError as exc:  # its ncclCommAbort outlived the group's timeout
                    log.warning("aborting the NCCL group of generation %d failed: %s", self.generation, exc)
            self._abandoned.append(self._group)
            self._group = None

    def shutdown(self) -> None:
        """Leave the current group, if any."""
        self._group = None
