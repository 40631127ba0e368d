"""Trainer's evaluation and ``checkpoint-N/`` folders at an epoch's end, in the caller.

FabricModel writes its own checkpoint at each epoch's end (``checkpoint_freq=1``); when it is on
disk the driver tells its loggers (``on_checkpoint``). :class:`EpochState` loads that state into
the caller's model, optimizer and scheduler (which the workers no longer use: they trained
copies), and Trainer's own methods evaluate (``eval_strategy="epoch"``) and write the folder
(``save_strategy="epoch"``: ``_save_checkpoint``, so the layout is Trainer's and ``Trainer``
resumes from it), with ``state.global_step`` that of the epoch's last step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..state.checkpoint import load_checkpoint
from ..step.loop_state import LoopState


class EpochState:
    """Puts FabricModel's epoch-end checkpoints into the caller's Trainer (module docstring)."""

    def __init__(self, trainer: Any, run_dir: Path, lr_scheduling: Any) -> None:
        self.trainer, self.run_dir, self.lr_scheduling = trainer, run_dir, lr_scheduling

    def load(self, name: str) -> None:
        """The checkpoint ``name`` into the trainer's model, optimizer and scheduler."""
        trainer = self.trainer
        record = load_checkpoint(self.run_dir / "checkpoints" / name)
        missing, unexpected = trainer.model.load_state_dict(record["model"], strict=False)
        if unexpected:
            raise RuntimeError(f"the checkpoint {name} holds tensors the model lacks: {unexpected[:5]}")
        own = LoopState(["loss"], self.lr_scheduling, []).unpack(record["optimizer"])  # the scheduler's too
        trainer.optimizer.load_state_dict(own)

    def at_epoch_end(self, name: str | None, global_step: int, epoch: float, evaluate: bool, save: bool) -> None:
        """Trainer's evaluation and save of the epoch that ended at ``global_step`` (``name``: its
        checkpoint; None: the state the model holds)."""
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
