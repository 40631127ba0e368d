"""What ``FabricTrainer`` cannot honour is refused in the caller, before any worker starts, naming
the argument, what it received and what to do instead (fabric_model/transformers/refusals.py).

In-process: ``train()`` raises before FabricModel is built. One trainer serves the module (a
Trainer takes a second to build), each test setting the arguments it refuses on it; transformers
is imported by the fixture, not at collection (it costs seconds of every test process's start)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from .helpers import need


def tiny_trainer(output_dir: Path, trainer_class: Any = None) -> Any:
    transformers = need("transformers")
    from fabric_model.transformers import FabricTrainer

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1)
    data = [{"input_ids": torch.arange(1, 5), "labels": torch.arange(1, 5)}] * 4
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=2, report_to=[], use_cpu=True, save_strategy="no"
    )
    return (trainer_class or FabricTrainer)(
        model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=data, eval_dataset=data
    )


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_trainer(tmp_path_factory.mktemp("refused"))


@pytest.mark.parametrize(
    ("changes", "argument", "instead"),
    [
        ({"deepspeed": "ds_config.json"}, "deepspeed", "shard_optimizer_state"),
        ({"fsdp": "full_shard"}, "fsdp", "Leave fsdp unset"),
        ({"torch_compile": True}, "torch_compile", "torch.compile(model)"),
        ({"save_strategy": "best"}, "save_strategy", "'epoch'"),
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor", "Leave it 0"),
        ({"auto_find_batch_size": True}, "auto_find_batch_size", "per_device_train_batch_size"),
        ({"dataloader_drop_last": True}, "dataloader_drop_last", "Leave it False"),
        ({"neftune_noise_alpha": 5.0}, "neftune_noise_alpha", "Leave it None"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_an_argument_it_cannot_honour_is_refused_by_name(trainer, monkeypatch, changes, argument, instead):
    for name, value in changes.items():  # set on the built trainer, as a script's arguments would read
        monkeypatch.setattr(trainer.args, name, value)
    with pytest.raises(ValueError) as info:
        trainer.train()
    message = str(info.value)
    assert f"FabricTrainer cannot honour `{argument}`" in message and "Received:" in message and instead in message
    assert not (Path(trainer.args.output_dir) / "fabric_run").exists()  # nothing started


def test_a_missing_checkpoint_and_a_trial_are_refused(trainer):
    with pytest.raises(ValueError, match=r"`resume_from_checkpoint` to name a checkpoint-N folder.*'checkpoint-4'"):
        trainer.train(resume_from_checkpoint="checkpoint-4")
    with pytest.raises(ValueError, match=r"checkpoint-N folder under output_dir.*Received: none"):
        trainer.train(resume_from_checkpoint=True)
    with pytest.raises(ValueError, match=r"`trial`"):
        trainer.train(trial={"learning_rate": 1e-3})


def test_a_dataset_without_length_is_refused(trainer, monkeypatch):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield {"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4]}

    monkeypatch.setattr(trainer, "train_dataset", Stream())
    with pytest.raises(ValueError, match=r"map-style `train_dataset`.*Received: Stream"):
        trainer.train()


def test_an_overridden_step_is_refused(tmp_path):
    need("transformers")
    from fabric_model.transformers import FabricTrainer

    class OwnStep(FabricTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            return super().training_step(model, inputs, num_items_in_batch)

    with pytest.raises(ValueError, match=r"override of Trainer.training_step. Received: OwnStep.training_step"):
        tiny_trainer(tmp_path, trainer_class=OwnStep).train()
