"""Trainer's state, logs and callbacks, moved by the steps FabricModel commits.

:class:`TrainerProgress` is a driver logger (fabric_model/callbacks.py): the driver calls
``record_step`` once for each step it commits, in order, with the step's own loss. Each call
moves ``trainer.state`` as Trainer's loop does after an optimizer step and calls the trainer's
callback handler, so ``state.log_history``, ``on_log`` (TensorBoard's included) and a user's
``TrainerCallback`` see what Trainer would show them.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

log = logging.getLogger(__name__)


def shadow_scheduler(scheduler: Any, optimizer: Any) -> Any:
    """A copy of ``scheduler`` (and of its optimizer's groups) that shares the parameters: stepping
    it gives each step's learning rate without touching what the workers were given."""
    memo = {id(p): p for group in optimizer.param_groups for p in group["params"]}
    return copy.deepcopy(scheduler, memo)


class TrainerProgress:
    """The caller's view of the run, as Trainer's loop keeps it (see the module's docstring).

    Args:
        trainer: the ``FabricTrainer``; its ``state``, ``control`` and ``callback_handler``.
        steps_per_epoch: optimizer steps an epoch.
        batches_per_epoch: micro-batches an epoch (Trainer's ``steps_in_epoch``, for ``state.epoch``).
        scheduler: a shadow of the learning-rate scheduler (:func:`shadow_scheduler`).
    """

    def __init__(
        self,
        trainer: Any,
        steps_per_epoch: int,
        batches_per_epoch: int,
        scheduler: Any,
        summed: bool = False,
        epoch_state: Any = None,
        first_step: int = 0,
    ) -> None:
        self.trainer = trainer
        self.summed = summed  # the step's loss is its micro-batches' sum (SummedLosses), reported as their mean
        self.steps_per_epoch, self.batches_per_epoch = steps_per_epoch, batches_per_epoch
        self.scheduler = scheduler
        self.accumulation = trainer.args.gradient_accumulation_steps
        self.loss_since_log = 0.0
        self.total_loss = 0.0
        self.first_step = first_step  # a run resumed from a checkpoint folder starts after it
        self.last_logged = first_step
        self.steps_seen = first_step  # a step replayed after a rollback is not shown twice
        self.stop_asked = False
        # Evaluation and saves at an epoch's end wait for its checkpoint (saving.EpochState).
        self.epoch_state = epoch_state
        self.due: dict[int, tuple[int, float, bool, bool]] = {}  # epoch: (step, state.epoch, evaluate, save)
        self.saved_at = -1
        self.held: list[tuple[dict[str, float], int, int]] = []

    def _event(self, name: str) -> None:
        trainer = self.trainer
        trainer.control = getattr(trainer.callback_handler, name)(trainer.args, trainer.state, trainer.control)
        if (
            trainer.control.should_training_stop
            and not self.stop_asked
            and trainer.state.global_step < trainer.state.max_steps
        ):
            self.stop_asked = True
            log.warning(
                "A TrainerCallback set control.should_training_stop at step %d: FabricTrainer does not stop its "
                "workers early yet; training goes on to max_steps.",
                trainer.state.global_step,
            )

    def record_step(self, metrics: dict[str, float], iteration: int, epoch: int, workers: int) -> None:
        if iteration <= self.steps_seen:
            return
        self.steps_seen = iteration
        if self.due:  # after an epoch whose evaluation or save waits for its checkpoint, as in Trainer's order
            self.held.append((metrics, iteration, epoch))
            return
        self._take_step(metrics, iteration, epoch)

    def _take_step(self, metrics: dict[str, float], iteration: int, epoch: int) -> None:
        state = self.trainer.state
        step = iteration - 1 - epoch * self.steps_per_epoch  # within the epoch
        if step == 0:
            self._event("on_epoch_begin")
        self._event("on_step_begin")
        learning_rate = self.scheduler.get_last_lr()[0]  # the rate this step used (Trainer logs it so)
        with warnings.catch_warnings():  # (its optimizer never steps: it only counts)
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()
        loss = metrics["loss"]
        if self.summed:
            first = step * self.accumulation
            loss *= min(self.accumulation, self.batches_per_epoch - first)
        self.loss_since_log += loss
        state.global_step = iteration
        state.epoch = epoch + min((step + 1) * self.accumulation, self.batches_per_epoch) / self.batches_per_epoch
        self._event("on_step_end")
        self._maybe_log(learning_rate)
        if step == self.steps_per_epoch - 1 or iteration == state.max_steps:
            self._event("on_epoch_end")
            self._maybe_log(learning_rate)
            control = self.trainer.control
            if control.should_evaluate or control.should_save:
                self.due[epoch] = (iteration, state.epoch, control.should_evaluate, control.should_save)
                control.should_evaluate = control.should_save = False

    def on_checkpoint(self, epoch: int, name: str | None) -> None:
        """The epoch's checkpoint is on disk (None: the end of training, the final state in the
        model): what Trainer does at the epoch's end, then the steps held since."""
        if self.epoch_state is None or epoch not in self.due:
            return
        step, state_epoch, evaluate, save = self.due.pop(epoch)
        self.epoch_state.at_epoch_end(name, step, state_epoch, evaluate, save)
        if save:
            self.saved_at = step
        held, self.held = self.held, []
        for metrics, iteration, at_epoch in held:
            if self.due:
                self.held.append((metrics, iteration, at_epoch))
            else:
                self._take_step(metrics, iteration, at_epoch)

    def finish(self) -> None:
        """After training: an epoch end still waiting (the last, whose checkpoint the run writes
        as its end) is done on the final state, which the model holds by now."""
        for epoch in sorted(self.due):
            self.on_checkpoint(epoch, None)

    def _maybe_log(self, learning_rate: float) -> None:
        trainer, state = self.trainer, self.trainer.state
        if not trainer.control.should_log or state.global_step <= self.last_logged:
            return
        logs = {"loss": self.loss_since_log / (state.global_step - self.last_logged), "learning_rate": learning_rate}
        self.total_loss += self.loss_since_log
        self.loss_since_log, self.last_logged = 0.0, state.global_step
        trainer.log(logs)  # log_history, on_log

    def train_loss(self) -> float:
        """Trainer's ``train_loss``: the mean of every step's loss."""
        return (self.total_loss + self.loss_since_log) / max(self.steps_seen - self.first_step, 0.001)
