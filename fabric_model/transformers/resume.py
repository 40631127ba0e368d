"""``FabricTrainer.train(resume_from_checkpoint=...)``: a ``checkpoint-N/`` folder (Trainer's or
FabricTrainer's) made the starting state of a FabricModel run, on any worker count.

Trainer's own loaders put the folder's model, optimizer and scheduler into the caller's objects
and read its ``trainer_state.json``; the state is then written as the checkpoint of a new
FabricModel run directory at the unit of step N, and FabricModel resumes from it
(``train(resume=True)``): the plan, Trainer's sampler order and the seeds are the uninterrupted
run's, so the steps after N are that run's steps.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..state.checkpoint import encode_state, state_record, write_checkpoint
from ..step.loop_state import EXTRA_KEY
from ..step.plan import Plan, Schedule

TRAINER_STATE = "trainer_state.json"


def checkpoint_folder(trainer: Any, resume_from_checkpoint: str | bool) -> Path:
    """The folder ``resume_from_checkpoint`` names (True: the newest under ``output_dir``), checked."""
    from transformers.trainer_utils import get_last_checkpoint

    if resume_from_checkpoint is True:
        found = get_last_checkpoint(str(trainer.args.output_dir))
        if found is None:
            raise ValueError(
                "Expected a checkpoint-N folder under output_dir for resume_from_checkpoint=True. "
                f"Received: none in {trainer.args.output_dir}."
            )
        return Path(found)
    folder = Path(os.fspath(resume_from_checkpoint))  # type: ignore[arg-type]
    if not (folder / TRAINER_STATE).is_file():
        raise ValueError(
            "Expected `resume_from_checkpoint` to name a checkpoint-N folder holding trainer_state.json. "
            f"Received: {str(resume_from_checkpoint)!r}."
        )
    return folder


def load_folder(trainer: Any, folder: Path) -> Any:
    """The folder's model, optimizer and scheduler into the trainer's objects; its TrainerState."""
    from transformers import TrainerState

    trainer._load_from_checkpoint(str(folder))
    trainer._load_optimizer_and_scheduler(str(folder))
    return TrainerState.load_from_json(str(folder / TRAINER_STATE))


def write_start(trainer: Any, run_dir: Path, plan: Plan, epochs: int, global_step: int, callbacks: int) -> None:
    """The trainer's state as the checkpoint of a FabricModel run in ``run_dir``, at step
    ``global_step`` of ``plan``: what ``train(resume=True)`` continues from."""
    steps = plan.steps_per_epoch
    epoch, step = divmod(global_step, steps)
    if epoch >= epochs:
        raise ValueError(
            f"Expected the checkpoint to hold fewer steps than the run's {epochs * steps}. "
            f"Received: a checkpoint at step {global_step}."
        )
    schedule = Schedule(plan, epochs, 1, False)
    unit = schedule.unit(epoch, step)
    loop = {
        "epoch": -1,  # the epoch's running average starts afresh (Trainer's logs are the caller's)
        "sums": [0.0, 0.0],
        "lr_scheduler": trainer.lr_scheduler.state_dict(),
        "callbacks": [None] * callbacks,
    }
    optimizer = {**trainer.optimizer.state_dict(), EXTRA_KEY: loop}
    model = {k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}
    record = state_record(schedule, unit, "torch", plan.items_per_micro_batch, model, optimizer)
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    write_checkpoint(run_dir / "checkpoints", unit, encode_state(record))
