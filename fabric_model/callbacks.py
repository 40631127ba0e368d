"""User hooks: the :class:`Callback` base class, and what a logger is.

A logger (``worker_logger_callback``, ``driver_logger_callback``) is any object with some of
these methods (missing ones are skipped):

- ``on_train_begin()``, ``on_train_end()``;
- ``log_train_metrics(metrics, iteration, epoch, workers)``: on a worker, after each step,
  with that step's metrics and the worker's own iteration count; on the driver, after each
  step, with the sample-weighted averages over the epoch so far (loss included), the
  number of steps completed and the number of live workers;
- ``log_test_metrics(metrics, iteration, epoch)``: after each validation.

IBM's older ``log_train_metrics(loss, acc, completed_batch, worker=0)`` is accepted too. One
dispatcher, :class:`fabric_model.hooks.Hooks`, calls loggers, callbacks and the progress
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
      set earlier); ``on_epoch_end(epoch)``: after the epoch's last step, before validation;
    - ``on_batch_begin(step)`` / ``on_batch_end(step)``: around each optimizer step (``step``
      within the epoch; a step redone after a failure runs them again).

    Attributes:
        params: ``optimizer``, ``epochs``, ``batch_size``, ``steps_per_epoch``, ``seed``.
        model: the worker's model (on its device).
    """

    params: dict[str, Any]
    model: Any

    def set_context(self, model: Any, params: dict[str, Any]) -> None:
        self.model, self.params = model, params

    def on_train_begin(self) -> None:
        pass

    def on_train_end(self) -> None:
        pass

    def on_epoch_begin(self, epoch: int) -> None:
        pass

    def on_epoch_end(self, epoch: int, save_model: bool = False) -> None:
        # IBM's Callback has `save_model`; the loop calls on_epoch_end(epoch), so overrides with it work.
        pass

    def on_batch_begin(self, step: int) -> None:
        pass

    def on_batch_end(self, step: int) -> None:
        pass
