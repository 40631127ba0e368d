"""The real-model corpus (tests/models) at speed: FabricModel on 1 engine against the plain loop its user writes.

For each corpus model, one run of each, on the same data, batch and optimizer:

  plain   a ``torch.utils.data.DataLoader`` (shuffled, the corpus' collate), torch's default
          intra-op threads (every core), and per step
          ``zero_grad``, the loss as the user computes it by hand, ``backward``, ``step`` and
          ``loss.item()`` (what a loop that logs its loss does; FabricModel reads it every step);
  fabric  ``FabricModel(model, ..., metrics=[]).train(epochs, batch, 1)`` with its defaults
          (run directory, metrics log, TensorBoard), no progress display and no checkpoints
          (the plain loop saves none).

``trainer``: a Hugging Face ``Trainer`` script (the corpus' GPT-2) under ``transformers.Trainer``
(plain) and ``fabric_model.transformers.FabricTrainer`` on 1 engine (fabric), both on one
process' steps: Trainer's stamped by a ``TrainerCallback`` at each step's end.

Besides the corpus: ``lora_frozen``, LoRA's shape at size (a 256 MB frozen embedding under a
small trainable head, AdamW on the head: a snapshot that carried the frozen part cost 0.2 s a
step), and ``sub_ms``, a step of a fraction of a millisecond, where the framework's fixed cost
shows (benchmarks/bench_null_step.py measures it alone).

Start-up is excluded on both sides: the first ``--warmup`` steps are not timed. FabricModel's
step times are the driver's commit stamps in ``logs/metrics.jsonl``; the plain loop stamps the
end of its steps. A lone worker's reports reach the driver together every ~0.1 s of fast steps
(worker/inbox.py), so a step's own stamp is no measure: the figure is the throughput over the
whole timed span, from the end of a frame of reports (benchmarks/commits.py), which the number
of steps makes at least ``--seconds`` long (calibrated on the plain loop). Rounds interleave the two runs of a model;
the table gives the median ratio over rounds with its range. Target (issue 45): every row
>= 0.95; gpt2, bert, lora and lora_frozen >= 1.0. Snapshots and replica checks run at their
defaults; checkpoints do not (the plain loop saves none).

    PYTHONPATH=. python3 benchmarks/bench_models.py                  # every model, 3 rounds
    PYTHONPATH=. python3 benchmarks/bench_models.py --models gpt2,lora --rounds 5
    PYTHONPATH=. python3 benchmarks/bench_models.py --models trainer
    PYTHONPATH=. python3 benchmarks/bench_models.py --small-step-flops 4e6,0    # the small-step rule on and off
    PYTHONPATH=. python3 benchmarks/bench_models.py --setting FABRIC_MODEL_SNAPSHOT_STEPS=100,0   # snapshots' cost
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import commits
import torch
from torch.utils.data import DataLoader, default_collate


@dataclass
class Workload:
    build: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]]
    data: Callable[[int], list[Any]]  # samples
    loss_function: Callable[[Any, Any], Any] | None  # FabricModel's
    hand_loss: Callable[[torch.nn.Module, Any], torch.Tensor]  # the plain loop's
    collate: Callable[[list[Any]], Any] | None = None


class FrozenBase(torch.nn.Module):
    """LoRA's shape at size: a frozen 500,000 x 128 embedding (256 MB) under a small trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Embedding(500_000, 128)
        self.base.weight.requires_grad_(False)
        self.head = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.base(tokens).mean(1))


def frozen_base() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = FrozenBase()
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def token_samples(n: int) -> Any:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 500_000, (n, 16), generator=g)
    return torch.utils.data.TensorDataset(tokens, torch.randint(0, 10, (n,), generator=g))


def small_mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def mlp_samples(n: int) -> Any:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :10] * 3).argmax(1))


def by_output(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


def workloads() -> dict[str, Workload]:
    """The corpus' models and data (tests/models), sized for seconds of steps, and two of our own."""
    from tests.models import test_torch_patterns as patterns
    from tests.models import test_transformers as hf

    def compiled_tied_lm() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model, optimizer = patterns.tied_lm()
        return torch.compile(model), optimizer  # type: ignore[return-value]

    def by_keyword(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return model(**batch).loss

    return {
        "gpt2": Workload(hf.gpt2, lambda n: hf.counting_sequences(n, 32), None, by_keyword),
        "bert": Workload(hf.bert, lambda n: hf.classified_sequences(n, 32), hf.logits_loss, by_keyword),
        "lora": Workload(hf.lora_gpt2, lambda n: hf.counting_sequences(n, 32), None, by_keyword),
        "tied_lm": Workload(
            patterns.tied_lm, patterns.next_token_data, patterns.lm_loss, lambda m, b: patterns.lm_loss(m(b[0]), b[1])
        ),
        "packed_gru": Workload(
            patterns.tagger,
            patterns.variable_length_data,
            patterns.tuple_loss,
            lambda m, b: patterns.tuple_loss(m(b["tokens"], b["lengths"]), b["label"]),
            patterns.collate,
        ),
        "compiled": Workload(
            compiled_tied_lm, patterns.next_token_data, patterns.lm_loss, lambda m, b: patterns.lm_loss(m(b[0]), b[1])
        ),
        "lora_frozen": Workload(frozen_base, token_samples, torch.nn.functional.cross_entropy, by_output),
        "sub_ms": Workload(small_mlp, mlp_samples, torch.nn.functional.cross_entropy, by_output),
    }


def span_rate(times: list[float], warmup: int, batch: int) -> float:
    """Samples/s over the steps after the first ``warmup``: the timed steps' samples over their span."""
    timed = times[warmup - 1 :]
    return (len(timed) - 1) * batch / (timed[-1] - timed[0])


def run_plain(work: Workload, samples: int, batch: int, steps: int, warmup: int) -> float:
    torch.set_num_threads(os.cpu_count() or 1)  # torch's default, as the user's script has it
    torch.manual_seed(0)
    model, optimizer = work.build()
    data = work.data(samples)
    loader = DataLoader(data, batch_size=batch, shuffle=True, collate_fn=work.collate or default_collate)
    model.train()
    times: list[float] = []
    while len(times) < steps + warmup:
        for b in loader:
            optimizer.zero_grad()
            loss = work.hand_loss(model, b)
            loss.backward()
            optimizer.step()
            loss.item()
            times.append(time.perf_counter())
            if len(times) == steps + warmup:
                break
    return span_rate(times, warmup, batch)


class IntraOpThreads:
    """A worker callback that sets the lone worker's intra-op threads as it starts training (a
    ``--worker-threads`` variant; ``train()`` chooses them otherwise)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def on_train_begin(self) -> None:
        torch.set_num_threads(self.threads)


class Quiet:
    """A driver logger that prints nothing (in place of the progress display)."""

    def on_train_begin(self) -> None:
        pass


def run_fabric(
    work: Workload,
    samples: int,
    batch: int,
    steps: int,
    warmup: int,
    run_dir: Path,
    threads: int | None = None,
    worker_threads: int | None = None,
) -> float:
    """FabricModel on 1 engine; ``threads``: ``num_dataloader_threads``, ``worker_threads``: the
    worker's intra-op threads (None: train()'s choice)."""
    from fabric_model import FabricModel

    torch.manual_seed(0)
    model, optimizer = work.build()
    data = work.data(samples)
    fm = FabricModel(
        model,
        lambda: (data, None),
        work.loss_function,
        optimizer,
        metrics=[],
        driver_logger_callback=Quiet(),
        fn_batch_collate=work.collate,
        worker_logger_callback=None if worker_threads is None else IntraOpThreads(worker_threads),
    )
    epochs = -(-(steps + warmup) * batch // samples)
    result = fm.train(epochs, batch, 1, threads, run_dir=run_dir, seed=0, verbose=0, checkpoint_freq=0)
    return batch / commits.mean_step(commits.train_stamps(result.run_dir), warmup - 1)


def trainer_args(out: Path, batch: int, steps: int) -> Any:
    import transformers

    return transformers.TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=batch,
        max_steps=steps,
        learning_rate=3e-3,
        logging_steps=10_000,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )


def run_trainer(samples: int, batch: int, steps: int, warmup: int, run_dir: Path) -> float:
    """``transformers.Trainer`` on the corpus' GPT-2: samples/s over its steps after ``warmup``."""
    import transformers

    from tests.models import test_transformers as hf

    torch.set_num_threads(os.cpu_count() or 1)
    times: list[float] = []

    class Stamp(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            times.append(time.perf_counter())

    model, _ = hf.gpt2()
    args = trainer_args(run_dir, batch, steps + warmup)
    data = hf.counting_sequences(samples, 32)
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[Stamp()]).train()
    return span_rate(times, warmup, batch)


def run_fabric_trainer(samples: int, batch: int, steps: int, warmup: int, run_dir: Path) -> float:
    """``FabricTrainer`` on 1 engine, the same script: samples/s from the driver's commit stamps."""
    from fabric_model.transformers import FabricTrainer
    from tests.models import test_transformers as hf

    model, _ = hf.gpt2()
    args = trainer_args(run_dir, batch, steps + warmup)
    data = hf.counting_sequences(samples, 32)
    trainer = FabricTrainer(model=model, args=args, train_dataset=data, engines_number=1, fabric_options={"verbose": 0})
    trainer.train()
    return batch / commits.mean_step(commits.train_stamps(Path(str(trainer.fabric_run_dir))), warmup - 1)


#: A FabricModel run's variant: (its label, num_dataloader_threads, the worker's intra-op threads,
#: a setting's environment variable and value); None: train()'s own.
Variant = tuple[str, int | None, int | None, tuple[str, str] | None]


@contextlib.contextmanager
def setting(variable: tuple[str, str] | None) -> Iterator[None]:
    """A setting's environment variable set to a value while a run starts (None: as it is)."""
    if variable is None:
        yield
        return
    name, value = variable
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", default="", help="comma-separated names (default: all)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=150, help="timed steps per run, at least")
    parser.add_argument("--seconds", type=float, default=4.0, help="the plain loop's timed span, at least")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps at the start of each run")
    variant_of = parser.add_mutually_exclusive_group()  # one thing varied at a time
    variant_of.add_argument(
        "--reader-threads",
        default="",
        help="comma-separated num_dataloader_threads values, each a FabricModel run a round, in alternating "
        "order (default: train()'s own)",
    )
    variant_of.add_argument(
        "--small-step-flops",
        default="",
        help="comma-separated FABRIC_MODEL_SMALL_STEP_FLOPS values, each a FabricModel run a round, in alternating "
        "order (0: the rule off, every worker its share of the cores)",
    )
    variant_of.add_argument(
        "--setting",
        default="",
        help="NAME=v1,v2,...: a setting's values (docs/configuration.md), each a FabricModel run a round, in "
        "alternating order, e.g. FABRIC_MODEL_SNAPSHOT_STEPS=100,0 (snapshots as by default, and none)",
    )
    variant_of.add_argument(
        "--worker-threads",
        default="",
        help="comma-separated intra-op thread counts of the lone worker, each a FabricModel run a round, in "
        "alternating order (0: train()'s own)",
    )
    args = parser.parse_args(argv)
    # Each variant: (its label, num_dataloader_threads, the worker's intra-op threads, a setting's
    # variable and value); None: train()'s own.
    variants: list[Variant] = [("", None, None, None)]
    if args.reader_threads:
        variants = [(f"t={v}", int(v), None, None) for v in args.reader_threads.split(",")]
    elif args.worker_threads:
        variants = [(f"w={v}", None, int(v) or None, None) for v in args.worker_threads.split(",")]
    elif args.small_step_flops:
        variants = [
            (f"s={v}", None, None, ("FABRIC_MODEL_SMALL_STEP_FLOPS", v)) for v in args.small_step_flops.split(",")
        ]
    elif args.setting:
        name, _, values = args.setting.partition("=")
        variants = [(v, None, None, (name, v)) for v in values.split(",")]
    logging.getLogger("fabric_model").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    chosen: dict[str, Any] = {**workloads(), "trainer": None}
    if args.models:
        chosen = {k: v for k, v in chosen.items() if k in args.models.split(",")}
    samples = args.batch_size * 200  # 200 steps an epoch, no short step
    load = os.getloadavg()[0]
    print(
        f"torch {torch.__version__}, {os.cpu_count()} cores, load {load:.2f}, batch {args.batch_size}, "
        f"{args.steps} timed steps after {args.warmup}, {args.rounds} round(s)"
    )
    print(f"{'model':<12} {'steps':>6} {'plain samples/s':>16} {'fabric samples/s':>17} {'ratio':>7}  range")
    scratch = Path(tempfile.mkdtemp(prefix="bench-models-"))
    try:
        for name, work in chosen.items():
            plains: list[float] = []
            # FabricTrainer takes neither variant: it runs once a round, with train()'s own choices.
            runs = variants if work is not None else [("", None, None, None)]
            fabrics: dict[str, list[float]] = {label: [] for label, *_ in runs}

            def plain_run(n: int, r: int, name: str = name, work: Any = work) -> float:
                if work is None:  # Trainer's script under Trainer
                    return run_trainer(samples, args.batch_size, n, args.warmup, scratch / f"{name}-plain{r}")
                return run_plain(work, samples, args.batch_size, n, args.warmup)

            def fabric_run(n: int, r: int, variant: Variant, name: str = name, work: Any = work) -> float:
                label, threads, worker_threads, variable = variant
                out = scratch / f"{name}{r}-{label}"
                if work is None:  # the same under FabricTrainer
                    return run_fabric_trainer(samples, args.batch_size, n, args.warmup, out)
                with setting(variable):
                    return run_fabric(work, samples, args.batch_size, n, args.warmup, out, threads, worker_threads)

            trial = plain_run(30, -1)  # steps of seconds, at least
            steps = max(args.steps, int(args.seconds * trial / args.batch_size))
            for r in range(args.rounds):
                plains.append(plain_run(steps, r))
                for variant in runs if r % 2 == 0 else runs[::-1]:  # neither always runs first
                    fabrics[variant[0]].append(fabric_run(steps, r, variant))
            for variant_label, rates in fabrics.items():
                ratios = [f / p for f, p in zip(rates, plains)]
                label = f"{name} {variant_label}".strip()
                print(
                    f"{label:<12} {steps:>6} {statistics.median(plains):>16,.0f} {statistics.median(rates):>17,.0f} "
                    f"{statistics.median(ratios):>7.2f}  [{min(ratios):.2f}-{max(ratios):.2f}]",
                    flush=True,
                )
            if len(runs) == 2:  # paired within each round: which ran faster, how often
                a, b = (label for label, *_ in runs)
                wins = sum(x > y for x, y in zip(fabrics[a], fabrics[b]))
                print(f"{'':<12} {a} faster than {b} in {wins} of {args.rounds} rounds", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
