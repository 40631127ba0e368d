"""``FabricTrainer`` (fabric_model/transformers/): a Trainer script with one import changed.

Scripts written as Trainer's documentation writes them (a GPT-2 causal LM, a BERT classifier
with ``compute_metrics``; models built from configs), run with ``Trainer`` and ``FabricTrainer``:
the same weights to float32 rounding and the same logs on one engine, evaluated and saved by
epoch or by steps, stopped by a callback; bitwise the one-engine run on two and three workers
with one killed and one joining; LoRA; checkpoint folders resumed across Trainer and
FabricTrainer (the refusals: test_transformers_refusals.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fabric_model.testing import FaultInjector, HoldForJoin, Kill

from .helpers import Lazily

# Imported at first use, not at collection: transformers costs every test process seconds.
transformers, datasets = Lazily("transformers"), Lazily("datasets")

SEQ = 16


def FabricTrainer(**kwargs: Any) -> Any:  # noqa: N802  (the class, imported when a test runs)
    from fabric_model.transformers import FabricTrainer as trainer_class

    return trainer_class(**kwargs)


def gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    config.bos_token_id = config.eos_token_id = 0
    return transformers.GPT2LMHeadModel(config)


def lm_data(n: int = 44) -> Any:
    """Token blocks whose ends are padding (labels -100): a different count of items a sample."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, (n, SEQ))
    labels = ids.copy()
    for i in range(n):
        labels[i, SEQ - (i % 5) * 2 :] = -100
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def lm_args(out: Path, **changes) -> Any:
    settings = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        learning_rate=1e-3,
        warmup_steps=2,
        weight_decay=0.01,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        logging_steps=2,
        seed=0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    settings.update(changes)
    return transformers.TrainingArguments(**settings)


def weights_gap(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.state_dict().values(), b.state_dict().values()))


SPEEDS = ("runtime", "samples_per_second", "steps_per_second")


def same_logs(trainer: list[dict], fabric: list[dict]) -> None:
    """The same entries at the same steps, with the same values (the runtime's aside)."""
    timing = {"total_flos"} | {f"{kind}_{what}" for kind in ("train", "eval") for what in SPEEDS}
    assert [e["step"] for e in fabric] == [e["step"] for e in trainer]
    for t, f in zip(trainer, fabric):
        assert set(f) == set(t)  # the same keys (a history read back from trainer_state.json is sorted)
        for key in set(f) - timing:
            assert f[key] == pytest.approx(t[key], rel=1e-4 if key == "grad_norm" else 1e-5), key


def SeenLogs() -> Any:  # noqa: N802
    """A user's TrainerCallback: the steps it saw logged, and its other events."""

    class Seen(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[int] = []
            self.events: list[str] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.events.append("train_begin")

        def on_epoch_end(self, args, state, control, **kwargs):
            self.events.append(f"epoch_end {state.epoch:g}")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in (logs or {}):
                self.steps.append(state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            self.events.append("train_end")

    return Seen()


pytestmark = pytest.mark.processes


def test_a_causal_lm_script_trains_evaluates_and_saves_as_trainer_does_on_one_engine(tmp_path):
    epochs = dict(eval_strategy="epoch", save_strategy="epoch", save_total_limit=3)
    reference, model = gpt2(), gpt2()
    trainer = transformers.Trainer(
        model=reference, args=lm_args(tmp_path / "t", **epochs), train_dataset=lm_data(), eval_dataset=lm_data(12)
    )
    trainer.train()
    seen = SeenLogs()
    fabric = FabricTrainer(
        model=model,
        args=lm_args(tmp_path / "f", **epochs),
        train_dataset=lm_data(),
        eval_dataset=lm_data(12),
        callbacks=[seen],
        engines_number=1,
    )
    out = fabric.train()
    # Adam turns float32 rounding of near-zero gradients into steps of the learning rate's size:
    # 1e-5 is 0.1% of what 12 steps at 1e-3 can move a weight.
    assert weights_gap(model, reference) < 1e-5
    same_logs(trainer.state.log_history, fabric.state.log_history)  # the epochs' eval_loss among them
    assert [e["step"] for e in fabric.state.log_history if "eval_loss" in e] == [6, 12]
    assert out.global_step == 12 and out.training_loss == pytest.approx(trainer.state.log_history[-1]["train_loss"])
    assert seen.steps == [2, 4, 6, 8, 10, 12]
    assert seen.events == ["train_begin", "epoch_end 1", "epoch_end 2", "train_end"]
    # Trainer's checkpoint folders, from which Trainer itself resumes to the same model.
    saved = sorted(p.name for p in (tmp_path / "f").glob("checkpoint-*"))
    assert saved == ["checkpoint-12", "checkpoint-6"]
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= {
        p.name for p in (tmp_path / "f" / "checkpoint-6").iterdir()
    }
    resumed = gpt2()
    again = transformers.Trainer(
        model=resumed, args=lm_args(tmp_path / "r", **epochs), train_dataset=lm_data(), eval_dataset=lm_data(12)
    )
    again.train(resume_from_checkpoint=str(tmp_path / "f" / "checkpoint-6"))
    assert weights_gap(resumed, reference) < 1e-5
    # After train(), the Trainer a script expects: save_model writes the trained model.
    fabric.save_model(str(tmp_path / "saved"))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"))
    assert weights_gap(loaded, model) == 0.0


def bert() -> Any:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(config)


def cls_data(n: int) -> Any:
    rng = np.random.default_rng(1)
    ids = rng.integers(1, 50, (n, SEQ))
    return datasets.Dataset.from_dict(
        {
            "input_ids": ids.tolist(),
            "attention_mask": np.ones_like(ids).tolist(),
            "label": (ids[:, 0] % 3).tolist(),
            "text": ["unused"] * n,  # a column the model does not take: Trainer removes it
        }
    )


def accuracy(prediction) -> dict[str, float]:
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def test_a_classifier_evaluated_and_saved_every_3_steps_with_compute_metrics_and_the_best_kept(tmp_path):
    # 42 samples, steps of 12 in micro-batches of 4: 4 steps an epoch, the last holding 6 (a
    # micro-batch of 2). Evaluated and saved every 3 steps (inside the epochs), the best model (by
    # compute_metrics' accuracy) kept at the end.
    changes = dict(per_device_train_batch_size=4, gradient_accumulation_steps=3, num_train_epochs=2, logging_steps=1)
    changes.update(
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=3,
        load_best_model_at_end=True,
        metric_for_best_model="accuracy",
    )
    reference, model = bert(), bert()
    trainer = transformers.Trainer(
        model=reference,
        args=lm_args(tmp_path / "t", **changes),
        train_dataset=cls_data(42),
        eval_dataset=cls_data(20),
        compute_metrics=accuracy,
    )
    trainer.train()
    fabric = FabricTrainer(
        model=model,
        args=lm_args(tmp_path / "f", **changes),
        train_dataset=cls_data(42),
        eval_dataset=cls_data(20),
        compute_metrics=accuracy,
    )
    fabric.train()
    assert weights_gap(model, reference) < 1e-5
    same_logs(trainer.state.log_history, fabric.state.log_history)
    assert [e["step"] for e in fabric.state.log_history if "eval_accuracy" in e] == [3, 6, 8]  # and the end, as Trainer
    assert Path(fabric.state.best_model_checkpoint).name == Path(trainer.state.best_model_checkpoint).name
    folders = sorted(p.name for p in (tmp_path / "f").glob("checkpoint-*"))
    assert folders == sorted(p.name for p in (tmp_path / "t").glob("checkpoint-*")) and "checkpoint-3" in folders
    expected, got = trainer.evaluate(), fabric.evaluate()
    assert got["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-4)
    assert got["eval_accuracy"] == expected["eval_accuracy"]


def test_two_workers_one_killed_and_one_joining_give_the_one_engine_bits(tmp_path):
    runs = {}
    for engines, faults in ((1, []), (2, [Kill(worker=1, step=2), HoldForJoin(4)])):
        model, seen = gpt2(), SeenLogs()
        options = {"worker_logger_callback": FaultInjector(faults, tmp_path)} if faults else {}
        fabric = FabricTrainer(
            model=model,
            # The last epoch stopped mid-way; evaluated every 3 steps, on checkpoints inside the epochs.
            args=lm_args(tmp_path / f"e{engines}", max_steps=9, eval_strategy="steps", eval_steps=3),
            train_dataset=lm_data(),
            eval_dataset=lm_data(12),
            callbacks=[seen],
            engines_number=engines,
            deterministic=True,
            fabric_options=options,
        )
        fabric.train()
        runs[engines] = (model, fabric, seen)
    (one, one_trainer, seen_one), (two, two_trainer, seen) = runs[1], runs[2]
    runs_of = (one_trainer, two_trainer)
    assert weights_gap(one, two) == 0.0
    assert seen.steps == seen_one.steps == [2, 4, 6, 8]  # every logged step once, the kill's replay too
    logged = [[(e["step"], e.get("loss"), e.get("eval_loss")) for e in t.state.log_history[:-1]] for t in runs_of]
    assert logged[0] == logged[1] and [s for s, _, evaluated in logged[1] if evaluated] == [3, 6, 9]
    # Exactly once: every micro-batch of every committed step once, as the plan divides the
    # epochs of Trainer's sampler order (each order a permutation: checked in the caller).
    lines = (Path(two_trainer.fabric_run_dir) / "logs" / "metrics.jsonl").read_text().splitlines()
    generations = [r for r in map(json.loads, lines) if r["type"] == "generation"]
    assert len(generations) == 3 and len(generations[-1]["members"]) == 2  # start, the kill, the join
    steps = [r for r in map(json.loads, lines) if r["type"] == "train"]
    last = {(r["epoch"], r["step"]): r for r in steps}  # a replayed step's later record wins
    assert sorted(last) == [(0, s) for s in range(6)] + [(1, s) for s in range(3)]
    for (epoch, step), record in last.items():
        micro = sorted(j for mbs in record["micro_batches"].values() for j in mbs)
        assert micro == ([0] if step == 5 else [0, 1]), (epoch, step, micro)  # 44 samples: 5 x 8, then 4


def test_the_classifier_on_three_workers_one_killed_and_one_joining_gives_the_one_engine_bits(tmp_path):
    """The BERT script (compute_metrics, evaluated each epoch) on three deterministic workers, one
    SIGKILLed mid-epoch and a new one joining: the one-engine run's weights, logs and metrics."""
    changes = dict(per_device_train_batch_size=4, gradient_accumulation_steps=3, num_train_epochs=2, logging_steps=1)
    changes.update(eval_strategy="epoch")
    runs = []
    for engines, faults in ((1, []), (3, [Kill(worker=2, step=1), HoldForJoin(5)])):
        model, seen = bert(), SeenLogs()
        options = {"worker_logger_callback": FaultInjector(faults, tmp_path)} if faults else {}
        fabric = FabricTrainer(
            model=model,
            args=lm_args(tmp_path / f"c{engines}", **changes),
            train_dataset=cls_data(42),
            eval_dataset=cls_data(20),
            compute_metrics=accuracy,
            callbacks=[seen],
            engines_number=engines,
            deterministic=True,
            fabric_options=options,
        )
        fabric.train()
        runs.append((model, fabric.state.log_history[:-1], seen.steps, fabric.fabric_run_dir))
    (one, logs_one, seen_one, _), (three, logs_three, seen_three, run_dir) = runs
    assert weights_gap(one, three) == 0.0
    assert seen_three == seen_one == list(range(1, 9))  # every logged step once, the kill's replay too
    same_logs(logs_one, logs_three)  # (the losses logged are float sums: docs/deterministic.md)
    lines = (Path(run_dir) / "logs" / "metrics.jsonl").read_text().splitlines()
    members = [len(r["members"]) for r in map(json.loads, lines) if r["type"] == "generation"]
    assert members[0] == 3 and members[-1] == 3 and min(members) == 2  # the kill, then the join


def StopAt(event: str, step: int) -> Any:  # noqa: N802
    """A user's TrainerCallback that sets ``control.should_training_stop`` from ``step`` on, in
    ``on_evaluate`` (as EarlyStoppingCallback does) or ``on_step_end``."""

    class Stop(transformers.TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            control.should_training_stop |= event == "evaluate" and state.global_step >= step

        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop |= event == "step" and state.global_step >= step

    return Stop()


def stopped_run(trainer_class: Any, out: Path, event: str, step: int) -> tuple[torch.nn.Module, Any]:
    """A GPT-2 script of 4 epochs, evaluated at each epoch's end, that ``StopAt(event, step)`` stops."""
    model = gpt2()
    trainer = trainer_class(
        model=model,
        args=lm_args(out, num_train_epochs=4, eval_strategy="epoch", logging_steps=1),
        train_dataset=lm_data(),
        eval_dataset=lm_data(12),
        callbacks=[StopAt(event, step)],
    )
    trainer.train()
    return model, trainer.state


def test_a_callback_s_stop_ends_training_where_trainer_s_does(tmp_path):
    """A stop set at an epoch's evaluation ends training at that epoch's end, with Trainer's model
    and logs. One set at step 3 stops the workers within a few steps, at step U; Trainer stopped at
    U (its epoch then ended: on_epoch_end, its evaluation) gives the same model and logs."""
    runs = {event: stopped_run(FabricTrainer, tmp_path / f"f-{event}", event, 3) for event in ("evaluate", "step")}
    stopped = runs["step"][1].global_step
    assert runs["evaluate"][1].global_step == 6 and 3 <= stopped < 24
    for event, step in (("evaluate", 3), ("step", stopped)):
        reference, expected = stopped_run(transformers.Trainer, tmp_path / f"t-{event}", event, step)
        model, state = runs[event]
        assert state.global_step == expected.global_step == (6 if event == "evaluate" else stopped)
        assert weights_gap(model, reference) < 1e-5, event
        same_logs(expected.log_history, state.log_history)


def test_a_lora_model_trains_only_its_adapters_and_saves_them(tmp_path):
    peft = Lazily("peft")
    model = peft.get_peft_model(
        gpt2(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fabric = FabricTrainer(
        model=model, args=lm_args(tmp_path / "lora", max_steps=4), train_dataset=lm_data(), engines_number=2
    )
    fabric.train()
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed), sorted(changed)
    assert any("lora_B" in k for k in changed)  # B starts at zero: it moved
    fabric.save_model(str(tmp_path / "adapters"))
    saved = {p.name for p in (tmp_path / "adapters").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= saved and "model.safetensors" not in saved


def test_trainer_s_checkpoint_resumes_on_two_workers_to_trainer_s_model(tmp_path):
    epochs = dict(save_strategy="epoch")
    reference = gpt2()
    trainer = transformers.Trainer(model=reference, args=lm_args(tmp_path / "t", **epochs), train_dataset=lm_data())
    trainer.train()
    model = gpt2()
    fabric = FabricTrainer(
        model=model, args=lm_args(tmp_path / "f", **epochs), train_dataset=lm_data(), engines_number=2
    )
    out = fabric.train(resume_from_checkpoint=str(tmp_path / "t" / "checkpoint-6"))
    assert weights_gap(model, reference) < 1e-5
    assert out.global_step == 12
    # Trainer's history up to the folder's step, then the resumed run's, as Trainer's own resume shows it.
    same_logs(trainer.state.log_history[:-1], fabric.state.log_history[:-1])
    assert sorted(p.name for p in (tmp_path / "f").glob("checkpoint-*")) == ["checkpoint-12"]
