"""A run directory read back for people: ``fabric-model status`` and ``fabric-model plot`` (a leaf module).

Everything comes from the files the driver writes (``run.json``, ``logs/metrics.jsonl``,
``checkpoints/``, ``join.json`` while the run lasts), so it works on a running, finished,
interrupted or copied run alike. Later records of a step or validation win, as on resume.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from ..step.plan import Plan
from .metrics_log import read_records
from .rundir import RunDirectory


@dataclasses.dataclass
class Generation:
    """A generation as the timeline shows it: when it formed, its size, and what changed."""

    generation: int
    time: float  # seconds since the run's first record
    workers: int
    kind: str  # "start", "fault" (fewer workers), "join" (more), "change" (as many)
    reason: str


@dataclasses.dataclass
class RunSummary:
    """What ``status`` prints and ``plot`` draws."""

    path: Path
    state: str
    epochs: int | None
    steps_per_epoch: int | None
    last_train: dict[str, Any] | None
    epochs_train: dict[int, dict[str, float]]  # epoch -> the epoch's averages
    epochs_val: dict[int, dict[str, float]]  # epoch -> validation metrics
    generations: list[Generation]
    checkpoint: str | None
    duration: float  # seconds from the first record to the last
    end: dict[str, Any] | None = None  # run.json's "end": state, time and details (RunDirectory.record_end)


def short_reason(reason: str, limit: int = 60) -> str:
    """A generation's reason for a screen or a table: who and what, without the error's internals
    ("worker 2: allreduce failed: [.../gloo/.../pair.cc:537] Read error ..." -> "worker 2: allreduce failed"),
    each of several causes so ("worker 2 lost: ...; worker 5 joins")."""
    text = "; ".join(_short_cause(cause) for cause in reason.split("; "))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _short_cause(cause: str) -> str:
    parts = cause.split(": ")
    return ": ".join(parts[:2]).split(" (")[0].split(" [")[0].strip()


def name_hosts(reason: str, hosts: dict[int, str]) -> str:
    """Each worker a reason names, with its host: "worker 3 joins" -> "worker 3 on 10.0.0.7 joins",
    "workers 3, 4 leave" -> "workers 3, 4 on 10.0.0.2, 10.0.0.3 leave" (a host named once)."""

    def on(named: re.Match[str]) -> str:
        where = dict.fromkeys(hosts.get(int(i), "?") for i in named.group(1).split(", "))
        return f"{named.group(0)} on {', '.join(where)}"

    return re.sub(r"\bworkers? (\d+(?:, \d+)*)", on, reason)


def generations(records: list[dict[str, Any]]) -> list[Generation]:
    """The generations in order, each classified against the one before."""
    out: list[Generation] = []
    t0 = records[0]["time"] if records else 0.0
    for r in records:
        if r.get("type") != "generation":
            continue
        workers, before = int(r["workers"]), out[-1].workers if out else None
        kind = "start" if before is None else "fault" if workers < before else "join" if workers > before else "change"
        out.append(Generation(int(r["generation"]), float(r["time"]) - t0, workers, kind, str(r.get("reason", ""))))
    return out


def summarize(path: str | Path) -> RunSummary:
    """Read a run directory; raises ``FileNotFoundError`` naming what is missing."""
    run = RunDirectory(path)
    if not run.metrics.exists():
        raise FileNotFoundError(f"{run.path} is not a fabric-model run directory (no logs/metrics.jsonl)")
    records = read_records(run.metrics)
    epochs: int | None = None
    steps: int | None = None
    try:
        recorded = json.loads(run.run_json.read_text())
        epochs, steps = int(recorded["config"]["epochs"]), Plan.from_record(recorded["plan"]).steps_per_epoch
    except (OSError, ValueError, KeyError, TypeError):
        pass
    train = [r for r in records if r.get("type") == "train"]
    epochs_train = {int(r["epoch"]): r["epoch_metrics"] for r in train if steps is None or r["step"] == steps - 1}
    epochs_val = {int(r["epoch"]): r["metrics"] for r in records if r.get("type") == "test"}
    ckpts = sorted(run.checkpoints.glob("ckpt-unit-*.pt")) if run.checkpoints.is_dir() else []
    ended, end = any(r.get("type") == "end" for r in records), run.end_state()
    if end is not None:  # what the run said as it ended (its join.json was removed before)
        state = end["state"] if end["state"] == "finished" else f"{end['state']} (resume=True goes on)"
    else:
        state = "finished" if ended else "running" if run.join_json.exists() else "stopped (resume=True goes on)"
    return RunSummary(
        run.path,
        state,
        epochs,
        steps,
        train[-1] if train else None,
        epochs_train,
        epochs_val,
        generations(records),
        ckpts[-1].name if ckpts else None,
        records[-1]["time"] - records[0]["time"] if records else 0.0,
        end,
    )


def end_line(end: dict[str, Any]) -> str:
    """``run.json``'s end in one short line: "preempted at 2026-01-01T12:00:00+00:00 (checkpoint=..., unit=21)"."""
    # A path's name is enough: the run directory is on the first row.
    shown = {k: Path(v).name if isinstance(v, str) and "/" in v else v for k, v in end.items()}
    details = ", ".join(f"{k}={v}" for k, v in shown.items() if k not in ("state", "time") and v is not None)
    return f"{end['state']} at {end.get('time', '?')}" + (f" ({details})" if details else "")


def _values(metrics: dict[str, float], prefix: str = "") -> str:
    return " ".join(f"{prefix}{k}={v:.4f}" for k, v in metrics.items())


def status_table(summary: RunSummary) -> str:
    """Two tables: the run, then its generations."""
    last, rows = summary.last_train, [("run", str(summary.path)), ("state", summary.state)]
    if last is not None and summary.epochs and summary.steps_per_epoch:
        total = summary.epochs * summary.steps_per_epoch
        rows.append(
            (
                "progress",
                f"epoch {last['epoch'] + 1}/{summary.epochs}, step {last['step'] + 1}/{summary.steps_per_epoch}"
                f" (iteration {last['iteration']}/{total}, {100 * last['iteration'] // total}%)",
            )
        )
        rows.append(("train", _values(last["epoch_metrics"])))
    if summary.epochs_val:
        epoch = max(summary.epochs_val)
        rows.append(("validation", f"epoch {epoch + 1}: {_values(summary.epochs_val[epoch], 'val_')}"))
    gens = summary.generations
    if gens:
        faults, joins = sum(g.kind == "fault" for g in gens), sum(g.kind == "join" for g in gens)
        rows.append(
            ("workers", f"{gens[-1].workers} (generation {gens[-1].generation}; {faults} fault(s), {joins} join(s))")
        )
    rows.append(("checkpoint", summary.checkpoint or "none"))
    if summary.end is not None:
        rows.append(("ended", end_line(summary.end)))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if gens:
        lines += ["", f"{'gen':>4}  {'time':>8}  {'workers':>7}  {'kind':<6}  reason"]
        for g in gens:
            lines.append(f"{g.generation:>4}  {g.time:>7.1f}s  {g.workers:>7}  {g.kind:<6}  {short_reason(g.reason)}")
    return "\n".join(lines)
