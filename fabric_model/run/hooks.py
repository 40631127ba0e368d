"""The one dispatcher of user hooks, in the manner of Keras' ``CallbackList`` (docs/architecture.md, "Hooks").

:class:`Hooks` has every hook method itself and holds the hook objects it calls: the user's
logger (of either signature), the user's :class:`~fabric_model.callbacks.Callback` objects
and, in the driver, the default progress display. A hook an object lacks is skipped.

It also holds the two testing seams: :meth:`Hooks.wrap_collective` and
:meth:`Hooks.wrap_checkpoint_stream` return their argument unchanged unless a hook object
defines a method of that name (``fabric_model.testing.FaultInjector`` does), so that faults
are injected by wrapping, with no test branch in the product's code paths.

A leaf module: no torch, nothing from driver/, worker/ or frameworks/.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

#: The methods that make an object a logger (``validation.check_logger`` wants one of them).
HOOKS = ("on_train_begin", "on_train_end", "log_train_metrics", "log_test_metrics")

_T = TypeVar("_T")


class Hooks:
    """Calls the hooks of its objects: loggers first on the way in, callbacks first on the way out.

    ``on_*_begin`` and the metric hooks reach the loggers, then the callbacks; ``on_*_end``
    the callbacks, then the loggers, so a logger's view encloses the callbacks' (as a worker
    has always called them).

    Args:
        loggers: logger objects with this package's signature (None entries are dropped).
        callbacks: ``Callback`` objects (or any objects with some of the hook methods).
    """

    def __init__(self, loggers: Iterable[Any] = (), callbacks: Iterable[Any] = ()) -> None:
        self.loggers = [logger for logger in loggers if logger is not None]
        self.callbacks = list(callbacks)

    @classmethod
    def for_driver(cls, user_loggers: Any, *defaults: Any) -> Hooks:
        """The driver's hooks: the user's driver logger(s) (one object or a list), then ``defaults``
        (the progress display and the run recorder; None entries are dropped). A user's logger is
        added to the defaults, not put in their place (``train(verbose=0)`` turns the display off)."""
        if not isinstance(user_loggers, (list, tuple)):
            user_loggers = [user_loggers]
        return cls([*(adapt_logger(lg, in_worker=False) for lg in user_loggers), *defaults])

    @classmethod
    def for_worker(cls, worker_logger: Any, callbacks: Sequence[Any] = ()) -> Hooks:
        """A worker's hooks: the user's worker logger and ``user_callback``'s callbacks."""
        return cls([adapt_logger(worker_logger, in_worker=True)], callbacks)

    def __repr__(self) -> str:
        return f"Hooks(loggers={self.loggers!r}, callbacks={self.callbacks!r})"

    # -- dispatch ---------------------------------------------------------------------------
    def _opening(self) -> list[Any]:
        return self.loggers + self.callbacks

    def _closing(self) -> list[Any]:
        return self.callbacks + self.loggers

    @staticmethod
    def _call(objects: Iterable[Any], hook: str, *args: Any) -> None:
        for obj in objects:
            method = getattr(obj, hook, None)
            if callable(method):
                method(*args)

    def defines(self, hook: str) -> bool:
        """Whether any object has ``hook`` (so a caller can skip computing its arguments)."""
        return any(callable(getattr(obj, hook, None)) for obj in self._opening())

    def dispatches(self, hook: str) -> bool:
        """Whether calling this dispatcher's ``hook`` can run any code: some object defines it, or
        the method is not :class:`Hooks`' own (replaced on the instance or in a subclass). A caller
        that asks once may skip the calls that would reach no one (a worker's per-step hooks)."""
        method = getattr(self, hook)
        return getattr(method, "__func__", method) is not getattr(Hooks, hook) or self.defines(hook)

    def on_train_begin(self) -> None:
        self._call(self._opening(), "on_train_begin")

    def on_train_end(self) -> None:
        self._call(self._closing(), "on_train_end")

    def on_epoch_begin(self, epoch: int) -> None:
        self._call(self._opening(), "on_epoch_begin", epoch)

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None, save_model: bool = False) -> None:
        """``logs`` (Keras': the epoch's training averages and ``val_`` metrics) reaches the
        methods that take a ``logs`` parameter; IBM's ``on_epoch_end(epoch, save_model=False)``
        gets ``save_model``, which the worker sets: True at the epochs whose end writes the model
        (a checkpoint epoch, and the last), in one worker; IBM's samples export the model there
        (docs/ibm-migration.md, "IBM's semantics in the library")."""
        for obj in self._closing():
            method = getattr(obj, "on_epoch_end", None)
            if not callable(method):
                continue
            if _takes(method, "logs"):
                method(epoch, logs=dict(logs or {}))
            elif _takes(method, "save_model"):
                method(epoch, save_model=save_model)
            else:
                method(epoch)

    def save_branch(self, epoch: int) -> None:
        """IBM's save branch alone: ``on_epoch_end(epoch, save_model=True)`` of the callbacks that
        take ``save_model``, run by a survivor when the worker that ran it at the end was lost
        (docs/architecture.md, "User errors"). The others ran this epoch's end already."""
        for obj in self._closing():
            method = getattr(obj, "on_epoch_end", None)
            if callable(method) and not _takes(method, "logs") and _takes(method, "save_model"):
                method(epoch, save_model=True)

    def on_batch_begin(self, step: int) -> None:
        self._call(self._opening(), "on_batch_begin", step)

    def on_batch_end(self, step: int) -> None:
        self._call(self._closing(), "on_batch_end", step)

    def log_train_metrics(self, metrics: dict[str, float], iteration: int, epoch: int, workers: int) -> None:
        self._call(self._opening(), "log_train_metrics", metrics, iteration, epoch, workers)

    def log_test_metrics(self, metrics: dict[str, float], iteration: int, epoch: int) -> None:
        self._call(self._opening(), "log_test_metrics", metrics, iteration, epoch)

    def record_step(self, metrics: dict[str, float], iteration: int, epoch: int, workers: int) -> None:
        """A committed step's own means (``log_train_metrics`` gets the epoch's running averages)."""
        self._call(self._opening(), "record_step", metrics, iteration, epoch, workers)

    def on_generation(self, record: dict[str, Any]) -> None:
        """A generation formed: ``generation``, ``members``, ``reason``, ``iteration``, ``resume_unit``."""
        self._call(self._opening(), "on_generation", record)

    def on_checkpoint(self, epoch: int, name: str) -> None:
        """The checkpoint after ``epoch`` (0-based) is on disk, in the file ``name``."""
        self._call(self._opening(), "on_checkpoint", epoch, name)

    def on_step_checkpoint(self, iteration: int, name: str) -> None:
        """The checkpoint taken after ``iteration`` steps of the run (counted from 1, as
        ``record_step``'s ``iteration``) is on disk, in the file ``name``: every checkpoint, at an
        epoch's end or inside one (``train(checkpoint_steps=...)``)."""
        self._call(self._opening(), "on_step_checkpoint", iteration, name)

    def note(self, line: str) -> None:
        """A line for the progress display (what happened after training, say)."""
        self._call(self._opening(), "note", line)

    def set_context(self, model: Any, params: dict[str, Any]) -> None:
        """Give each callback the worker's model and the run's parameters (``Callback.set_context``)."""
        self._call(self.callbacks, "set_context", model, params)

    # -- testing seams ---------------------------------------------------------------------
    def wrap_collective(self, collective: _T) -> _T:
        """The collective the worker uses: ``collective``, wrapped by each object defining
        ``wrap_collective(collective)`` (a fault injector)."""
        for obj in self._opening():
            method = getattr(obj, "wrap_collective", None)
            if callable(method):
                collective = method(collective)
        return collective

    def wrap_checkpoint_stream(self, stream: _T, unit: int) -> _T:
        """The file a checkpoint of ``unit`` is written to: ``stream``, wrapped by each object
        defining ``wrap_checkpoint_stream(stream, unit)``."""
        for obj in self._opening():
            method = getattr(obj, "wrap_checkpoint_stream", None)
            if callable(method):
                stream = method(stream, unit)
        return stream


def _takes(method: Any, name: str) -> bool:
    """Whether ``method`` takes a parameter ``name`` (or any keyword)."""
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in parameters)


# -- IBM's older logger signature ------------------------------------------------------------
def _form(method: Any) -> str | None:
    """``"loss"`` for ``(loss, acc, completed_batch, worker=0)``, ``"metrics"`` for IBM's second
    form ``(metrics, completed_batch, epoch, worker=0)``, None for ``(metrics, iteration, epoch, workers)``."""
    try:
        names = list(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        return None
    if names and names[0] == "loss":
        return "loss"
    if "completed_batch" in names[1:2] or names[3:4] == ["worker"]:
        return "metrics"
    return None


def logger_form(logger: Any) -> str | None:
    """Which of IBM's older signatures ``logger``'s metric hooks have, if any (see :func:`_form`)."""
    forms = [_form(getattr(logger, h, None)) for h in ("log_train_metrics", "log_test_metrics")]
    return "loss" if "loss" in forms else "metrics" if "metrics" in forms else None


def is_old_style_logger(logger: Any) -> bool:
    """Whether ``logger``'s metric hooks have one of IBM's older signatures."""
    return logger_form(logger) is not None


class OldStyleLogger:
    """Presents a logger with one of IBM's older signatures as one with this package's.

    ``log_train_metrics(loss, acc, completed_batch, worker=0)`` receives the loss, the default
    accuracy in percent (else the first metric, or NaN), the iteration, and the live worker count
    on the driver or the rank in a worker; ``log_test_metrics(loss, acc, completed_batch, ...)``
    likewise. The second form, ``log_train_metrics(metrics, completed_batch, epoch, worker=0)`` and
    ``log_test_metrics(metrics, completed_batch, epoch)``, receives the metrics dict, the
    iteration, the epoch and the same ``worker``. Every other attribute is the inner logger's.
    """

    def __init__(self, inner: Any, in_worker: bool, form: str = "loss") -> None:
        self.inner = inner
        self.in_worker = in_worker
        self.form = form

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not set here; guarded so unpickling (no `inner` yet) cannot recurse.
        if name.startswith("__") or "inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.inner, name)

    def log_train_metrics(self, metrics: dict[str, float], iteration: int, epoch: int, workers: int) -> None:
        method = getattr(self.inner, "log_train_metrics", None)
        if not callable(method):
            return
        if self.form == "metrics":
            method(metrics, iteration, epoch, self._worker(workers))
        else:
            method(metrics.get("loss"), _first_metric(metrics), iteration, self._worker(workers))

    def log_test_metrics(self, metrics: dict[str, float], iteration: int, epoch: int) -> None:
        method = getattr(self.inner, "log_test_metrics", None)
        if not callable(method):
            return
        if self.form == "metrics":
            method(metrics, iteration, epoch)
        else:
            method(metrics.get("loss"), _first_metric(metrics), iteration, self._worker(0))

    def _worker(self, workers: int) -> int:
        if self.in_worker:
            from ..context import worker_context

            ctx = worker_context()
            return ctx.rank if ctx is not None else 0
        return workers


def _first_metric(metrics: dict[str, float]) -> Any:
    # IBM handed these loggers its accuracy in percent (their scripts divide by 100): the default
    # accuracy, shown as a fraction under "accuracy", arrives in percent; other metrics as they are.
    # With no metric at all (metrics=[], or an fn_test that returns the loss alone) a NaN, not None:
    # IBM's loggers compute `acc / 100.0` unconditionally.
    if "accuracy" in metrics:
        return 100.0 * metrics["accuracy"]
    return next((v for k, v in metrics.items() if k != "loss"), float("nan"))


def adapt_logger(logger: Any, in_worker: bool) -> Any:
    """The logger itself, or a wrapper if its methods have IBM's older signature (None stays None)."""
    if logger is None or isinstance(logger, OldStyleLogger):
        return logger
    form = logger_form(logger)
    return OldStyleLogger(logger, in_worker, form) if form is not None else logger
