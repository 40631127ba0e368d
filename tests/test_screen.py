"""The screen at a given width: fields dropped whole in their stated order, one line per epoch in
order with its validation and checkpoint mark, nothing drawn after Ctrl-C; in-process with a
fake terminal, then a real run in an 80x24 pseudo-terminal and in a pipe
(docs/training.md, "The screen")."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import signal
import struct
import subprocess
import termios
import time
from pathlib import Path

import pytest

from fabric_model.run import progress_bar as pb
from fabric_model.run import screen
from fabric_model.run.progress_bar import BAR_FIELDS, EPOCH_FIELDS, ProgressBar
from fabric_model.run.screen import Bar, Field, fit
from tests.helpers import interruptible
from tests.test_display import JOB, job_env, read_pty

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class Terminal(io.StringIO):
    """A stream that says it is a terminal (its width comes from ``COLUMNS``)."""

    encoding = "utf-8"

    def isatty(self) -> bool:
        return True


# -- fitting ------------------------------------------------------------------------------------
def test_fields_are_dropped_whole_lowest_priority_first():
    fields = [Field("epoch 3/20", 0), Field("loss=0.2398", 1), Field("accuracy=0.9255", 3), Field("1,234 samples/s", 2)]
    assert fit(fields, 80) == "epoch 3/20 loss=0.2398 accuracy=0.9255 1,234 samples/s"
    assert fit(fields, 45) == "epoch 3/20 loss=0.2398 1,234 samples/s"  # accuracy (3) went first
    assert fit(fields, 30) == "epoch 3/20 loss=0.2398"
    assert fit(fields, 12) == "epoch 3/20"
    assert fit(fields, 8) == "epoch 3…"  # only the essential field left: cut, never wrapped


def test_the_bar_takes_the_room_left_within_its_bounds():
    line = fit([Field("epoch 1/2", 0), Bar(0.5, 2, low=8, high=30), Field("3/6", 1)], 40)
    assert len(line) <= 40 and line.startswith("epoch 1/2 |") and line.endswith("| 3/6")
    bar = line[len("epoch 1/2 ") : -len(" 3/6")]
    assert len(bar) == 40 - len("epoch 1/2 3/6") - 1 and bar.count("█") == (len(bar) - 2) // 2
    wide = fit([Field("epoch 1/2", 0), Bar(0.5, 2, low=8, high=30), Field("3/6", 1)], 200)
    assert len(wide) == len("epoch 1/2 3/6") + 1 + 30  # no wider than its bound
    assert "|" not in fit([Field("epoch 1/2", 0), Bar(0.5, 2, low=8, high=30), Field("3/6", 1)], 18)


# -- the progress display on a fake terminal -----------------------------------------------
@pytest.fixture
def columns(monkeypatch):
    def set_width(width: int) -> None:
        monkeypatch.setenv("COLUMNS", str(width))

    set_width(80)
    return set_width


def shown_lines(stream: io.StringIO) -> list[str]:
    """The lines printed (not the status line's redraws)."""
    text = ANSI.sub("", stream.getvalue())
    return [part.split("\r")[-1] for part in text.split("\n")[:-1]]


def status_lines(stream: io.StringIO) -> list[str]:
    return [s for s in ANSI.sub("", stream.getvalue().replace("\x1b[K", "")).replace("\n", "\r").split("\r") if s]


METRICS = {"loss": 0.5, "accuracy": 0.75, "top5_accuracy": 0.875}


def test_the_bar_counts_this_epochs_steps_and_drops_fields_in_the_stated_order(columns, monkeypatch):
    """At every width the fields shown are the first ones of BAR_FIELDS: the least important go first."""
    monkeypatch.setattr(pb, "BAR_TEXT_INTERVAL", 0.0)
    shown = []
    for width in (140, 100, 80, 60, 50, 40, 30):
        columns(width)
        stream = Terminal()
        bar = ProgressBar(20, 2876, 64, stream=stream, validates=lambda e: False)
        bar.log_train_metrics(METRICS, 3 * 2876 + 100, 3, workers=2)
        bar.log_train_metrics(METRICS, 3 * 2876 + 120, 3, workers=2)
        status = status_lines(stream)[-1]
        assert len(status) <= width - 1, status
        assert status.startswith("epoch 4/20 ") and " 120/2876 " in f"{status} "  # this epoch's steps
        assert "…" not in status  # fields dropped whole, nothing cut
        present = {
            "epoch": "epoch 4/20" in status,
            "steps of the epoch": "120/2876" in status,
            "loss": "loss=0.5000" in status,
            "eta": "eta " in status,
            "metrics": "accuracy=0.7500" in status and "top5_accuracy=0.8750" in status,
            "workers": "workers=2" in status,
            "bar": "|" in status,
            "samples/s": "samples/s" in status,
        }
        kept = [present[name] for name in BAR_FIELDS]
        assert kept == sorted(kept, reverse=True), (width, status)  # a prefix of the stated order
        shown.append(sum(kept))
    assert shown[0] == len(BAR_FIELDS) and shown == sorted(shown, reverse=True) and shown[-1] >= 2


def test_one_line_per_epoch_in_order_with_validation_and_checkpoint_mark(columns, monkeypatch):
    """Validations come after their epoch's last step (the ledger holds one that overtakes it),
    checkpoints before or after; each epoch's line waits for them, the lines in epoch order."""
    stream = Terminal()
    bar = ProgressBar(4, 3, 8, stream=stream, validates=lambda e: e != 2, saves=lambda e: True)
    val = {"loss": 0.25, "accuracy": 0.5}
    for step in range(1, 4):
        bar.log_train_metrics(val, step, 0, 2)
    bar.on_checkpoint(0, "ckpt-unit-00000003.pt")
    assert shown_lines(stream) == []  # epoch 1 waits for its validation
    bar.log_test_metrics(val, 3, 0)
    bar.on_checkpoint(1, "ckpt-unit-00000007.pt")  # epoch 2's checkpoint before its last step
    for step in range(4, 7):
        bar.log_train_metrics(val, step, 1, 2)
    bar.log_test_metrics(val, 6, 1)
    for step in range(7, 10):  # epoch 3: no validation; its checkpoint comes after epoch 4's end
        bar.log_train_metrics(val, step, 2, 2)
    for step in range(10, 13):
        bar.log_train_metrics(val, step, 3, 2)
    bar.on_checkpoint(2, "ckpt-unit-00000011.pt")
    bar.log_test_metrics(val, 12, 3)
    bar.on_checkpoint(3, "ckpt-unit-00000015.pt")
    bar.close()
    lines = [line for line in shown_lines(stream) if line.startswith("epoch")]
    assert [line.split(":")[0] for line in lines] == ["epoch 1/4", "epoch 2/4", "epoch 3/4", "epoch 4/4"]
    assert all(line.endswith(" ✓") for line in lines), lines
    assert ["val_loss=0.2500" in line for line in lines] == [True, True, False, True]
    assert all(len(line) <= 80 for line in lines)
    assert stream.getvalue().endswith("\r\x1b[K")  # the status line is gone at the end


def test_a_late_checkpoint_does_not_hold_the_epoch_lines_back(columns, monkeypatch):
    stream = Terminal()
    bar = ProgressBar(3, 2, 8, stream=stream, saves=lambda e: True)
    monkeypatch.setattr(pb, "MARK_WAIT", 0.0)
    bar.log_train_metrics(METRICS, 1, 0, 1)
    bar.log_train_metrics(METRICS, 2, 0, 1)
    bar.log_train_metrics(METRICS, 3, 1, 1)  # the next step: epoch 1's line goes out unmarked
    assert [line.split(":")[0] for line in shown_lines(stream)] == ["epoch 1/3"]
    assert not shown_lines(stream)[0].endswith("✓")
    bar.on_checkpoint(0, "ckpt-unit-00000002.pt")  # too late: logs/driver.log has it
    assert len(shown_lines(stream)) == 1


def test_nothing_is_drawn_after_an_interrupt(columns):
    stream = Terminal()
    bar = ProgressBar(3, 4, 8, stream=stream)
    bar.log_train_metrics(METRICS, 1, 0, 2)
    bar.interrupt()
    after = len(stream.getvalue())
    bar.log_train_metrics(METRICS, 2, 0, 2)
    bar.log_test_metrics(METRICS, 4, 0)
    bar.on_generation({"members": [0], "reason": "worker 1 lost"})
    bar.note("training stopped by a callback after epoch 1")
    bar.close()
    assert len(stream.getvalue()) == after


def test_a_change_of_workers_on_several_hosts_names_the_host(columns):
    stream = Terminal()
    bar = ProgressBar(3, 4, 8, stream=stream)
    bar.log_train_metrics(METRICS, 1, 0, 2)
    bar.on_generation({"members": [0, 3], "reason": "worker 3 joins", "hosts": {3: "10.0.0.7"}})
    lost = "worker 3 lost: connection lost (EOFError())"
    bar.on_generation({"members": [0], "reason": lost, "hosts": {3: "10.0.0.7"}})
    bar.on_generation({"members": [0, 4], "reason": "worker 4 joins"})  # one host: no address
    two = {5: "10.0.0.8", 6: "10.0.0.8", 7: "10.0.0.9"}  # one host's two workers leave, another's joins
    bar.on_generation({"members": [0, 7], "reason": "workers 5, 6 leave (SIGTERM); worker 7 joins", "hosts": two})
    bar.close()
    text = stream.getvalue()
    assert "now 2 workers (worker 3 on 10.0.0.7 joins)" in text
    assert "now 1 worker (worker 3 on 10.0.0.7 lost: connection lost)" in text
    assert "now 2 workers (worker 4 joins)" in text
    assert "now 2 workers (workers 5, 6 on 10.0.0.8 leave; worker 7 on 10.0.0.9 joins)" in text


def test_library_lines_print_above_the_bar_cut_to_the_width(columns):
    stream = Terminal()
    bar = ProgressBar(3, 4, 8, stream=stream)
    bar.log_train_metrics(METRICS, 1, 0, 2)
    drawn = status_lines(stream)[-1]
    screen.write_line(screen.fit([Field("[fabric-model] " + "x" * 200)], 80), stream)
    tail = stream.getvalue().rsplit("\n", 1)
    assert tail[0].endswith("x…") and tail[1] == drawn  # printed, then the bar drawn again
    bar.close()


def test_the_epoch_lines_fields_priority_is_stated_and_kept(columns):
    assert EPOCH_FIELDS[:3] == ("epoch", "loss", "val_loss")
    columns(60)
    stream = Terminal()
    bar = ProgressBar(20, 1, 8, stream=stream, validates=lambda e: True, saves=lambda e: True)
    bar.log_train_metrics(METRICS, 1, 0, 2)
    bar.log_test_metrics(METRICS, 1, 0)
    bar.on_checkpoint(0, "ckpt")
    (line,) = [line for line in shown_lines(stream) if line.startswith("epoch")]
    # the train metrics went before the val_ ones, the mark, workers, time and speed before them
    assert line == "epoch 1/20: loss=0.5000 val_loss=0.5000 val_accuracy=0.7500", line


# -- a real run: an 80x24 terminal, a pipe, Ctrl-C ----------------------------------------------
def render(text: str, width: int) -> list[str]:
    """The lines a terminal of ``width`` columns ends up showing (``\\r`` and erase-line applied)."""
    rows, row, col = [""], 0, 0
    for token in re.finditer(r"\x1b\[(\d*)([A-Za-z])|\r\n|\n|\r|.", text, re.S):
        t = token.group(0)
        if token.group(2):
            if token.group(2) == "K":
                rows[row] = rows[row][:col]
            continue
        if t in ("\r\n", "\n"):
            row, col = row + 1, 0
            rows.append("") if row == len(rows) else None
        elif t == "\r":
            col = 0
        else:
            assert col < width, f"a line wrapped: {rows[row]!r}"
            rows[row] = rows[row][:col].ljust(col) + t + rows[row][col + 1 :]
            col += 1
    return rows


def run_in_pty(args: list[str], cwd: Path, interrupt_after: str | None = None, timeout: float = 240) -> tuple[int, str]:
    """``args`` run in ``cwd`` on an 80x24 pseudo-terminal: (exit status, what it wrote)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    proc = subprocess.Popen(
        args, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=job_env(), start_new_session=True,
        preexec_fn=interruptible,
    )  # fmt: skip
    os.close(slave)
    try:
        if interrupt_after is None:
            text = read_pty(master, proc, timeout)
        else:
            text, deadline = "", time.monotonic() + timeout
            while interrupt_after not in text and time.monotonic() < deadline and proc.poll() is None:
                text += read_pty(master, proc, 0.5)
            os.killpg(proc.pid, signal.SIGINT)
            text += read_pty(master, proc, 60)
        code = proc.wait(timeout=60)
    finally:
        os.close(master)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    return code, text


@pytest.mark.processes
def test_an_80_column_terminal_shows_fitted_lines_and_one_line_per_epoch(tmp_path):
    # The run directory as a user's usually is, under the working directory (its path is shown whole).
    code, text = run_in_pty([*JOB, "run", "3", "0.1"], tmp_path)
    assert code == 0, text[-3000:]
    rows = render(text, 80)  # asserts that nothing wrapped
    assert all(len(row) <= 80 for row in rows)
    epochs = [row.split(":")[0] for row in rows if re.match(r"epoch \d+/3:", row)]
    assert epochs == ["epoch 1/3", "epoch 2/3", "epoch 3/3"], rows
    assert all(re.search(r"val_loss=\d\.\d{4}", row) for row in rows if row.startswith("epoch"))
    redraws = [s for s in ANSI.sub("", text.replace("\x1b[K", "")).replace("\n", "\r").split("\r") if "|" in s]
    assert redraws and all(len(s) <= 79 and re.match(r"epoch \d/3 \|[█▏▎▍▌▋▊▉ ]+\| \d/6 eta ", s) for s in redraws)
    assert "2 workers training" in text and "generation" not in text and "slot" not in text


@pytest.mark.processes
def test_a_pipe_gets_lines_within_80_columns_and_no_redraws(tmp_path):
    out = subprocess.run(
        [*JOB, "run", "2", "0.02"], capture_output=True, text=True, timeout=240, cwd=tmp_path, env=job_env()
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "\r" not in out.stderr and "\x1b" not in out.stderr
    lines = out.stderr.splitlines()
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    assert [line.split(":")[0] for line in lines if re.match(r"epoch \d/2:", line)] == ["epoch 1/2", "epoch 2/2"]
    # The run ends saying what the driver checked and where the model is.
    assert re.fullmatch(r"\[fabric-model\] done: 12 steps, every sample once an epoch, 2 replicas agree", lines[-2])
    assert re.fullmatch(r"\[fabric-model\] model: run/model/model\.pt \(sha256 [0-9a-f]{12}\)", lines[-1]), lines[-3:]


@pytest.mark.processes
def test_nothing_is_printed_after_interrupted(tmp_path):
    code, text = run_in_pty([*JOB, "run", "30", "0.1"], tmp_path, interrupt_after="epoch 2/30:")
    assert code == 130, text[-3000:]
    after = text[text.index("Interrupted.") :]
    assert "\r" not in after.replace("\r\n", "\n") and "epoch" not in after, after  # no bar drawn again
    lines = after.replace("\r\n", "\n").strip().split("\n")
    assert len(lines) == 3 and lines[2].startswith("from its newest checkpoint, ckpt-unit-"), lines
