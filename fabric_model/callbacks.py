"""User hooks: the :class:`Callback` base class, and what a logger is.

A logger (``worker_logger_callback``, ``driver_logger_callback``) is any object with some of
these methods (missing ones are skipped):

- ``on_train_begin()``, ``on_train_end()``;
- ``log_train_metrics(metrics, iteration, epoch, workers)``: on a worker, after each step,
  with that step's metrics and the worker's own iteration count; on the driver, after each
  step, with the sample-weighted averages over the epoch so far (loss included), the
  number of steps completed and the number of live workers;
- ``log_test_metrics(metrics, iteration, epoch)``: after each validation;
- ``record_step(metrics, iteration, epoch, workers)`` (driver only): each committed step's own
  means (and ``grad_norm``, its gradient's norm before ``gradient_clip_norm`` clipped it), once
  a step, in order (a step redone after a rollback is told again, with the same ``iteration``);
- ``on_checkpoint(epoch, name)`` (driver only): the checkpoint taken at the end of ``epoch``
  (0-based) is on disk, in ``checkpoints/<name>``; not called for one inside an epoch;
- ``on_step_checkpoint(iteration, name)`` (driver only): a checkpoint is on disk, the state after
  ``iteration`` steps of the run (counted from 1, ``record_step``'s ``iteration``): called for
  every checkpoint, those of ``train(checkpoint_steps=...)`` inside an epoch and those at an
  epoch's end alike (after its ``on_checkpoint``), so a logger that follows steps needs only this one.

IBM's older ``log_train_metrics(loss, acc, completed_batch, worker=0)`` is accepted too. One
dispatcher, :class:`fabric_model.run.hooks.Hooks`, calls loggers, callbacks and the progress
display (docs/architecture.md, "Hooks").
"""

from __future__ import annotations

from typing import Any


class Callback:
    """Base class for user callbacks (``user_callback=[...]``); every hook is a no-op.

    Callbacks run **in every worker**, on that worker's replica, so a change they make (a
    learning rate set in ``on_epoch_begin``) reaches every replica identically. Where each
    hook runs:

    - ``on_train_begin()`` / ``on_train_end()``: once per worker, when it starts training
      (a worker that joins mid-run calls it on joining) and when the schedule ends;
    - ``on_epoch_begin(epoch)``: before the first step of each epoch (a worker that joins
      mid-epoch starts from the optimizer state it pulled, which carries any learning rate
      set earlier); ``on_epoch_end(epoch, logs)``: after the epoch's validation, with Keras'
      ``logs``: the epoch's sample-weighted training averages (``loss``, metrics) and, when the
      epoch was validated, the validation metrics prefixed ``val_``; the same values on every worker.
      IBM's form, ``on_epoch_end(epoch, save_model=False)``, gets ``save_model=True`` at the
      epochs whose end writes the model (every ``checkpoint_freq``-th epoch and the last), in one worker;
    - ``on_batch_begin(step)`` / ``on_batch_end(step)``: around each optimizer step (``step``
      within the epoch; a step redone after a failure runs them again).

    Setting ``self.stop_training = True`` (or ``self.model.stop_training``, as Keras callbacks do)
    in ``on_epoch_end`` or ``on_batch_end`` ends training after that epoch or step. Decide from
    what every replica shares (``logs``, the step, state kept in ``state_dict()``), and every
    replica stops at the same step; ``train()`` then returns normally with the shorter history.
    A callback's ``state_dict()`` / ``load_state_dict(state)``, if it has them, travel with the
    optimizer state (checkpoints, joining workers, resume), so a replacement decides alike.

    Attributes:
        params: ``optimizer``, ``epochs``, ``batch_size``, ``steps_per_epoch``, ``seed``.
        model: the worker's model (on its device).
    """

    params: dict[str, Any]
    model: Any
    stop_training: bool = False

    def set_context(self, model: Any, params: dict[str, Any]) -> None:
        self.model, self.params = model, params

    def on_train_begin(self) -> None:
        pass

    def on_train_end(self) -> None:
        pass

    def on_epoch_begin(self, epoch: int) -> None:
        pass

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        # IBM's overrides, on_epoch_end(epoch, save_model=False), get save_model instead of logs (run/hooks.py).
        pass

    def on_batch_begin(self, step: int) -> None:
        pass

    def on_batch_end(self, step: int) -> None:
        pass


class EarlyStopping(Callback):
    """Stop training when ``monitor`` has stopped improving, as Keras' ``EarlyStopping`` does.

    Args:
        monitor: a key of the epoch's ``logs``: ``"loss"``, a metric's name, or ``"val_"`` and one
            of those (checked in the caller against the run's metrics).
        patience: epochs without improvement after which training stops.
        mode: ``"min"``, ``"max"``, or ``"auto"`` (``"max"`` for names with "acc" or "auc", else ``"min"``).
        min_delta: the least change that counts as an improvement.
        baseline: a value the monitored quantity must improve on (None: the first epoch's).

    Its progress (``best``, ``wait``) is in :meth:`state_dict`, so it travels with the training
    state and every replica, replacements included, stops at the same epoch. ``stopped_epoch``
    is set in the workers; the caller learns of the stop from ``train()``'s shorter history.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        patience: int = 0,
        mode: str = "auto",
        min_delta: float = 0.0,
        baseline: float | None = None,
    ) -> None:
        if mode not in ("min", "max", "auto"):
            raise ValueError(f"Expected `mode` to be 'min', 'max' or 'auto'. Received: mode={mode!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"Expected `patience` to be an int >= 0. Received: patience={patience!r}")
        self.monitor, self.patience, self.min_delta, self.baseline = monitor, patience, abs(min_delta), baseline
        self.mode = mode if mode != "auto" else ("max" if ("acc" in monitor or "auc" in monitor) else "min")
        self.best: float | None = baseline
        self.wait = 0
        self.stopped_epoch = -1

    def improved(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        value = (logs or {}).get(self.monitor)
        if value is None:  # not validated this epoch (validation_freq > 1): nothing to judge
            return
        if self.improved(value):
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= max(1, self.patience):
            self.stop_training, self.stopped_epoch = True, epoch

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait, "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.wait, self.stopped_epoch = state["best"], int(state["wait"]), int(state["stopped_epoch"])
