"""``FabricTrainer``: ``transformers.Trainer`` whose ``train()`` runs on FabricModel.

The caller's Trainer builds everything as it would (the sampler, the collator, the optimizer and
scheduler, its state and callbacks); FabricModel trains on them, elastic, and the caller's
Trainer follows the committed steps (progress.py). docs/transformers.md is the user's side,
docs/architecture.md ("Front ends") where it sits.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Any

from transformers import Trainer, TrainerState
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import TrainOutput, speed_metrics

from ..api import FabricModel
from ..callbacks import Callback
from ..context import worker_context
from ..step.plan import Plan
from ..step.sampling import SummedLosses
from .data import TrainerData, TrainerDatasets, loss_weighting, sampler_orders
from .progress import TrainerProgress, shadow_scheduler
from .refusals import check_trainer
from .resume import checkpoint_folder, load_folder, write_start
from .saving import CheckpointState, prepare_for_evaluation

#: Where FabricModel's run directory (logs, its own checkpoints) goes under ``output_dir``.
RUN_FOLDER = "fabric_run"


class FabricTrainer(Trainer):
    """A ``transformers.Trainer`` that trains on up to ``engines_number`` elastic workers.

    It takes Trainer's arguments, and:

    Args:
        engines_number: the most workers (``FabricModel.train``'s; default: one per local GPU, 1 on
            a CPU). The global batch stays ``per_device_train_batch_size * gradient_accumulation_steps``
            on any worker count: workers share a step's micro-batches.
        deterministic: bitwise the same weights on any worker count, through lost and joining
            workers (``FabricModel.train(deterministic=True)``).
        fabric_options: further keywords for ``FabricModel.train`` (``shard_optimizer_state``,
            ``cluster``, ``verbose``...) and ``worker_logger_callback`` for ``FabricModel``.
    """

    def __init__(
        self,
        *args: Any,
        engines_number: int | None = None,
        deterministic: bool = False,
        fabric_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.engines_number, self.deterministic = engines_number, deterministic
        self.fabric_options = dict(fabric_options or {})
        self.fabric_run_dir: str | None = None

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> TrainOutput:
        """Train as ``Trainer.train`` does, on FabricModel; returns Trainer's ``TrainOutput``."""
        check_trainer(self, resume_from_checkpoint, trial)
        if kwargs:
            raise TypeError(f"FabricTrainer.train() got unexpected keyword arguments: {sorted(kwargs)}")
        args = self.args
        self.is_in_train = True
        model: Any = self.model
        if args.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
        dataloader = self.get_train_dataloader()
        (epochs, steps_per_epoch, _, num_train_samples, _, batches_per_epoch, max_steps) = (
            self.set_initial_training_values(args, dataloader)
        )
        self._start_state(max_steps, epochs)
        self.create_optimizer_and_scheduler(num_training_steps=max_steps)
        data, collator = self._training_data(dataloader, epochs)
        run_dir = Path(args.output_dir or ".") / RUN_FOLDER
        stop = [StopAtStep(max_steps)] if max_steps < epochs * steps_per_epoch else []
        first_step = 0
        if resume_from_checkpoint not in (None, False):
            folder = checkpoint_folder(self, resume_from_checkpoint)
            self.state = load_folder(self, folder)
            self.state.init_training_references(self, max_steps, epochs, None)
            self._load_callback_state()
            first_step = self.state.global_step
            # A run directory of its own: FabricModel resumes from the folder's state alone.
            run_dir = run_dir.with_name(f"{RUN_FOLDER}-from-{folder.name}")
            shutil.rmtree(run_dir, ignore_errors=True)
            plan = Plan(len(data), args.per_device_train_batch_size, args.gradient_accumulation_steps, args.seed)
            write_start(self, run_dir, plan, epochs, first_step, len(stop))
        scheduling = {"scheduler": self.lr_scheduler, "interval": "step"}
        progress = TrainerProgress(
            self,
            steps_per_epoch,
            int(batches_per_epoch or 0),
            shadow_scheduler(self.lr_scheduler, self.optimizer),
            summed=isinstance(data.loss_weighting, SummedLosses),
            first_step=first_step,
        )
        fabric = FabricModel(
            self.model,
            TrainerDatasets(data),
            None,  # the model's own loss (labels in the batch), as Trainer's compute_loss
            self.optimizer,
            metrics=[],
            fn_batch_collate=collator,
            driver_logger_callback=progress,
            user_callback=stop or None,
            lr_scheduler=scheduling,
            precision="bf16-mixed" if args.bf16 else "16-mixed" if args.fp16 else "32",
            gradient_clip_norm=args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None,
            worker_logger_callback=self.fabric_options.get("worker_logger_callback"),
        )
        progress.stop = fabric.stop_training  # control.should_training_stop (progress.py)
        progress.checkpoint_state = CheckpointState(
            self, run_dir, fabric.lr_scheduling
        )  # (the scheduler as FabricModel holds it)
        options: dict[str, Any] = {
            "seed": args.seed,
            "deterministic": self.deterministic,
            "run_dir": run_dir,
            "checkpoint_freq": 1,
            "checkpoint_steps": self._checkpoint_steps(),
            "resume": first_step > 0,
            "tensorboard": False,  # report_to's callbacks log, from Trainer's own on_log
        }
        if args.dataloader_num_workers:
            options["num_dataloader_processes"] = args.dataloader_num_workers
        options.update({k: v for k, v in self.fabric_options.items() if k != "worker_logger_callback"})
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        start_time = time.time()
        fabric.train(
            epochs,
            args.per_device_train_batch_size,
            self.engines_number,
            effective_batch_size=args.per_device_train_batch_size * args.gradient_accumulation_steps,
            **options,
        )
        self.fabric_run_dir = str(fabric.run_dir)
        progress.finish()
        if progress.stopped_at is not None:  # a callback stopped training at an epoch's end: its state
            record, step, epoch = progress.stopped_at
            progress.checkpoint_state.load(record)
            self.state.global_step, self.state.epoch = step, epoch
        if args.save_strategy != "no" and progress.saved_at != self.state.global_step:
            # The end's save (Trainer saves at max_steps): the final state is in the model by now.
            self._save_checkpoint(model, trial=None)
            self.control = self.callback_handler.on_save(args, self.state, self.control)
        return self._finish(progress, start_time, num_train_samples)

    def _checkpoint_steps(self) -> int:
        """FabricModel's ``checkpoint_steps``: a checkpoint at every step where ``eval_steps`` or
        ``save_steps`` may ask for an evaluation or a save (0: neither strategy is ``"steps"``)."""
        args, state = self.args, self.state
        every = [
            int(steps)
            for strategy, steps in ((args.eval_strategy, state.eval_steps), (args.save_strategy, state.save_steps))
            if strategy == "steps" and steps
        ]
        return math.gcd(*every) if every else 0

    def _start_state(self, max_steps: int, epochs: int) -> None:
        """A fresh ``TrainerState``, as Trainer's loop makes one."""
        stateful: list[Any] = [
            cb for cb in [*self.callback_handler.callbacks, self.control] if isinstance(cb, ExportableState)
        ]
        self.state = TrainerState(stateful_callbacks=stateful)
        self.state.train_batch_size = self._train_batch_size
        self.state.compute_steps(self.args, max_steps)
        self.state.init_training_references(self, max_steps, epochs, None)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr, None))

    def _training_data(self, dataloader: Any, epochs: int) -> tuple[TrainerData, Any]:
        """The dataset and collator Trainer's DataLoader reads, its sampler's orders, Trainer's weights."""
        dataset: Any = self.train_dataset
        collator = self.data_collator
        if _is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        orders = sampler_orders(dataloader, epochs, len(dataset))
        weighting, collator = loss_weighting(self, dataset, collator)
        return TrainerData(dataset, orders, weighting), collator

    def _finish(self, progress: TrainerProgress, start_time: float, num_train_samples: int) -> TrainOutput:
        """Trainer's end of training: the summary logged, ``on_train_end``, the ``TrainOutput``."""
        state = self.state
        steps = progress.steps_seen - progress.first_step  # in this call
        metrics = speed_metrics(
            "train", start_time, num_samples=num_train_samples * steps / max(state.max_steps, 1), num_steps=steps
        )
        metrics["total_flos"] = state.total_flos
        metrics["train_loss"] = progress.train_loss()
        self.log(metrics)
        prepare_for_evaluation(self)
        if self.args.load_best_model_at_end and state.best_model_checkpoint is not None:
            self._load_best_model()
        self.control = self.callback_handler.on_train_end(self.args, state, self.control)
        self.is_in_train = False
        self.model_wrapped = self.model  # type: ignore[assignment]  # Trainer's own after training
        return TrainOutput(state.global_step, metrics["train_loss"], metrics)


class StopAtStep(Callback):
    """A worker callback ending training after global step ``max_steps`` (``TrainingArguments.max_steps``
    inside an epoch): every replica decides from the step alone, so all stop at the same one."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps

    def state_dict(self) -> dict[str, bool]:
        return {"stop_training": self.stop_training}  # a joiner stops with the others

    def load_state_dict(self, state: dict[str, bool]) -> None:
        self.stop_training = bool(state["stop_training"])

    def on_batch_end(self, step: int) -> None:
        context = worker_context()
        if context is not None and context.global_step + 1 >= self.max_steps:
            self.stop_training = True


def _is_hf_dataset(dataset: Any) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)
