"""The run's metric record, ``logs/metrics.jsonl``: its only writer and its reader (docs/architecture.md,
"Run directory").

One JSON object a line, with a ``type`` and the wall-clock ``time``; the shapes are
documented in docs/run-directory.md and read by tests, so each has one method here and nobody builds
the JSON by hand. A leaf module (no torch).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from ..step.plan import Schedule


class MetricsLog:
    """Appends records to ``logs/metrics.jsonl``.

    Args:
        path: the file.
        append: keep the earlier attempts' records (a resumed run, or a line written after
            training); a partial last line, left by a driver killed mid-write, is cut first.
            Without it the file starts afresh: one run per directory.
    """

    def __init__(self, path: Path, *, append: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if append:
            cut_partial_line(path)
        # Unbuffered: each record reaches the kernel in one write as it is made, so a driver killed
        # without notice (SIGKILL, the OOM killer) leaves every committed step's record in the file.
        # One system call a record (a few microseconds of the driver's CPU, none of a step's).
        self._file = open(path, "ab" if append else "wb", buffering=0)
        # The last ``micro_batches`` written and its JSON: the driver passes the same mapping for a
        # generation's steps (step/plan.py, plan_shares), so a step with thousands of ranks does
        # not encode them again (docs/architecture.md, "Scale").
        self._shares: tuple[Mapping[int, Sequence[int]], str] | None = None
        self._keys: dict[str, str] = {}  # a metric's name -> its JSON and the colon

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def _write(self, record: dict[str, Any], tail: str = "") -> None:
        """``record`` as a line; ``tail``: more of the object, already in JSON (``, "key": value``)."""
        text = json.dumps(record)
        self._write_line((text[:-1] + tail + "}\n" if tail else text + "\n").encode())

    def _write_line(self, line: bytes) -> None:
        written = self._file.write(line)
        while written is not None and written < len(line):  # a short write (a full disk, a signal): the rest
            line = line[written:]
            written = self._file.write(line)

    # -- the record shapes -----------------------------------------------------------------
    def train(
        self,
        *,
        epoch: int,
        step: int,
        iteration: int,
        generation: int,
        workers: int,
        metrics: Mapping[str, float],
        epoch_metrics: Mapping[str, float],
        micro_batches: Mapping[int, Sequence[int]],
        inferred: bool = False,
    ) -> None:
        """A committed step: its metrics, the epoch's averages so far, who computed which micro-batch (a
        mapping never changed after: the same one again reuses its JSON)
        (``inferred``: settled from the plan for members that did not report).

        The driver writes one a committed step on the cores the workers compute on, so the line is
        made by hand, as ``json.dumps`` would make it: the keys' JSON is made once per name
        (docs/architecture.md, "What a step costs beyond the math")."""
        if self._shares is None or self._shares[0] is not micro_batches:
            encoded = json.dumps({str(r): list(m) for r, m in sorted(micro_batches.items())})
            self._shares = (micro_batches, f', "micro_batches": {encoded}')
        more = ', "inferred": true' if inferred else ""
        line = (
            f'{{"type": "train", "time": {time.time()!r}, "epoch": {int(epoch)}, "step": {int(step)}, '
            f'"iteration": {int(iteration)}, "generation": {int(generation)}, "workers": {int(workers)}, '
            f'"metrics": {self._object(metrics)}, "epoch_metrics": {self._object(epoch_metrics)}'
            f"{more}{self._shares[1]}}}\n"
        )
        self._write_line(line.encode())

    def _object(self, values: Mapping[str, float]) -> str:
        """``json.dumps(values)`` for a mapping of names to numbers."""
        keys = self._keys
        parts = []
        for name, value in values.items():
            key = keys.get(name)
            if key is None:
                key = keys[name] = json.dumps(str(name)) + ": "
            if type(value) is float and value - value == 0.0:  # finite (NaN and infinities: json's words)
                parts.append(key + repr(value))
            else:
                parts.append(key + json.dumps(value))
        return "{" + ", ".join(parts) + "}"

    def test(self, *, epoch: int, iteration: int, workers: int, metrics: Mapping[str, float]) -> None:
        """A validation after ``epoch``."""
        self._write(
            {
                "type": "test",
                "time": time.time(),
                "epoch": epoch,
                "iteration": iteration,
                "workers": workers,
                "metrics": dict(metrics),
            }
        )

    def generation(
        self,
        *,
        generation: int,
        members: Sequence[int],
        reason: str,
        resume_unit: int,
        source_rank: int,
        checkpoint: str | None = None,
        restored: str | None = None,
        rolled_back_from: int | None = None,
        hosts: Sequence[str] | None = None,
    ) -> None:
        """A generation formed (``checkpoint``: the file name every member restored from;
        ``restored``: "checkpoint" or "snapshot" when every member loaded one; ``rolled_back_from``:
        the committed unit given up when no worker held it, the steps from ``resume_unit`` redone;
        ``hosts``: where each member runs, in the order of ``members``)."""
        record: dict[str, Any] = {
            "type": "generation",
            "time": time.time(),
            "generation": generation,
            "workers": len(members),
            "members": list(members),
            "reason": reason,
            **({"hosts": list(hosts)} if hosts is not None else {}),
            "resume_unit": resume_unit,
            "source_rank": source_rank,
        }
        if checkpoint is not None:
            record["checkpoint"] = checkpoint
        if restored is not None:
            record["restored"] = restored
        if rolled_back_from is not None:
            record["rolled_back_from"] = rolled_back_from
        self._write(record)

    def checkpoint(
        self,
        *,
        unit: int,
        epoch: int,
        worker: int,
        generation: int | None,
        path: str | None = None,
        seconds: float | None = None,
        removed: Sequence[str] = (),
        error: str | None = None,
    ) -> None:
        """A checkpoint written (``path`` relative to the run directory, ``removed``: the file names
        pruned) or failed (``error``)."""
        record: dict[str, Any] = {"type": "checkpoint", "time": time.time(), "unit": unit, "epoch": epoch}
        record.update(worker=worker, generation=generation)
        if error:
            record["error"] = error
        else:
            record.update(path=path, seconds=seconds, removed=list(removed))
        self._write(record)

    def resume(self, *, checkpoint: str, resume_unit: int, epoch: int, iteration: int) -> None:
        """A resumed run starts from ``checkpoint`` (a file name)."""
        self._write(
            {
                "type": "resume",
                "time": time.time(),
                "checkpoint": checkpoint,
                "resume_unit": resume_unit,
                "epoch": epoch,
                "iteration": iteration,
            }
        )

    def end(
        self, *, iteration: int, replica_digests: Mapping[int, str], stopped_after_epoch: int | None = None
    ) -> None:
        """Training ended: the digest of every finished replica; ``stopped_after_epoch`` when a
        callback stopped training early (every replica after the same epoch or step)."""
        record = {
            "type": "end",
            "time": time.time(),
            "iteration": iteration,
            "replica_digests": {str(k): v for k, v in sorted(replica_digests.items())},
        }
        if stopped_after_epoch is not None:
            record["stopped_after_epoch"] = stopped_after_epoch
        self._write(record)

    def onnx(self, *, path: str | None, max_abs_diff: float | None = None, error: str | None = None) -> None:
        """The ONNX export after training: ``path`` and onnxruntime's ``max_abs_diff``, or ``error``."""
        record: dict[str, Any] = {"type": "onnx", "path": path}
        if error is not None:
            record["error"] = error
        else:
            record["max_abs_diff"] = max_abs_diff
        record["time"] = time.time()
        self._write(record)

    # -- reading -----------------------------------------------------------------------------
    @staticmethod
    def replay(path: Path, schedule: Schedule, unit: int) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
        """The history below ``unit`` (where a resumed run goes on) from the earlier attempts' records.

        Records at or past ``unit`` are redone by the resumed run and left out; of two records
        of the same step or validation (a step redone after a failure) the later wins.

        Returns:
            ``(train_history, test_history)``: per epoch whose last step is below ``unit``,
            ``{"epoch": e, **epoch averages}``; per validation below it, ``{"epoch": e, **metrics}``.
        """
        steps = schedule.plan.steps_per_epoch
        train: dict[tuple[int, int], dict[str, Any]] = {}
        test: dict[int, dict[str, Any]] = {}
        for r in read_records(path):
            if r.get("type") == "train" and schedule.unit(r["epoch"], r["step"]) < unit:
                train[(r["epoch"], r["step"])] = r
            elif r.get("type") == "test" and schedule.unit(r["epoch"], steps) < unit:
                test[r["epoch"]] = r
        train_history = [{"epoch": e, **r["epoch_metrics"]} for (e, s), r in sorted(train.items()) if s == steps - 1]
        test_history = [{"epoch": e, **r["metrics"]} for e, r in sorted(test.items())]
        return train_history, test_history


def epoch_so_far(path: Path, schedule: Schedule, unit: int) -> list[tuple[int, int, dict[str, float]]]:
    """``(epoch, step, the step's metrics)`` of the steps of ``unit``'s epoch below ``unit``, in order
    (of two records of a step, the later): what a run resumed inside an epoch goes on averaging from."""
    epoch = unit // schedule.units_per_epoch
    steps: dict[int, dict[str, float]] = {}
    for r in read_records(path):
        if r.get("type") == "train" and r["epoch"] == epoch and schedule.unit(epoch, r["step"]) < unit:
            steps[r["step"]] = r["metrics"]
    return [(epoch, step, metrics) for step, metrics in sorted(steps.items())]


def last_commit(path: Path, schedule: Schedule) -> tuple[int, list[int]]:
    """Where the run's record stops: the unit after its last committed step (every unit below
    it was committed; 0 with none), and the members of its last generation (what a restarted
    driver waits for: driver/driver.py, "take back")."""
    unit, members = 0, []
    for r in read_records(path):
        if r.get("type") == "train":
            unit = schedule.unit(r["epoch"], r["step"]) + 1  # in commit order: the last is the newest
        elif r.get("type") == "generation":
            members = list(r.get("members", []))
    return unit, members


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every complete record of the file (none if it does not exist); unreadable lines are skipped."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    records = []
    for line in data[: data.rfind(b"\n") + 1].splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def cut_partial_line(path: Path) -> None:
    """Cut a partial last line (a writer killed mid-record) so that appended records start a line."""
    try:
        with open(path, "r+b") as f:
            size = f.seek(0, 2)
            if size == 0:
                return
            # Read back from the end to the last newline: the partial line is short.
            keep, chunk = size, 4096
            while keep > 0:
                start = max(0, keep - chunk)
                f.seek(start)
                block = f.read(keep - start)
                newline = block.rfind(b"\n")
                if newline >= 0:
                    keep = start + newline + 1
                    break
                keep = start
            if keep < size:
                f.truncate(keep)
    except FileNotFoundError:
        return
