"""Argument checks, run in the caller's process before any worker starts.

Every error names the argument, the value received and what is accepted. :data:`ARGUMENT_CHECKS`
says where each argument of ``FabricModel()`` and ``train()`` is checked (a test keeps it
complete): the checks that need no framework are here; the framework's own (loss, metrics,
optimizer) are its :class:`~fabric_model.frameworks.base.Framework`'s; the ones that need the
data run on its first batch (:mod:`.first_batch`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..run.hooks import HOOKS
from ..settings.profile_window import profile_window
from ..step.data import is_map_dataset
from ..step.sampling import check_sampling
from ..streams.sharded import as_sharded, unsharded_hint
from . import compat

if TYPE_CHECKING:
    from ..api import FabricModel
    from ..streams.datasets import CallerData
    from .config import LoopOptions

log = logging.getLogger("fabric_model")

_SELF = "fabric_model.setup.checks"
_FRAMEWORK = "fabric_model.frameworks.base:Framework"
#: argument -> "module:function" that checks it (for ``FabricModel()``, then ``train()``).
ARGUMENT_CHECKS: dict[str, dict[str, str]] = {
    "FabricModel": {
        "model": "fabric_model.frameworks:framework_name",
        "datasets_function": f"{_SELF}:check_callable",
        "loss_function": f"{_FRAMEWORK}.check_loss",
        "optimizer": f"{_FRAMEWORK}.check_optimizer",
        "metrics": f"{_FRAMEWORK}.check_metrics",
        "worker_logger_callback": f"{_SELF}:check_logger",
        "driver_logger_callback": f"{_SELF}:check_logger",
        "save_to_onnx": f"{_SELF}:check_bool",
        "keras_custom_objects": f"{_FRAMEWORK}.check_options",
        "fn_batch_collate": f"{_SELF}:check_callable",
        "fn_step_train": f"{_SELF}:check_callable",
        "fn_test": f"{_SELF}:check_callable",
        "fn_args": "",  # anything: handed to the user's own fn_step_train and fn_test
        "user_callback": f"{_SELF}:check_user_callbacks",
        "driver_logger": "fabric_model.setup.compat:pick",  # IBM's name of driver_logger_callback
        "worker_logger": "fabric_model.setup.compat:pick",  # IBM's name of worker_logger_callback
        "enable_onnx": "fabric_model.setup.compat:pick",  # IBM's name of save_to_onnx
        "get_datasets": "fabric_model.setup.compat:pick",  # this package's old name of datasets_function
        "lr_scheduler": "fabric_model.step.loop_state:check_lr_scheduler",
        "precision": "fabric_model.step.options:check_step_options",
        "gradient_clip_norm": "fabric_model.step.options:check_step_options",
    },
    "train": {
        "epoch_number": f"{_SELF}:check_positive_int",
        "batch_size": f"{_SELF}:check_positive_int",
        "engines_number": f"{_SELF}:check_positive_int",
        "num_dataloader_threads": f"{_SELF}:check_positive_int",
        "num_dataloader_processes": f"{_SELF}:check_positive_int",
        "validation_freq": f"{_SELF}:check_positive_int",
        "checkpoint_freq": f"{_SELF}:check_positive_int",
        "checkpoint_steps": f"{_SELF}:check_positive_int",
        "effective_batch_size": f"{_SELF}:check_effective_batch",
        "seed": f"{_SELF}:check_train_arguments",
        "run_dir": "fabric_model.run.rundir:RunDirectory.resolve",
        "resume": f"{_SELF}:check_resume",
        "keep_checkpoints": f"{_SELF}:check_positive_int",
        "worker_memory": "",  # IBM's, accepted and ignored (said in the log)
        "driver_memory": "",  # IBM's, accepted and ignored (said in the log)
        "bind_address": "fabric_model.transport.network:chosen_bind_address",
        "cluster": "fabric_model.launchers.cluster:check_cluster",
        "verbose": "fabric_model.driver.display:check_verbose",
        "tensorboard": f"{_SELF}:check_bool",
        "deterministic": f"{_SELF}:check_bool",
        "shard_optimizer_state": f"{_SELF}:check_bool",
        "profile": "fabric_model.settings.profile_window:profile_window",
    },
}


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


def check_resume(name: str, value: Any) -> None:
    """``train(resume=...)``: True, False or ``"auto"`` (see :func:`fabric_model.state.checkpoint.choose_resume`)."""
    if isinstance(value, bool) or (isinstance(value, str) and value == "auto"):
        return
    raise TypeError(
        f'Expected `{name}` to be True, False or "auto". Received: {name}={_show(value)}. '
        'HINT: resume="auto" goes on with an unfinished run in run_dir and starts a finished or new one afresh.'
    )


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
    # The driver also tells its loggers each committed step's own means and each checkpoint on
    # disk (run/hooks.py).
    driver_only = ("record_step", "on_checkpoint", "on_step_checkpoint")
    hooks = (*HOOKS, *driver_only) if name == "driver_logger_callback" else HOOKS
    if not any(callable(getattr(logger, hook, None)) for hook in hooks):
        raise TypeError(
            f"Expected `{name}` to be an object with at least one of the methods {', '.join(hooks)}. "
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
    """Call ``datasets_function`` once and check it returns a (train, test) pair of map-style or
    sharded datasets (a ``ShardedDataset``, a Hugging Face ``datasets.IterableDataset``)."""
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
        if as_sharded(ds) is not None:
            continue
        if not is_map_dataset(ds):
            hint = unsharded_hint(ds) or (
                "HINT: return a list, a torch Dataset, or fabric_model.ShardedDataset(shards, read_shard)."
            )
            raise TypeError(
                f"Expected the {role} dataset returned by `datasets_function` to be map-style "
                f"(with __len__ and __getitem__) or sharded (fabric_model.ShardedDataset, a Hugging Face "
                f"datasets.IterableDataset){' or None' if role == 'test' else ''}. "
                f"Received: {type(ds).__name__}. {hint}"
            )
    if as_sharded(train) is None and len(train) == 0:
        raise ValueError(
            "Expected the train dataset returned by `datasets_function` to hold samples. Received: an empty dataset"
        )
    if as_sharded(train) is None:
        check_sampling(train, len(train))  # its own order and weights, if it says them (step/sampling.py)
    return train, test


def check_sharded(data: CallerData) -> None:
    """A sharded training set must hold samples, and yields samples, not batches."""
    if data.train_count is not None and sum(data.train_count.lengths) == 0:
        raise ValueError(
            "Expected the sharded train dataset returned by `datasets_function` to hold samples. Received: "
            f"{len(data.train_count.lengths)} shards with none ({len(data.train_count.skipped)} skipped as unreadable)."
        )


def check_effective_batch(effective_batch_size: int | None, batch_size: int) -> None:
    check_positive_int("effective_batch_size", effective_batch_size, allow_none=True)
    if effective_batch_size is not None and effective_batch_size % batch_size != 0:
        raise ValueError(
            f"Expected `effective_batch_size` to be a multiple of `batch_size`={batch_size}. "
            f"Received: effective_batch_size={effective_batch_size}. "
            f"HINT: use {max(batch_size, effective_batch_size // batch_size * batch_size)} or "
            f"{(effective_batch_size // batch_size + 1) * batch_size}"
        )


def check_batch_level(train_set: Any, batch_size: int) -> None:
    """A dataset that yields whole batches (``keras.utils.PyDataset``, ``flow()``) must yield
    ``batch_size`` samples a batch: each of its batches is one micro-batch."""
    own = getattr(train_set, "batch_size", None)
    if isinstance(own, int) and own != batch_size:
        raise ValueError(
            f"Expected `batch_size` to be the batch size of the train dataset, a {type(train_set).__name__} that "
            f"yields whole batches of {own}. Received: batch_size={batch_size}. HINT: pass batch_size={own}; each "
            "of its batches is one micro-batch."
        )


def require(**arguments: Any) -> None:
    """Raise naming the required arguments that were not given."""
    missing = [name for name, value in arguments.items() if value is None]
    if missing:
        raise TypeError(f"FabricModel() is missing required argument(s): {', '.join(missing)}. Received: None")


def check_constructor_arguments(
    self: FabricModel, metrics: Any, user_callback: Any
) -> tuple[list[Any] | None, list[Any]]:
    """Check the constructor's arguments (messages name the argument); return the metrics and callbacks."""
    framework = self._framework
    framework.check_options(
        fn_step_train=self.fn_step_train, fn_test=self.fn_test, keras_custom_objects=self.keras_custom_objects
    )
    check_callable(
        "datasets_function",
        self.datasets_function,
        hint=" HINT: pass the function itself, datasets_function=my_fn, not its result my_fn().",
    )
    framework.check_loss(self.loss_function, model=self.model, fn_step_train=self.fn_step_train)
    checked_metrics = framework.check_metrics(metrics)
    check_logger("worker_logger_callback", self.worker_logger_callback)
    check_logger("driver_logger_callback", self.driver_logger_callback)
    check_bool("save_to_onnx", self.save_to_onnx)
    check_callable("fn_batch_collate", self.fn_batch_collate, allow_none=True)
    check_callable(
        "fn_step_train",
        self.fn_step_train,
        allow_none=True,
        hint=" HINT: step(model, data, eva, train_loader, fn_args) -> (metric, loss).",
    )
    check_callable(
        "fn_test",
        self.fn_test,
        allow_none=True,
        hint=" HINT: fn_test(model, test_iter, fn_args) -> (metric, loss).",
    )
    callbacks = check_user_callbacks(user_callback)
    framework.check_optimizer(self.model, self.optimizer)
    return checked_metrics, list(callbacks)


def check_train_arguments(
    epoch_number: Any,
    batch_size: Any,
    engines_number: Any,
    effective_batch_size: Any,
    loop: LoopOptions,
    seed: Any,
    resume: Any,
    ignored: dict[str, Any],
) -> None:
    """Check ``train``'s arguments; note the IBM keywords that are accepted and ignored."""
    for name, value in ignored.items():
        if value is not None:
            log.info("%s=%r is ignored: %s", name, value, compat.IGNORED_TRAIN_KEYWORDS[name])
    check_positive_int("epoch_number", epoch_number)
    check_positive_int("batch_size", batch_size)
    check_positive_int("engines_number", engines_number, allow_none=True)
    check_positive_int("num_dataloader_threads", loop.num_dataloader_threads, minimum=0, allow_none=True)
    check_positive_int("num_dataloader_processes", loop.num_dataloader_processes, minimum=0, allow_none=True)
    check_positive_int("validation_freq", loop.validation_freq)
    check_positive_int("checkpoint_freq", loop.checkpoint_freq, minimum=0)
    check_positive_int("checkpoint_steps", loop.checkpoint_steps, minimum=0)
    check_resume("resume", resume)
    check_positive_int("keep_checkpoints", loop.keep_checkpoints)
    check_bool("deterministic", loop.deterministic)
    check_bool("shard_optimizer_state", loop.shard_optimizer_state)
    profile_window(loop.profile)  # a bad value fails here; the window is fitted to the run once it is sized
    check_effective_batch(effective_batch_size, batch_size)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise TypeError(f"Expected `seed` to be a non-negative int or None. Received: seed={seed!r}")


#: A loss "fits" the sum of its halves' losses within this fraction of the largest of the values
#: (loose enough for float32 and bf16-mixed rounding) ...
SUM_FIT = 0.02
#: ... and lies clearly outside their range, where any mean of them lies (sample-weighted, class-weighted,
#: plus a regulariser term common to both): by at least this fraction. A sum of two halves of comparable
#: losses lies outside by up to a half.
OUTSIDE_MEANS = 0.1


def check_loss_reduction(whole: float, halves: Sequence[tuple[float, int]], fix: str) -> None:
    """Refuse a loss that sums over the batch: ``whole`` is its value on a batch, ``halves`` its value
    and sample count on each half of that batch. Workers weight each micro-batch's loss by its samples,
    which matches the single-device loop only for a batch mean; a loss that is not clearly a sum (a
    mean, a mean plus a regulariser, a half's loss near 0) passes."""
    losses = [loss for loss, _ in halves]
    count, total = sum(n for _, n in halves), sum(losses)
    mean = sum(loss * n for loss, n in halves) / count
    scale = max(abs(whole), abs(total), *map(abs, losses))
    if not (math.isfinite(scale) and scale > 0):  # all zero (a perfect fit): a sum and a mean agree
        return
    outside = max(min(losses) - whole, whole - max(losses), 0.0)
    if abs(whole - total) <= SUM_FIT * scale and outside >= OUTSIDE_MEANS * scale:
        parts = " and ".join(f"{loss:.6g} ({n} sample{'s' if n != 1 else ''})" for loss, n in halves)
        raise ValueError(
            "Expected `loss_function` to return the batch mean (fabric_model weights each micro-batch's loss by "
            f"its samples; a sum would scale the loss, and the gradient, with the batch size). Received: a loss "
            f"that sums over the batch: {whole:.6g} on the first batch of {count} samples, {parts} on its halves, "
            f"whose sum is {total:.6g} and sample-weighted mean {mean:.6g}. HINT: {fix}"
        )
