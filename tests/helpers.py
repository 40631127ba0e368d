"""Models, datasets and the reference loop shared by the tests."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psutil

import numpy as np
import psutil
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import default_collate

from fabric_model.launchers import warm_spare
from fabric_model.step.plan import Plan, epoch_permutation, micro_batch_seed


def make_data(n: int = 240, features: int = 12, classes: int = 3, seed: int = 0) -> list[tuple[torch.Tensor, int]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, classes, generator=g)
    y = (x @ w).argmax(1)
    return [(x[i].clone(), int(y[i])) for i in range(n)]  # clone: a view would pickle the whole storage


class MLP(nn.Module):
    """Dropout on, so the per-micro-batch seeding is exercised."""

    def __init__(self, features: int = 12, hidden: int = 32, classes: int = 3, p: float = 0.2) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.fc1(x))))


def accuracy(output, target):
    return (output.argmax(1) == target).float().mean()


def reference_train(
    model,
    optimizer,
    dataset,
    *,
    seed: int,
    epochs: int,
    batch_size: int,
    micro_batches: int,
    loss_fn=F.cross_entropy,
    autocast: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
    device: str = "cpu",
):
    """A plain single-process loop over the documented plan: same global batches, same order,
    the gradient of each global batch's mean loss, dropout seeded per micro-batch; the forward
    under ``autocast`` and the loss through ``scaler`` if given (the optimizer then unscales and steps);
    each batch moved to ``device`` (where the caller put the model)."""
    plan = Plan(len(dataset), batch_size, micro_batches, seed)
    model.train()
    for epoch in range(epochs):
        perm = epoch_permutation(seed, epoch, len(dataset))
        for step in range(plan.steps_per_epoch):
            optimizer.zero_grad()
            total = plan.step_samples(epoch, step)
            for j in range(plan.num_micro_batches(epoch, step)):
                idx = plan.micro_batch_indices(epoch, step, j, perm)
                x, y = (t.to(device) for t in default_collate([dataset[int(i)] for i in idx]))
                torch.manual_seed(micro_batch_seed(seed, epoch, step, j))  # the CUDA generators too
                with torch.autocast(torch.device(device).type, dtype=autocast, enabled=autocast is not None):
                    loss = loss_fn(model(x), y) * (len(idx) / total)
                (loss if scaler is None else scaler.scale(loss)).backward()
            optimizer.step()
    return model


def max_rel_diff(a: dict, b: dict) -> float:
    """max over tensors of max|a - b| / max|b|."""
    worst = 0.0
    for k in b:
        ref = b[k].float()
        scale = ref.abs().max().item() or 1.0
        worst = max(worst, (a[k].float() - ref).abs().max().item() / scale)
    return worst


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (Path(run_dir) / "logs" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == kind]


class IndexRecordingDataset:
    """A map-style dataset that appends every index it serves to ``<dir>/reads-<pid>.txt``."""

    def __init__(self, samples, directory: str) -> None:
        self.samples, self.directory = samples, directory

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        fd = os.open(os.path.join(self.directory, f"reads-{os.getpid()}.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            os.write(fd, f"{i}\n".encode())
        finally:
            os.close(fd)
        return self.samples[i]


def reads_by_pid(directory: Path) -> dict[int, list[int]]:
    out = {}
    for f in Path(directory).glob("reads-*.txt"):
        out[int(f.stem.split("-")[1])] = [int(x) for x in f.read_text().split()]
    return out


def sample_indices_of_steps(plan: Plan, train_records: list[dict]) -> dict[int, list[int]]:
    """Per epoch, the dataset indices of every micro-batch the committed steps report."""
    used: dict[int, list[int]] = {}
    for r in train_records:
        perm = epoch_permutation(plan.seed, r["epoch"], plan.num_samples)
        for mbs in r["micro_batches"].values():
            for j in mbs:
                used.setdefault(r["epoch"], []).extend(
                    int(i) for i in plan.micro_batch_indices(r["epoch"], r["step"], j, perm)
                )
    return used


def assert_each_sample_once_per_epoch(run_dir: Path, reads_dir: Path, plan: Plan, epochs: int) -> None:
    """Exactly once, two ways: by the committed steps' reports (``plan`` maps them to indices) and by
    what the worker processes actually read (an :class:`IndexRecordingDataset` writing to ``reads_dir``)."""
    used = sample_indices_of_steps(plan, records(run_dir, "train"))
    reads = sorted(i for pid, got in reads_by_pid(reads_dir).items() if pid != os.getpid() for i in got)
    for epoch in range(epochs):
        assert sorted(used[epoch]) == list(range(plan.num_samples))
    assert reads == sorted(list(range(plan.num_samples)) * epochs)


def final_train_records(run_dir) -> list[dict]:
    """The committed record of every step: a step redone after a rollback supersedes the first one."""
    final: dict[tuple[int, int], dict] = {}
    for r in records(run_dir, "train"):
        final[(r["epoch"], r["step"])] = r
    return [final[k] for k in sorted(final)]


def fresh_model_and_optimizer(seed: int = 0, lr: float = 0.1, momentum: float = 0.9, adam: bool = False):
    torch.manual_seed(seed)
    model = MLP()
    opt = (
        torch.optim.Adam(model.parameters(), lr=1e-2)
        if adam
        else torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    )
    return model, opt


__all__ = ["np"]


def need(module: str) -> Any:
    """The optional package ``module``, or a skip without it, except where the test environment
    promises them all (tox sets FABRIC_MODEL_TEST_ALL_EXTRAS): there a missing package fails."""
    if os.environ.get("FABRIC_MODEL_TEST_ALL_EXTRAS"):
        return importlib.import_module(module)
    return pytest.importorskip(module)


#: The packages that load TensorFlow: imported under quiet_tensorflow(), as the tests' scripts do.
_TENSORFLOW = ("tensorflow", "keras", "tf_keras")


class Lazily:
    """The optional package ``module``, imported (or the test skipped, as by :func:`need`) at its
    first use in a test, not when the test module is collected: a module of the processes tier
    then costs the fast tier nothing (transformers and peft take about 2 s to import; TensorFlow
    and Keras about 8 s, in every test process that collects a module importing them at its top).

    ``module`` may be relative to ``package`` (``Lazily(".keras_parts", __package__)``): a module
    of the tests holding what a test module cannot define without TensorFlow (a loss object, a
    class deriving from ``keras.Model``). It pickles as its name: a worker imports the module."""

    def __init__(self, module: str, package: str | None = None) -> None:
        self._module, self._package = module, package

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "pytestmark":  # what collection asks of every module attribute
            raise AttributeError(name)
        return getattr(self._load(), name)

    def _load(self) -> Any:
        name = importlib.util.resolve_name(self._module, self._package)
        if name in sys.modules:
            return sys.modules[name]
        if name.partition(".")[0] not in _TENSORFLOW:
            return need(name)
        from fabric_model import quiet_tensorflow

        with quiet_tensorflow():
            return need(name)

    def __reduce__(self) -> tuple[type, tuple[str, str | None]]:
        return Lazily, (self._module, self._package)


def interruptible() -> None:
    """``preexec_fn`` of a process a test sends SIGINT: the disposition a terminal's shell gives it
    (default, unblocked), whatever this test process inherited or set; Python then turns it into
    KeyboardInterrupt, as for a user's script."""
    import signal

    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


_KILLED_JOB = textwrap.dedent("""
    import glob, os, signal, sys, time
    sys.path.insert(0, {repo!r})
    from {module} import train

    class KillJob:
        def log_train_metrics(self, metrics, iteration, epoch, workers):
            if iteration == {kill_at}:  # the driver; its workers die with it
                # Once a checkpoint is on disk: its writer (a thread) can lag the steps on a loaded host.
                deadline = time.monotonic() + 60
                while not glob.glob(os.path.join({checkpoints!r}, "ckpt-*.pt")) and time.monotonic() < deadline:
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)

    train({arguments}, driver_logger=KillJob())
""")


def run_killed_job(
    directory: Path, module: str, arguments: str, kill_at: int, run_dir: Path, timeout: float = 240
) -> None:
    """Run ``train(<arguments>)`` of test module ``module`` as a script whose driver SIGKILLs itself
    after iteration ``kill_at``, once a checkpoint is in ``run_dir``, as a whole job dies (its
    workers die with it); wait for it."""
    script = Path(directory) / "job.py"
    repo = str(Path(__file__).resolve().parents[1])
    checkpoints = str(Path(run_dir) / "checkpoints")
    script.write_text(
        _KILLED_JOB.format(repo=repo, module=module, arguments=arguments, kill_at=kill_at, checkpoints=checkpoints)
    )
    proc = subprocess.Popen([sys.executable, str(script)], start_new_session=True)
    try:
        assert proc.wait(timeout=timeout) == -signal.SIGKILL
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


class KilledAt:
    """A driver logger that SIGKILLs its own process (the driver) once step ``at`` is committed."""

    def __init__(self, at: int) -> None:
        self.at = at

    def log_train_metrics(self, metrics, iteration, epoch, workers) -> None:
        if iteration == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def run_script_and_its_tree(script: str, within: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``python -c script`` to its end (killed after ``within`` seconds), then every process it
    started (a warm process, workers) waited for, killed if still there after 10 s, and asserted
    gone: ``(return code, output)``."""
    import psutil

    code, out, seen = run_script(script, within, env)
    _, alive = psutil.wait_procs(seen, timeout=10)
    for p in alive:
        p.kill()
    assert not alive, f"processes of the script still running: {[p.pid for p in alive]}"
    return code, out


def run_script(script: str, within: float, env: dict[str, str] | None = None) -> tuple[int, str, list[psutil.Process]]:
    """``python -c script`` to its end (killed after ``within`` seconds): ``(return code, output,
    every process it started)``, those left to the caller to wait for."""
    import time

    import psutil

    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + within
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            seen.update((c.pid, c) for c in psutil.Process(proc.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    out = proc.communicate(timeout=10)[0].decode(errors="replace")
    return proc.returncode, out, list(seen.values())


def started_processes() -> list[psutil.Process]:
    """This process's descendants but the warm process kept for its next job (launchers/warm_spare.py),
    which waits without a worker: what a check that fails before any worker starts must not leave."""
    kept = warm_spare.kept_pid()
    return [p for p in psutil.Process().children(recursive=True) if p.pid != kept]
