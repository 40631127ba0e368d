"""Argument checks, run in the caller's process before any worker starts.

Every error names the argument, the value received and what is accepted.
"""

from __future__ import annotations

from typing import Any

from ..run.hooks import HOOKS
from ..step.data import is_map_dataset


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_positive_int(name: str, value: Any, *, allow_none: bool = False, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        accepted = "an int" + (" or None" if allow_none else "")
        raise TypeError(f"Expected `{name}` to be {accepted}. Received: {name}={_show(value)} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"Expected `{name}` to be an int >= {minimum}. Received: {name}={value}")


def check_callable(name: str, value: Any, *, allow_none: bool = False, hint: str = "") -> None:
    if value is None and allow_none:
        return
    if not callable(value):
        accepted = "a callable" + (" or None" if allow_none else "")
        raise TypeError(f"Expected `{name}` to be {accepted}. Received: {name}={_show(value)}.{hint}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"Expected `{name}` to be True or False. Received: {name}={_show(value)}")


def check_metrics(metrics: Any) -> list[Any]:
    if metrics is None:
        return []
    if callable(metrics) and not isinstance(metrics, (list, tuple)):
        raise TypeError(
            f"Expected `metrics` to be a list of callables metric(output, target). Received: metrics={_show(metrics)}. "
            f"HINT: pass metrics=[{getattr(metrics, '__name__', 'metric')}]"
        )
    if not isinstance(metrics, (list, tuple)):
        raise TypeError(f"Expected `metrics` to be a list of callables or None. Received: metrics={_show(metrics)}")
    for i, m in enumerate(metrics):
        if not callable(m):
            raise TypeError(
                f"Expected every item of `metrics` to be a callable metric(output, target). "
                f"Received: metrics[{i}]={_show(m)}"
            )
    return list(metrics)


def check_logger(name: str, logger: Any) -> None:
    if logger is None:
        return
    if name == "driver_logger_callback" and isinstance(logger, (list, tuple)):
        for item in logger:  # the driver takes a list: each one is added to the default display
            check_logger(name, item)
        return
    if isinstance(logger, type):
        raise TypeError(
            f"Expected `{name}` to be a logger object. Received the class {logger.__name__}. "
            f"HINT: pass an instance, {name}={logger.__name__}()"
        )
    if not any(callable(getattr(logger, hook, None)) for hook in HOOKS):
        raise TypeError(
            f"Expected `{name}` to be an object with at least one of the methods {', '.join(HOOKS)}. "
            f"Received: {name}={_show(logger)}"
        )


def check_user_callbacks(callbacks: Any) -> list[Any]:
    from ..callbacks import Callback

    if callbacks is None:
        return []
    if isinstance(callbacks, Callback):
        return [callbacks]
    if not isinstance(callbacks, (list, tuple)):
        raise TypeError(
            f"Expected `user_callback` to be a list of fabric_model.Callback objects. "
            f"Received: user_callback={_show(callbacks)}"
        )
    for i, c in enumerate(callbacks):
        if not isinstance(c, Callback):
            hint = (
                f" HINT: pass an instance, {c.__name__}()"
                if isinstance(c, type)
                else " HINT: derive your class from fabric_model.Callback"
            )
            raise TypeError(
                f"Expected every item of `user_callback` to be a fabric_model.Callback. "
                f"Received: user_callback[{i}]={_show(c)}.{hint}"
            )
    return list(callbacks)


def check_datasets(datasets_function: Any) -> tuple[Any, Any]:
    """Call ``datasets_function`` once and check it returns a (train, test) pair of map-style datasets."""
    check_callable(
        "datasets_function",
        datasets_function,
        hint=" HINT: pass the function itself, datasets_function=my_fn, not its result my_fn().",
    )
    result = datasets_function()
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise TypeError(
            "Expected `datasets_function` to return a (train_dataset, test_dataset) pair. "
            f"Received a return value of {_show(result)} ({type(result).__name__})"
        )
    train, test = result
    for role, ds in (("train", train), ("test", test)):
        if ds is None and role == "test":
            continue
        if not is_map_dataset(ds):
            raise TypeError(
                f"Expected the {role} dataset returned by `datasets_function` to be map-style "
                f"(with __len__ and __getitem__){' or None' if role == 'test' else ''}. "
                f"Received: {type(ds).__name__}. HINT: an iterable-only dataset cannot be divided into "
                "exactly-once micro-batches; wrap its samples in a list or a torch Dataset."
            )
    if len(train) == 0:
        raise ValueError(
            "Expected the train dataset returned by `datasets_function` to hold samples. Received: an empty dataset"
        )
    return train, test


def check_effective_batch(effective_batch_size: int | None, batch_size: int) -> None:
    check_positive_int("effective_batch_size", effective_batch_size, allow_none=True)
    if effective_batch_size is not None and effective_batch_size % batch_size != 0:
        raise ValueError(
            f"Expected `effective_batch_size` to be a multiple of `batch_size`={batch_size}. "
            f"Received: effective_batch_size={effective_batch_size}. "
            f"HINT: use {max(batch_size, effective_batch_size // batch_size * batch_size)} or "
            f"{(effective_batch_size // batch_size + 1) * batch_size}"
        )


def require(**arguments: Any) -> None:
    """Raise naming the required arguments that were not given."""
    missing = [name for name, value in arguments.items() if value is None]
    if missing:
        raise TypeError(f"FabricModel() is missing required argument(s): {', '.join(missing)}. Received: None")
