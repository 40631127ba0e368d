"""A worker whose driver vanished: it keeps its state and waits, bounded, for the driver to come back.

A driver killed without notice (SIGKILL, the OOM killer, its host lost) closes every control
connection with no :class:`~fabric_model.transport.protocol.Stop`. A worker that holds the
training state then does not exit: it gives up its generation's collectives (the step under
way is undone, as after a lost peer), parks its training thread where it waits for the
driver's next message, and tries the driver's address again, with the job's secret, for
``FABRIC_MODEL_DRIVER_WAIT`` seconds. The same command run again with ``resume="auto"``
listens there (``join.json``) and takes it back: its first message says what it holds
(:class:`~fabric_model.transport.protocol.Held`). A peer at the address that does not hold
the secret is refused before anything it sends is read. When no driver comes within the
wait, the worker exits as it did before, leaving nothing behind. See docs/elasticity.md,
"A lost driver", and docs/architecture.md, "A lost driver".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from typing import Any

from ..transport import control
from ..transport import protocol as p
from ..transport.control import Channel

log = logging.getLogger(__name__)

#: Seconds between tries of the driver's address while it is away, and the most one try's
#: connection and handshake may take (a silent peer at the address cannot hold the worker).
RETRY_EVERY, TRY_WITHIN = 0.1, 5.0
#: Seconds between looks at the run's ``join.json``: a newer run that took its place ends the wait.
TAKEN_OVER_EVERY = 0.5


class LossyChannel(Channel):
    """The worker's end of the control channel: a send that finds the driver gone is dropped
    instead of raising, so the training loop runs on to its next abort check, and
    :meth:`attach` puts a new driver's connection in its place."""

    def send(self, message: Any, data: bytes | None = None) -> None:
        try:
            super().send(message, data)
        except (OSError, EOFError, ValueError):
            pass  # the driver is gone: the inbox thread knows, and waits for it to come back

    def send_soon(self, message: Any, within: float) -> None:
        try:
            super().send_soon(message, within)
        except (OSError, EOFError, ValueError):
            pass

    def flush(self, older_than: float = 0.0) -> None:
        try:
            super().flush(older_than)
        except (OSError, EOFError, ValueError):
            pass

    def detach(self) -> None:
        """The driver is gone: close our end; what is sent until :meth:`attach` is dropped."""
        self.shutdown()

    def attach(self, other: Channel) -> None:
        """Send on ``other``'s connection from now on (``other`` is given up); held messages,
        meant for the vanished driver, are dropped."""
        with self._lock:
            self._conn: Connection = other._conn
            self._held = []
            self.holding.clear()


@dataclasses.dataclass
class DriverWait:
    """How a worker waits for its vanished driver (the inbox thread runs it).

    Attributes:
        address, secret: where the driver listened, and the job's secret.
        worker_id: this worker's id, which the driver gave it.
        wait: seconds to wait in all (``FABRIC_MODEL_DRIVER_WAIT``).
        held: what this worker holds once its training thread is parked; None: nothing worth
            keeping (it never entered a generation, or it handed over its final state).
        reopened: called once the driver is back (the rendezvous store's own connection).
        join_file: the run's ``join.json`` (a local worker's), removed when no driver came.
    """

    address: tuple[str, int]
    secret: bytes
    worker_id: int
    wait: float
    held: Callable[[], p.Held | None]
    reopened: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    join_file: str | None = None  # the run's join.json, removed when no driver came (a local worker's)

    def __call__(self, channel: LossyChannel, parked: threading.Event) -> p.Held | None:
        """Wait for the training thread to park, then for a driver at ``address``; returns what
        this worker told the driver it holds, or None when it should exit (nothing held, or no
        driver came within the wait)."""
        deadline = time.monotonic() + self.wait
        while not parked.wait(0.05):  # the step under way is undone at its next abort check
            if time.monotonic() > deadline:
                _say(f"no driver came back within {self.wait:.0f} s (FABRIC_MODEL_DRIVER_WAIT)")
                self._forget_secret()
                return None
        held = self.held()
        if held is None:
            return None
        host, port = self.address
        _say(
            f"the driver at {host}:{port} vanished; holding the state of unit {held.next_unit}, waiting up to "
            f"{self.wait:.0f} s for it to come back (FABRIC_MODEL_DRIVER_WAIT)"
        )
        refused, looked = 0, 0.0
        while time.monotonic() < deadline:
            if time.monotonic() - looked > TAKEN_OVER_EVERY:
                looked = time.monotonic()
                if self._taken_over():
                    _say("the run's join.json no longer holds this job's secret: a newer run took its place; exiting")
                    return None
            try:
                new = control.connect(self.address, self.secret, min(TRY_WITHIN, max(0.1, deadline - time.monotonic())))
            except AuthenticationError:
                refused += 1
                if refused == 1:
                    _say(f"refused a peer at {host}:{port} that does not hold the job's secret; waiting on")
                time.sleep(RETRY_EVERY * 5)
                continue
            except (OSError, EOFError):
                time.sleep(RETRY_EVERY)
                continue
            try:
                for reopen in self.reopened:
                    reopen()
                new.send(p.Hello(self.worker_id, os.getpid(), socket.gethostname(), held))
            except (OSError, EOFError, AuthenticationError):  # gone again: try on
                new.close()
                time.sleep(RETRY_EVERY)
                continue
            channel.attach(new)  # after the Hello: no other thread's message can come first
            _say(f"re-attached to the driver at {host}:{port} holding unit {held.next_unit}")
            return held
        _say(f"no driver came back within {self.wait:.0f} s (FABRIC_MODEL_DRIVER_WAIT)")
        self._forget_secret()
        return None

    def _taken_over(self) -> bool:
        """Whether the run's ``join.json`` (a local worker's) is gone or holds another secret: a new
        run in its place, or one that released this worker's, has started; no driver will come."""
        if self.join_file is None:
            return False
        try:
            with open(self.join_file) as f:
                return bytes.fromhex(json.load(f)["secret"]) != self.secret
        except FileNotFoundError:
            return True
        except (OSError, ValueError, KeyError, TypeError):
            return False  # being replaced (written aside, then renamed): look again later

    def _forget_secret(self) -> None:
        """Remove the run's ``join.json`` when it still holds this job's secret: no driver will
        take it back, and the secret must not outlive the job."""
        if self.join_file is None:
            return
        try:
            with open(self.join_file) as f:
                if bytes.fromhex(json.load(f)["secret"]) == self.secret:
                    os.unlink(self.join_file)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # gone already (a peer removed it), or another run's


def _say(line: str) -> None:
    """On the worker's console (its log): a hand-started worker's user reads it there."""
    sys.stderr.write(f"fabric_model worker: {line}\n")
    sys.stderr.flush()
