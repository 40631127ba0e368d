"""Which Keras a TensorFlow script gets under ``fabric-model run``: Keras 2 unless asked otherwise.

IBM's TensorFlow 2.x samples were written for Keras 2 (TensorFlow 2.1-2.4): ``Adam(lr=...)``,
``tf.keras.optimizers.legacy``, ``load_data(path=<absolute path>)``; Keras 3 refuses each.
TensorFlow's own answer is the ``tf-keras`` package with ``TF_USE_LEGACY_KERAS=1`` set before
TensorFlow is imported: ``tf.keras`` is then Keras 2. The runtime sets it for a script that
uses TensorFlow (and, through the environment, for its workers); ``--keras3`` or the user's
own ``TF_USE_LEGACY_KERAS`` keeps what they chose. FabricModel trains ``tf_keras`` models as it
does Keras 3 ones (docs/keras.md, "Keras 2 (tf_keras) models"). One difference from the Keras 2
of IBM's time remains, and :func:`honour_lr` removes it under ``run``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from pathlib import Path
from typing import Any

from ..settings.registry import TF_USE_LEGACY_KERAS

VARIABLE = TF_USE_LEGACY_KERAS.name
_USES_TENSORFLOW = re.compile(r"^\s*(import\s+(tensorflow|keras)\b|from\s+(tensorflow|keras)\b)", re.MULTILINE)


def uses_tensorflow(script: Path) -> bool:
    """Whether ``script`` imports TensorFlow or Keras at any indentation (read, not run)."""
    try:
        return bool(_USES_TENSORFLOW.search(script.read_text(encoding="utf-8", errors="replace")))
    except OSError:
        return False


def choose_keras(script: Path, keras3: bool) -> tuple[str | None, str | None]:
    """Set ``TF_USE_LEGACY_KERAS`` for ``script`` when it should get Keras 2.

    Returns ``(note, error)``: a line to print on stderr, and an error that stops the run
    (tf-keras missing); both None when nothing was decided here.
    """
    if keras3 or TF_USE_LEGACY_KERAS.get() is not None or not uses_tensorflow(script):
        return None, None
    if importlib.util.find_spec("tf_keras") is None:
        return None, (
            f"{script.name} uses TensorFlow, and IBM's TensorFlow scripts were written for Keras 2, "
            'which needs the tf-keras package: pip install "fabric-model[keras2]". '
            "Or pass --keras3 to run it with Keras 3."
        )
    os.environ[VARIABLE] = "1"
    return f"tf.keras is Keras 2 (tf-keras, {VARIABLE}=1) for this TensorFlow script; --keras3 opts out.", None


def honour_lr() -> None:
    """Make ``lr=`` mean ``learning_rate=`` for tf-keras' optimizers, as in the Keras 2 IBM ran.

    tf-keras' current optimizers take ``lr=`` and drop it with a warning, training at their
    default rate (``Adam(lr=0.01)`` trains at 0.001): a silent change to what IBM's scripts asked
    for. Only in the driver, where the script builds its optimizer (workers get its config).
    """
    import sys

    import tf_keras

    def wrap(cls: type) -> None:
        original = cls.__init__  # type: ignore[misc]

        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            if "lr" in kwargs and "learning_rate" not in kwargs and not args:
                kwargs["learning_rate"] = kwargs.pop("lr")
                if not _noted:
                    _noted.append(True)
                    sys.stderr.write("fabric-model run: note: the optimizer's `lr=` taken as `learning_rate=`\n")
            original(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[misc]

    base = tf_keras.optimizers.Optimizer
    for name in dir(tf_keras.optimizers):
        cls = getattr(tf_keras.optimizers, name)
        if isinstance(cls, type) and issubclass(cls, base) and cls is not base and "__init__" in vars(cls):
            wrap(cls)


_noted: list[bool] = []
