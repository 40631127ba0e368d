"""What a person sees: progress on a terminal and in a pipe, the start-up lines, Ctrl-C, TensorBoard
and CSV files, ``fabric-model status`` and ``plot`` (docs/architecture.md, "Display")."""

from __future__ import annotations

import csv
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import psutil
import pytest

from fabric_model.run.metrics_log import read_records
from fabric_model.run.status import summarize
from fabric_model.testing import HoldForJoin, Kill
from tests.conftest import wait_gone
from tests.helpers import interruptible

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
JOB = [PY, "-m", "tests.display_job"]
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def scalars(directory: Path) -> Any:
    """TensorBoard's own reader of a log directory, loaded. TensorBoard is told TensorFlow is absent
    (its ``notf`` marker module): the reader needs none, and importing it would change os.environ."""
    sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return events


def job_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@pytest.fixture(scope="module")
def piped_run(tmp_path_factory):
    """One 2-epoch run with its stderr a pipe: (run_dir, what it printed)."""
    run_dir = tmp_path_factory.mktemp("piped") / "run"
    out = subprocess.run(
        [*JOB, str(run_dir), "2", "0.02"], capture_output=True, text=True, timeout=240, cwd=ROOT, env=job_env()
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir, out.stderr


@pytest.mark.processes
def test_a_pipe_gets_plain_lines_start_up_lines_first(piped_run):
    run_dir, text = piped_run
    assert "\r" not in text and "\x1b" not in text  # no redraws in a pipe or a log file
    lines = text.splitlines()
    first_progress = next(i for i, line in enumerate(lines) if line.startswith("epoch "))
    start_up = "\n".join(lines[:first_progress])
    assert f"run directory: {run_dir}" in start_up
    assert "starting 2 workers on cpu: 2 epochs of 6 steps, global batch 32" in start_up
    assert f"tensorboard --logdir {run_dir / 'tensorboard'}" in start_up  # a run outside the working directory
    assert re.search(r"^2 workers training \(started in \d+\.\d s\)$", start_up, re.M), start_up
    progress = [line for line in lines if re.match(r"epoch \d/2 step \d+/6 ", line)]  # steps of the epoch
    assert progress and all(re.search(r"workers=2 .* eta (\?|\d\d:\d\d)", line) for line in progress)
    for epoch in (1, 2):  # one line per epoch, its validation on it
        (line,) = [line for line in lines if line.startswith(f"epoch {epoch}/2:")]
        assert re.match(rf"epoch {epoch}/2: loss=\d\.\d{{4}} accuracy=\d\.\d{{4}} val_loss=\d\.\d{{4}} ", line), line
    assert "generation" not in text and "checkpoint" not in text  # said in logs/driver.log
    assert "warm process" not in text  # how the start-up went: run.json and driver.log
    assert "local workers fork from the warm process: " in (run_dir / "logs" / "driver.log").read_text()
    assert "checkpoint ckpt-unit-" in (run_dir / "logs" / "driver.log").read_text()
    assert "run directory" in (run_dir / "logs" / "driver.log").read_text()  # the full log on disk


@pytest.mark.processes
def test_tensorboard_files_hold_the_scalars_and_the_csv_parses(piped_run):
    run_dir, _ = piped_run
    events = scalars(run_dir / "tensorboard")
    tags = set(events.Tags()["scalars"])
    expected = {"train/loss", "train/accuracy", "epoch/loss", "epoch/accuracy", "val/loss", "val/accuracy"}
    assert expected | {"workers", "generation", "samples_per_s"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 13))  # per step, by iteration
    assert [e.step for e in events.Scalars("epoch/loss")] == [1, 2]  # per epoch, by epoch
    assert all(e.value == 2 for e in events.Scalars("workers"))
    steps = {
        r["iteration"]: r["metrics"]["loss"]
        for r in read_records(run_dir / "logs" / "metrics.jsonl")
        if r["type"] == "train"
    }
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([steps[i] for i in range(1, 13)])
    with open(run_dir / "logs" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [1, 2]
    assert {"loss", "accuracy", "val_loss", "val_accuracy", "samples_per_s", "workers"} <= set(rows[0])
    assert all(float(r["val_loss"]) > 0 for r in rows) and float(rows[1]["samples_per_s"]) > 0


@pytest.mark.processes
def test_status_prints_the_table(piped_run):
    run_dir, _ = piped_run
    out = subprocess.run(
        [PY, "-m", "fabric_model", "status", str(run_dir)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    table = dict(line.split(None, 1) for line in out.stdout.split("\n\n")[0].splitlines())
    assert table["state"] == "finished"
    assert table["progress"] == "epoch 2/2, step 6/6 (iteration 12/12, 100%)"
    assert table["workers"].startswith("2 (generation 0; 0 fault(s), 0 join(s))")
    assert table["checkpoint"] == "ckpt-unit-00000013.pt" and table["validation"].startswith("epoch 2: val_loss=")


def read_pty(master: int, proc: subprocess.Popen, timeout: float) -> str:
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the terminal's other side closed
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    return b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.processes
def test_ctrl_c_says_how_to_resume_and_leaves_no_process(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [*JOB, str(run_dir), "30", "0.2"],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=job_env(),
        start_new_session=True,  # its own process group: the Ctrl-C of a terminal goes to all of it
        preexec_fn=interruptible,  # SIGINT as a terminal leaves it, not as this process may have it
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while not any(line.startswith("epoch 1/30 step") for line in lines) and time.monotonic() < deadline:
            assert proc.poll() is None, "".join(lines)
            time.sleep(0.1)
        children = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        assert len(children) >= 2  # the workers are running
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its own process group: the job, whatever it started
            proc.wait(timeout=10)
        reader.join(10)
    text = "".join(lines)
    assert code == 130, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    assert f"Resume it with train(..., run_dir='{run_dir}', resume=True)" in text
    assert wait_gone(children, 10) == []


@pytest.mark.processes
def test_plot_draws_the_worker_count_of_a_run_with_a_kill_and_a_join(tmp_path, monkeypatch, capfd):
    from tests.test_elastic import train as elastic_train

    monkeypatch.setenv("EDT_REPLACE_WORKERS", "0")
    run_dir = tmp_path / "run"
    elastic_train(run_dir, tmp_path, [Kill(1, 2), HoldForJoin(4)], joins=[4], workers=2)
    screen = capfd.readouterr().err
    # One short line per generation change; the error's internals only in logs/driver.log.
    assert re.search(r"^now 1 worker \(worker \d[^()\[\]]*\)$", screen, re.M), screen
    assert re.search(r"^now 2 workers \(worker \d+ joins\)$", screen, re.M), screen
    assert "pair.cc" not in screen and "generation 1 ending" in (run_dir / "logs" / "driver.log").read_text()
    records = [r for r in read_records(run_dir / "logs" / "metrics.jsonl") if r["type"] == "generation"]
    assert [r["workers"] for r in records] == [2, 1, 2]
    gens = summarize(run_dir).generations
    assert [(g.workers, g.kind) for g in gens] == [(2, "start"), (1, "fault"), (2, "join")]
    assert [g.time for g in gens] == sorted(g.time for g in gens)
    png = tmp_path / "plot.png"
    out = subprocess.run(
        [PY, "-m", "fabric_model", "plot", str(run_dir), "-o", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=job_env(),
    )
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    events = scalars(run_dir / "tensorboard")
    series = [int(e.value) for e in events.Scalars("workers")]
    changes = [n for i, n in enumerate(series) if i == 0 or series[i - 1] != n]
    assert changes == [2, 1, 2]  # TensorBoard's worker count follows the generations
    assert [int(e.value) for e in events.Scalars("generation")] == [0, 1, 2]


@pytest.mark.processes
def test_verbose_and_tensorboard_are_checked_in_the_caller(tmp_path):
    import torch
    import torch.nn.functional as F

    from fabric_model import FabricModel
    from tests.display_job import datasets
    from tests.helpers import MLP

    model = MLP()
    fm = FabricModel(model, datasets, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"`verbose` to be 0 \(quiet\), 1 \(progress\) or 2.*Received: 3"):
        fm.train(1, 16, run_dir=tmp_path / "run", verbose=3)
    with pytest.raises(TypeError, match="tensorboard"):
        fm.train(1, 16, run_dir=tmp_path / "run", tensorboard="yes")
    assert not (tmp_path / "run").exists()  # nothing started


def test_the_event_file_framing_uses_crc32c():
    from fabric_model.run.tb_events import crc32c

    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(b"") == 0
    assert crc32c(b"56789", crc32c(b"1234")) == 0xE3069283  # continued from the bytes before


def test_a_resumed_run_s_csv_has_each_epoch_once(tmp_path):
    """Epochs 1-3 written, then the run resumes from the checkpoint after epoch 1: epoch 2's row
    is replaced by the redone epoch's, epoch 3's goes (it will be trained again), the header stays."""
    from fabric_model.run.recorder import RunRecorder

    def run(epochs: range, loss: float) -> None:
        recorder = RunRecorder(tmp_path / "tb", tmp_path / "metrics.csv", ["loss"], 8, 2)
        for epoch in epochs:
            recorder.record_step({"loss": loss}, 2 * epoch + 1, epoch, 2)
            recorder.log_train_metrics({"loss": loss}, 2 * epoch + 2, epoch, 2)
            recorder.log_test_metrics({"loss": loss}, 2 * epoch + 2, epoch)
        recorder.close()

    run(range(3), 1.0)
    run(range(1, 2), 0.5)
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["epoch"], float(r["loss"]), float(r["val_loss"])) for r in rows] == [("1", 1.0, 1.0), ("2", 0.5, 0.5)]


def test_a_script_that_imported_ipython_is_not_an_interactive_session(monkeypatch):
    """``import keras`` imports IPython: Ctrl-C and preemption must still end such a script with
    an exit status (130, 143) and no traceback; only a shell of IPython's is interactive."""
    from fabric_model.driver import display

    ipython = types.ModuleType("IPython")
    ipython.get_ipython = lambda: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.delattr(sys, "ps1", raising=False)
    assert not display._interactive()
    ipython.get_ipython = lambda: object()  # type: ignore[attr-defined]
    assert display._interactive()
