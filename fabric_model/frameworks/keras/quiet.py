"""TensorFlow's start-up notices off the screen and out of worker logs (a leaf module).

TensorFlow 2.18+ logs through absl before absl is initialised, so ``TF_CPP_MIN_LOG_LEVEL`` does
not reach its first lines ("oneDNN custom operations are on", the CPU-feature notice): they go
straight to file descriptor 2. :func:`quiet_tensorflow` points descriptor 2 at a temporary file
while TensorFlow loads, then writes back every line that is not one of those notices, so a real
error still shows. ``TF_CPP_MIN_LOG_LEVEL=0`` or ``1`` set by the user turns it off, and so does
``train(verbose=2)`` for the workers it starts (``_FABRIC_MODEL_TF_NOTICES``, an internal setting).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator

from ...setup.settings import TF_LOG_LEVEL, TF_NOTICES

#: Fragments of the lines TensorFlow prints on every start, whatever the model.
START_UP_NOTICES = (
    "All log messages before absl::InitializeLog() is called",
    "oneDNN custom operations are on",
    "cpu_feature_guard.cc",
    "To enable the following instructions:",
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
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines = capture.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not any(n in line for n in START_UP_NOTICES))
            if kept:
                sys.stderr.write(kept)
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
