"""Trainer's state, logs and callbacks, moved by the steps FabricModel commits.

:class:`TrainerProgress` is a driver logger (fabric_model/callbacks.py): the driver calls
``record_step`` once for each step it commits, in order, with the step's own loss. Each call
moves ``trainer.state`` as Trainer's loop does after an optimizer step and calls the trainer's
callback handler, so ``state.log_history``, ``on_log`` (TensorBoard's included) and a user's
``TrainerCallback`` see what Trainer would show them.

``control.should_training_stop``, set by a callback, stops the workers (``stop``:
``FabricModel.stop_training``). Set at an epoch's evaluation or save, training ends there as in
Trainer: the steps the workers took meanwhile are not shown, and the trainer takes that epoch's
checkpoint as the result (``stopped_at``). Set at a step, the workers stop at the first step they
can, a few at most after it (docs/transformers.md, "Stopping early").
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable
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
        checkpoint_state: Any = None,
        first_step: int = 0,
    ) -> None:
        self.trainer = trainer
        self.summed = summed  # the step's loss is its micro-batches' sum (SummedLosses), reported as their mean
        self.steps_per_epoch, self.batches_per_epoch = steps_per_epoch, batches_per_epoch
        self.scheduler = scheduler
        self.accumulation = trainer.args.gradient_accumulation_steps
        self.loss_since_log = 0.0
        self.grad_norm: float | None = None
        self.total_loss = 0.0
        self.first_step = first_step  # a run resumed from a checkpoint folder starts after it
        self.last_logged = first_step
        self.steps_seen = first_step  # a step replayed after a rollback is not shown twice
        self.stop: Callable[[], None] = lambda: None  # FabricModel.stop_training, once there is one
        self.stop_asked = False
        # An epoch's end where a callback stopped training: (its checkpoint's record, step, state.epoch).
        self.stopped_at: tuple[dict[str, Any], int, float] | None = None
        self.epoch_ended = False  # the last step shown ended its epoch
        # An evaluation or save waits for the checkpoint of its step (saving.CheckpointState); the
        # steps after it are held until then, so callbacks see Trainer's order of events.
        self.checkpoint_state = checkpoint_state
        self.due: dict[int, tuple[float, bool, bool]] = {}  # global step: (state.epoch, evaluate, save)
        self.on_disk: dict[int, str] = {}  # global step: its checkpoint's name, once written
        self.saved_at = -1
        self.held: list[tuple[dict[str, float], int, int]] = []

    def _event(self, name: str) -> None:
        trainer = self.trainer
        trainer.control = getattr(trainer.callback_handler, name)(trainer.args, trainer.state, trainer.control)
        self._stop_if_asked()

    def _stop_if_asked(self) -> bool:
        """A callback set ``control.should_training_stop`` before the last step: the workers are told, once."""
        trainer = self.trainer
        if self.stop_asked or not trainer.control.should_training_stop:
            return self.stop_asked
        if trainer.state.global_step >= trainer.state.max_steps:
            return False
        self.stop_asked = True
        log.info("a TrainerCallback stopped training at step %d", trainer.state.global_step)
        self.stop()
        return True

    def record_step(self, metrics: dict[str, float], iteration: int, epoch: int, workers: int) -> None:
        if iteration <= self.steps_seen or self.stopped_at is not None:
            return  # (after an epoch's end that stopped training: steps the result does not hold)
        self.steps_seen = iteration
        if self.due:  # after a step whose evaluation or save waits for its checkpoint, as in Trainer's order
            self.held.append((metrics, iteration, epoch))
            return
        self._take_step(metrics, iteration, epoch)
        self._catch_up()

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
        self.grad_norm = metrics.get("grad_norm")  # (max_grad_norm: Trainer logs the last step's)
        state.global_step = iteration
        state.epoch = epoch + min((step + 1) * self.accumulation, self.batches_per_epoch) / self.batches_per_epoch
        self._event("on_step_end")
        self._maybe_log(learning_rate)
        self._note_due(iteration)  # eval_strategy / save_strategy "steps"
        self.epoch_ended = step == self.steps_per_epoch - 1 or iteration == state.max_steps
        if self.epoch_ended:
            self._event("on_epoch_end")
            self._maybe_log(learning_rate)
            self._note_due(iteration)  # "epoch"

    def _note_due(self, iteration: int) -> None:
        """An evaluation or save the callbacks asked for at this step, done once its checkpoint is on disk."""
        control, state = self.trainer.control, self.trainer.state
        if not (control.should_evaluate or control.should_save):
            return
        _, evaluate, save = self.due.get(iteration, (0.0, False, False))
        self.due[iteration] = (state.epoch, evaluate or control.should_evaluate, save or control.should_save)
        control.should_evaluate = control.should_save = False

    def on_step_checkpoint(self, iteration: int, name: str) -> None:
        """FabricModel's checkpoint after ``iteration`` steps is on disk (driver logger hook)."""
        if iteration > self.last_done:
            self.on_disk[iteration] = name
            self._catch_up()

    @property
    def last_done(self) -> int:
        """The last step whose evaluation and save are done (or had none)."""
        return min(self.due) - 1 if self.due else self.steps_seen

    def _catch_up(self) -> None:
        """The evaluation or save due whose checkpoint is on disk, then the steps held behind it, in order."""
        while self.due and min(self.due) in self.on_disk and self.stopped_at is None:
            step = min(self.due)
            self._end_due(step, self.on_disk[step])
            self._release_held()
        for iteration in [i for i in self.on_disk if i <= self.last_done]:
            del self.on_disk[iteration]

    def _release_held(self) -> None:
        """The steps held behind a due evaluation or save, until the next one due."""
        held, self.held = self.held, []
        for metrics, iteration, at_epoch in held:
            if self.due or self.stopped_at is not None:
                self.held.append((metrics, iteration, at_epoch))
            else:
                self._take_step(metrics, iteration, at_epoch)

    def _end_due(self, step: int, name: str | None) -> None:
        """Trainer's evaluation and save at ``step`` on its checkpoint ``name`` (None: the final
        state, in the model by now)."""
        state_epoch, evaluate, save = self.due.pop(step)
        asked_before = self.stop_asked
        self.checkpoint_state.evaluate_and_save(name, step, state_epoch, evaluate, save)
        if save:
            self.saved_at = step
        if name is not None and not asked_before and self._stop_if_asked():
            # Stopped at this evaluation or save (as EarlyStoppingCallback stops): this checkpoint
            # is the result, and the steps taken since are not shown.
            self.stopped_at = (self.checkpoint_state.read(name), step, state_epoch)
            self.held, self.steps_seen = [], step
            self.due.clear()

    def finish(self) -> None:
        """After training: an evaluation or save still waiting (the last step's, whose checkpoint
        the run writes as its end) is done on the final state, which the model holds by now."""
        while self.due and self.stopped_at is None:
            step = min(self.due)
            if step == self.steps_seen:  # the last step's: its checkpoint is the run's end
                self._end_due(step, None)
            else:  # (a checkpoint whose write failed: driver.log and run.json say so)
                log.warning("the checkpoint of step %d never came: its evaluation and save are skipped", step)
                self.due.pop(step)
            self._release_held()
        if self.stop_asked and self.stopped_at is None and not self.epoch_ended and self.checkpoint_state is not None:
            # Stopped inside an epoch: Trainer ends that epoch there (on_epoch_end, its evaluation
            # and save), on the final state, which the model holds by now.
            state = self.trainer.state
            self._event("on_epoch_end")
            self._maybe_log(self.scheduler.get_last_lr()[0])
            control = self.trainer.control
            if control.should_evaluate or control.should_save:
                self.checkpoint_state.evaluate_and_save(
                    None, state.global_step, state.epoch, control.should_evaluate, control.should_save
                )
                if control.should_save:
                    self.saved_at = state.global_step
                control.should_evaluate = control.should_save = False

    def _maybe_log(self, learning_rate: float) -> None:
        trainer, state = self.trainer, self.trainer.state
        if not trainer.control.should_log or state.global_step <= self.last_logged:
            return
        logs = {"loss": self.loss_since_log / (state.global_step - self.last_logged)}
        if self.grad_norm is not None:
            logs["grad_norm"] = self.grad_norm
        logs["learning_rate"] = learning_rate
        self.total_loss += self.loss_since_log
        self.loss_since_log, self.last_logged = 0.0, state.global_step
        trainer.log(logs)  # log_history, on_log

    def train_loss(self) -> float:
        """Trainer's ``train_loss``: the mean of every step's loss."""
        return (self.total_loss + self.loss_since_log) / max(self.steps_seen - self.first_step, 0.001)
