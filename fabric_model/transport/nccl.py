"""NCCL's own failure handling, set for a worker whose generations end by abort, not by exit
(docs/architecture.md, "NCCL: a peer lost in a collective").

``ProcessGroupNCCL`` runs a watchdog thread over its collectives. With torch's default
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) the watchdog ends the process when it sees a collective
pass the group's timeout or an asynchronous NCCL error, such as the ``ncclRemoteError`` of a
peer that died. A survivor would then die with the peer it lost, where the driver regroups the
survivors. Its heartbeat monitor also ends the process, minutes after any rank's watchdog
reported a timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``, ``TORCH_NCCL_ENABLE_MONITORING``). The
collective layer (``collective.py``) already bounds every wait, polls for completion and aborts
the group when the driver says a peer is gone. So before a worker forms an NCCL group, the
watchdog only watches (``0``), the monitor and the dump are off, each unless the user set it,
and the watchdog's timeout lies past the collective layer's own deadline, so our abort comes first.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from datetime import timedelta

#: Set where the user has not: the watchdog only watches, no monitor ends the process, no dump.
ENVIRONMENT = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}

#: How far past the collective layer's deadline the watchdog's timeout lies (an abort that
#: itself hangs is bounded by it too: ``ProcessGroupNCCL.abort`` waits up to the timeout).
WATCHDOG_MARGIN = timedelta(seconds=60)


def prepare(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set :data:`ENVIRONMENT` where unset (torch reads it when a group is made); returns the
    values in effect, the user's where they chose."""
    env = os.environ if environ is None else environ
    return {name: env.setdefault(name, value) for name, value in ENVIRONMENT.items()}


def watchdog_timeout(deadline: timedelta) -> timedelta:
    """The NCCL group's own timeout for a collective layer that gives up after ``deadline``."""
    return deadline + WATCHDOG_MARGIN
