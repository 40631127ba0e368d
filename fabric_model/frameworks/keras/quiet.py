"""TensorFlow's start-up notices off the screen and out of worker logs (a leaf module).

TensorFlow 2.18+ logs through absl before absl is initialised, so ``TF_CPP_MIN_LOG_LEVEL`` does
not reach its first lines ("oneDNN custom operations are on", the CPU-feature notice, and on a
machine without a GPU driver its CUDA build's "Could not find cuda drivers" and the ``cuInit``
error of its first device list): they go straight to file descriptor 2. :func:`quiet_tensorflow`
points descriptor 2 at a temporary file while TensorFlow loads, then writes back every line that
is not one of those notices, so a real error still shows. ``TF_CPP_MIN_LOG_LEVEL=0`` or ``1`` set
by the user turns it off, and so does ``train(verbose=2)`` for the workers it starts
(``_FABRIC_MODEL_TF_NOTICES``, an internal setting).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import IO

from ...settings.registry import TF_LOG_LEVEL, TF_NOTICES

#: Fragments of the lines TensorFlow prints on every start, whatever the model. The CUDA build
#: (Linux wheels) on a machine without a GPU driver says so at each CUDA stub it loads.
START_UP_NOTICES = (
    "All log messages before absl::InitializeLog() is called",
    "oneDNN custom operations are on",
    "cpu_feature_guard.cc",
    "To enable the following instructions:",
    "Could not find cuda drivers on your machine, GPU will not be used",
)

#: Where TensorFlow has just said there is no CUDA driver (the notice above), its failed ``cuInit``
#: says the same; on a machine with a driver, the line is a real error and stays.
NO_DRIVER_NOTICE, NO_DRIVER_ERROR = START_UP_NOTICES[-1], "failed call to cuInit"


def _kept(lines: list[str]) -> str:
    """``lines`` less TensorFlow's start-up notices."""
    no_driver = any(NO_DRIVER_NOTICE in line for line in lines)
    return "".join(
        line
        for line in lines
        if not any(n in line for n in START_UP_NOTICES) and not (no_driver and NO_DRIVER_ERROR in line)
    )


@contextlib.contextmanager
def quiet_tensorflow() -> Iterator[None]:
    """Run the block (which imports TensorFlow or Keras) without TensorFlow's start-up notices.

    Example::

        from fabric_model import quiet_tensorflow
        with quiet_tensorflow():
            import keras
    """
    os.environ.setdefault(TF_LOG_LEVEL.name, TF_LOG_LEVEL.default)  # for TensorFlow, when it loads
    shown = TF_LOG_LEVEL.get() in ("0", "1") or TF_NOTICES.get()
    if "tensorflow" in sys.modules or shown:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
            _look_for_devices(capture)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines = capture.read().decode(errors="replace").splitlines(keepends=True)
            kept = _kept(lines)
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


def _look_for_devices(capture: IO[bytes]) -> None:
    """Where the block loaded TensorFlow's CUDA build on a machine without a driver, its device list
    now, so that the ``cuInit`` error the first list prints (at the first model or operation) is
    dropped with the notice that explains it. Listing devices leaves them configurable."""
    tf = sys.modules.get("tensorflow")
    if tf is None:
        return
    capture.seek(0)
    if NO_DRIVER_NOTICE.encode() not in capture.read():
        return
    with contextlib.suppress(Exception):
        tf.config.list_physical_devices()
    sys.stderr.flush()


@contextlib.contextmanager
def notices_for_workers(show: bool) -> Iterator[None]:
    """While the block runs, workers started by it show TensorFlow's start-up notices if ``show``
    (``train(verbose=2)``): they read ``_FABRIC_MODEL_TF_NOTICES`` from the environment they inherit."""
    if not show or TF_NOTICES.is_set():
        yield
        return
    os.environ[TF_NOTICES.name] = "1"
    try:
        yield
    finally:
        os.environ.pop(TF_NOTICES.name, None)
