"""The driver's process heap during a run: what exists when training starts is kept out of the
garbage collector's full passes (docs/architecture.md, "Scale").

The driver runs in the user's process, beside everything it imported (torch alone is a few
hundred thousand tracked objects) and the user's own. A full collection reads every tracked
object; with thousands of workers a generation change allocates enough long-lived objects to
start one, and it took 140-190 ms of a 0.5 s change at 4,096 simulated workers. Objects that
exist before the run outlive it anyway, so they are moved to the permanent generation for the
run (``gc.freeze``) and given back at its end (``gc.unfreeze``). Reference counting frees them as
before; only a cycle among them that becomes garbage meanwhile waits for the end of the run.
A process that froze objects itself is left as it is: unfreezing would undo its freeze too.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def long_lived_frozen() -> Iterator[bool]:
    """Freeze the objects tracked now for the ``with`` block; yields whether it did."""
    if gc.get_freeze_count() > 0 or not gc.isenabled():
        yield False  # the process manages its collector itself
        return
    gc.freeze()
    try:
        yield True
    finally:
        gc.unfreeze()
