"""What ``FabricTrainer`` cannot honour, refused before any worker starts: each message names the
argument, what it received and what to do instead (docs/transformers.md, "What is refused")."""

from __future__ import annotations

from typing import Any

#: Trainer's methods whose override would change the step FabricModel makes for it.
STEP_METHODS = ("training_step", "compute_loss", "get_batch_samples", "_inner_training_loop", "get_train_dataloader")


def _refuse(argument: str, received: Any, instead: str) -> ValueError:
    return ValueError(f"FabricTrainer cannot honour `{argument}`. Received: {received!r}. {instead}")


def check_trainer(trainer: Any, resume_from_checkpoint: Any, trial: Any) -> None:
    """Raise a ValueError for the first setting of ``trainer`` FabricTrainer cannot honour."""
    args = trainer.args
    checks: list[tuple[bool, str, Any, str]] = [
        (
            bool(args.deepspeed),
            "deepspeed",
            args.deepspeed,
            "FabricModel keeps a whole replica on each worker; "
            "shard_optimizer_state is its way to save memory: leave deepspeed unset.",
        ),
        (bool(args.fsdp), "fsdp", args.fsdp, "Leave fsdp unset: each worker holds the whole model."),
        (
            bool(args.torch_compile),
            "torch_compile",
            args.torch_compile,
            "Compile the model yourself before building the trainer (model = torch.compile(model)), or leave it False.",
        ),
        (
            args.save_strategy not in ("no", "epoch", "steps"),
            "save_strategy",
            str(args.save_strategy),
            "Use save_strategy='steps', 'epoch' or 'no' (with load_best_model_at_end, the best is kept).",
        ),
        (
            args.label_smoothing_factor != 0,
            "label_smoothing_factor",
            args.label_smoothing_factor,
            "Leave it 0 (the model's own loss is used).",
        ),
        (
            trainer.compute_loss_func is not None,
            "compute_loss_func",
            trainer.compute_loss_func,
            "Leave it None: the model computes its loss from the batch's labels.",
        ),
        (bool(args.auto_find_batch_size), "auto_find_batch_size", True, "Set per_device_train_batch_size."),
        (
            bool(args.dataloader_drop_last),
            "dataloader_drop_last",
            True,
            "Leave it False: every sample is trained once an epoch.",
        ),
        (
            getattr(args, "neftune_noise_alpha", None) is not None,
            "neftune_noise_alpha",
            args.neftune_noise_alpha,
            "Leave it None.",
        ),
        (trial is not None, "trial", trial, "Hyper-parameter search is not supported: call train() without it."),
        (args.n_gpu > 1, "n_gpu", args.n_gpu, "FabricTrainer puts one worker on each device: pass engines_number."),
    ]
    for refused, argument, received, instead in checks:
        if refused:
            raise _refuse(argument, received, instead)
    from transformers import Trainer

    for name in STEP_METHODS:
        if getattr(type(trainer), name) is not getattr(Trainer, name):
            raise ValueError(
                f"FabricTrainer cannot honour an override of Trainer.{name}. "
                f"Received: {type(trainer).__name__}.{name}. "
                "FabricModel makes each step from the model's loss on the batch Trainer's collator makes: "
                "put custom behaviour in the model, the collator or a TrainerCallback."
            )
    if trainer.train_dataset is None or not hasattr(trainer.train_dataset, "__len__"):
        raise ValueError(
            "FabricTrainer needs a map-style `train_dataset` (with __len__ and __getitem__). "
            f"Received: {type(trainer.train_dataset).__name__}."
        )
