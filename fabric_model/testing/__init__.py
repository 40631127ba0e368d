"""Fault injection for testing elastic jobs, with no test branch in the product's code paths
(docs/architecture.md, "Testing seams").

Worker-side faults ride in a worker logger, through the hooks' seams: the worker's collective
is what :meth:`FaultInjector.wrap_collective` returns (the manner of torchft's
``FakeProcessGroupWrapper``). Checkpoint files are written by the driver, so
:class:`CheckpointFault` acts through the driver's hooks: a ``FaultInjector`` given as the
driver logger (or a driver logger calling its ``wrap_checkpoint_stream``). Adding a worker is
a driver logger that starts one by hand, the way a user would on another host::

    faults = FaultInjector([Kill(worker=1, step=5), Hang(worker=2, step=9)], marker_dir=tmp)
    starter = WorkerStarter(run_dir, at_iterations=[7])
    FabricModel(..., worker_logger_callback=faults, driver_logger_callback=starter).train(...)
    starter.close()

``step`` is the global step (``epoch * steps_per_epoch + step``); ``worker`` is the worker id.
Each fault fires once per run (a marker file in ``marker_dir`` records it), so a step redone
after recovery runs clean; ``CheckpointFault("enospc", unit)`` alone fires on every write, as
a full disk would.
"""

from __future__ import annotations

from .faults import CheckpointFault, FailCollective, FaultInjector, Hang, HoldForJoin, Kill, Preempt, fired_at
from .starter import WorkerStarter

__all__ = [
    "CheckpointFault",
    "FailCollective",
    "FaultInjector",
    "Hang",
    "HoldForJoin",
    "Kill",
    "Preempt",
    "WorkerStarter",
    "fired_at",
]
