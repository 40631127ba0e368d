"""Workers that wait for a vanished driver, released by a run that will not take them back.

A driver killed without notice (a notebook's kernel restarted, say) leaves its workers waiting
for it, holding the model and the optimizer state, for ``FABRIC_MODEL_DRIVER_WAIT`` seconds
(worker/reattach.py). A new ``train()`` that does not take them back (no ``resume``, or
another run) ends them before it starts its own: for every ``join.json`` in its runs root (its
run directory's folder) whose driver's port on this host is free, which only a vanished
driver's is, it listens there with that run's own secret, as a restarted driver would, tells
each worker that comes to exit, and removes the ``join.json``. A peer that does not hold the
secret is refused by the handshake, as everywhere (transport/control.py). See
docs/elasticity.md, "A lost driver".
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from pathlib import Path

from ..run.rundir import RunDirectory
from ..transport import protocol as p
from ..transport.control import ControlServer
from ..transport.store.server import StoreService

log = logging.getLogger(__name__)

#: Waiting workers try their driver's address every 0.1 s: none within this many seconds of
#: listening means none waits; each one that comes gives the others this long again.
ARRIVAL = 1.0
#: The most one run's release may take (seconds).
LIMIT = 5.0


def release_waiting(run: RunDirectory) -> list[str]:
    """End the workers waiting for a vanished driver of a run in ``run``'s runs root (``run``
    included); returns a line for each run whose workers were ended, for the console."""
    root = run.path.parent
    found = sorted({*root.glob("*/join.json"), run.join_json})
    said = []
    for join in found:
        if not join.is_file():
            continue
        ended = _release(RunDirectory(join.parent))
        if ended:
            said.append(f"ended {len(ended)} worker(s) still waiting for the vanished driver of {join.parent}")
    return said


def _release(run: RunDirectory) -> list[int]:
    """The pids of the workers of ``run``'s vanished driver that were told to exit."""
    info = run.read_join_info()
    if info is None:
        return []
    (host, port), secret = info
    ids = itertools.count()
    try:
        server = ControlServer(secret, host=host, port=port, allocate_id=lambda: next(ids), store=StoreService())
    except OSError:
        return []  # a live driver listens there, or the address is another host's: not ours to end
    ended: list[int] = []
    try:
        began = last = time.monotonic()
        while time.monotonic() - last < ARRIVAL and time.monotonic() - began < LIMIT:
            try:
                worker_id, message = server.events.get(timeout=0.05)
            except queue.Empty:
                continue
            if isinstance(message, p.Hello) and message.held is not None:
                server.send(worker_id, p.Stop(ended=f"released: a new run started beside {run.path.name}"))
                ended.append(message.pid)
                last = time.monotonic()
    finally:
        server.close()
    _forget(run, secret)
    if ended:
        log.warning(
            "ended %d worker(s) (pids %s) that waited for the vanished driver of %s: this run does not take them "
            'back (train(..., resume="auto") would)',
            len(ended),
            ", ".join(map(str, ended)),
            run.path,
        )
    return ended


def _forget(run: RunDirectory, secret: bytes) -> None:
    """Remove ``join.json`` if it still holds ``secret``: no driver will take its workers back."""
    info = run.read_join_info()
    if info is not None and info[1] == secret:
        Path(run.join_json).unlink(missing_ok=True)
