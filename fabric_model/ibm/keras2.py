"""The opt-in Keras 2 optimizer shim of ``fabric-model run --keras2-optimizers``.

Keras 3 refuses ``Adam(lr=0.01)`` and removed ``keras.optimizers.legacy``. The shim, on
request only, makes ``lr=`` mean ``learning_rate=`` and ``keras.optimizers.legacy.X`` the
current ``keras.optimizers.X``, printing one note for each kind of rewrite it makes.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

_noted: set[str] = set()


def _note(kind: str, text: str) -> None:
    if kind not in _noted:
        _noted.add(kind)
        sys.stderr.write(f"fabric-model run: note: {text}\n")


def _translate_lr(cls: type) -> None:
    original = cls.__init__  # type: ignore[misc]

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if "lr" in kwargs:
            _note("lr", "Keras 2 optimizer argument `lr=` taken as `learning_rate=` (--keras2-optimizers).")
            lr = kwargs.pop("lr")
            kwargs.setdefault("learning_rate", lr)
        original(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]


def _legacy_module(optimizers: types.ModuleType, classes: dict[str, type]) -> types.ModuleType:
    legacy = types.ModuleType(optimizers.__name__ + ".legacy", "Keras 2 `optimizers.legacy`, mapped to Keras 3.")

    def __getattr__(name: str) -> Any:
        if name in classes:
            _note("legacy", "`keras.optimizers.legacy` classes are the current Keras optimizers (--keras2-optimizers).")
            return classes[name]
        raise AttributeError(name)

    legacy.__getattr__ = __getattr__  # type: ignore[method-assign]
    return legacy


def install() -> None:
    """Apply the shim to the installed Keras (imported here: the shim was asked for)."""
    import keras

    optimizers = keras.optimizers
    base = optimizers.Optimizer
    classes = {
        name: obj
        for name, obj in vars(optimizers).items()
        if isinstance(obj, type) and issubclass(obj, base) and obj is not base
    }
    for cls in classes.values():
        _translate_lr(cls)
    legacy = _legacy_module(optimizers, classes)
    optimizers.legacy = legacy
    # `from keras.optimizers.legacy import Adam` and `import tensorflow.keras.optimizers.legacy` look here.
    sys.modules[optimizers.__name__ + ".legacy"] = legacy
    sys.modules["keras.optimizers.legacy"] = legacy
