"""Trainer's evaluation and ``checkpoint-N/`` folders, in the caller, on FabricModel's checkpoints.

FabricModel writes its own checkpoint at each epoch's end (``checkpoint_freq=1``) and every
``checkpoint_steps`` steps (``eval_steps`` and ``save_steps``); when one is on disk the driver
tells its loggers (``on_step_checkpoint``). :class:`CheckpointState` loads that state into the
caller's model, optimizer and scheduler (which the workers no longer use: they trained copies),
and Trainer's own methods evaluate (``eval_strategy``) and write the folder (``save_strategy``:
``_save_checkpoint``, so the layout is Trainer's and ``Trainer`` resumes from it), with
``state.global_step`` that of the checkpoint's step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..state.checkpoint import load_checkpoint
from ..step.loop_state import LoopState


class CheckpointState:
    """Puts FabricModel's checkpoints into the caller's Trainer (module docstring)."""

    def __init__(self, trainer: Any, run_dir: Path, lr_scheduling: Any) -> None:
        self.trainer, self.run_dir, self.lr_scheduling = trainer, run_dir, lr_scheduling

    def read(self, name: str) -> dict[str, Any]:
        """The checkpoint ``name``'s record (kept by a trainer stopped there: the run may delete the file)."""
        return load_checkpoint(self.run_dir / "checkpoints" / name)

    def load(self, name: str | dict[str, Any]) -> None:
        """The checkpoint ``name`` (or a record :meth:`read`) into the trainer's model, optimizer and scheduler."""
        trainer = self.trainer
        record = self.read(name) if isinstance(name, str) else name
        missing, unexpected = trainer.model.load_state_dict(record["model"], strict=False)
        if unexpected:
            raise RuntimeError(f"the checkpoint {name} holds tensors the model lacks: {unexpected[:5]}")
        own = LoopState(["loss"], self.lr_scheduling, []).unpack(record["optimizer"])  # the scheduler's too
        trainer.optimizer.load_state_dict(own)

    def evaluate_and_save(self, name: str | None, global_step: int, epoch: float, evaluate: bool, save: bool) -> None:
        """Trainer's evaluation and save at step ``global_step`` (``name``: its checkpoint; None:
        the state the model holds)."""
        trainer = self.trainer
        state = trainer.state
        now = state.global_step, state.epoch
        state.global_step, state.epoch = global_step, epoch  # (later steps may be committed already)
        try:
            if name is not None:
                self.load(name)
            prepare_for_evaluation(trainer)
            if evaluate:
                metrics = trainer.evaluate()
                trainer._determine_best_metric(metrics=metrics, trial=None)
            if save:
                trainer._save_checkpoint(trainer.model, trial=None)
                trainer.control = trainer.callback_handler.on_save(trainer.args, state, trainer.control)
        finally:
            state.global_step, state.epoch = now


def prepare_for_evaluation(trainer: Any) -> None:
    """The caller's model registered with Trainer's accelerator, as Trainer's own training leaves
    it: ``evaluate()`` then reports what it reports after ``Trainer.train()`` (no
    ``eval_model_preparation_time``). Done once the workers hold their copies: it may wrap the
    model's forward."""
    accelerator = trainer.accelerator
    if len(accelerator._models) == 0:
        accelerator.prepare_model(trainer.model, evaluation_mode=True)
