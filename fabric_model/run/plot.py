"""``fabric-model plot RUN_DIR``: a PNG of a run (matplotlib).

One panel per quantity (the loss, then each metric, each on its own scale): the per-step values
of ``logs/metrics.jsonl`` (faint) with a smoothed curve, the epoch means and the validation at
the epoch ends, and the epoch boundaries dotted. A last panel shows the live worker count over
time, faults (red) and joins (green) marked, when the count changed during the run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .metrics_log import read_records
from .rundir import RunDirectory
from .status import RunSummary, summarize

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: Below this many steps the per-step curve is drawn alone: smoothing a few points hides them.
SMOOTH_MIN_STEPS = 20


@dataclasses.dataclass
class RunSeries:
    """A run's curves, read back from ``logs/metrics.jsonl``; x is the global iteration (steps committed)."""

    names: list[str]  # the loss first, then the metrics, in the order they were logged
    steps: list[tuple[int, dict[str, float]]]  # (iteration, that step's own means)
    epoch_means: dict[int, tuple[int, dict[str, float]]]  # epoch -> (iteration at its end, its averages)
    validation: dict[int, tuple[int, dict[str, float]]]  # epoch -> (iteration, metrics)
    epochs: list[tuple[int, int]]  # (epoch, its first iteration) of every epoch logged
    workers_changed: bool


def read_series(run_dir: str | Path, steps_per_epoch: int | None = None) -> RunSeries:
    """The per-step and per-epoch values of a run; of a step or validation logged twice (a resumed
    or rolled-back run redoes them) the later record wins, and a resume drops the records after
    its checkpoint, as ``MetricsLog.replay`` does."""
    records = read_records(RunDirectory(run_dir).metrics)
    train: dict[tuple[int, int], dict[str, Any]] = {}
    test: dict[int, dict[str, Any]] = {}
    for r in records:
        if r.get("type") == "train":
            train[(int(r["epoch"]), int(r["step"]))] = r
        elif r.get("type") == "test":
            test[int(r["epoch"])] = r
        elif r.get("type") == "resume":
            # What came after the checkpoint is trained again: not yet redone, it is no result.
            at = int(r["iteration"])
            train = {k: v for k, v in train.items() if int(v["iteration"]) <= at}
            test = {k: v for k, v in test.items() if int(v["iteration"]) <= at}
    ordered = [r for _, r in sorted(train.items())]
    names: dict[str, None] = {}  # a dict keeps the logged order: "loss" comes first
    for r in ordered:
        names.update(dict.fromkeys(r["metrics"]))
    for r in test.values():
        names.update(dict.fromkeys(_unprefixed(r["metrics"])))
    last_step: dict[int, dict[str, Any]] = {}
    first_step: dict[int, int] = {}
    for (epoch, _), r in sorted(train.items()):
        last_step[epoch] = r
        first_step.setdefault(epoch, int(r["iteration"]))
    # An epoch's averages are the epoch's only at its last step; unknown steps per epoch: a later epoch began.
    epoch_means = {
        e: (int(r["iteration"]), dict(r["epoch_metrics"]))
        for e, r in last_step.items()
        if (r["step"] == steps_per_epoch - 1 if steps_per_epoch else e < max(last_step))
    }
    epochs = [(e, e * steps_per_epoch + 1 if steps_per_epoch else first_step[e]) for e in sorted(first_step)]
    counts = {int(r["workers"]) for r in records if r.get("type") in ("train", "generation") and "workers" in r}
    return RunSeries(
        list(names),
        [(int(r["iteration"]), r["metrics"]) for r in ordered],
        epoch_means,
        {e: (int(r["iteration"]), _unprefixed(r["metrics"])) for e, r in sorted(test.items())},
        epochs,
        len(counts) > 1,
    )


def _unprefixed(metrics: dict[str, float]) -> dict[str, float]:
    # The record holds the bare names; "val_" ones (as the CSV spells them) are accepted too.
    return {k.removeprefix("val_"): v for k, v in metrics.items()}


def smooth(values: Sequence[float], span: int) -> list[float]:
    """An exponential moving average, bias-corrected as TensorBoard's (the start is not pulled to 0);
    a non-finite value is a gap, not a poisoned average."""
    alpha, average, weight, out = 2.0 / (span + 1), 0.0, 0.0, []
    for v in values:
        if not math.isfinite(v):
            out.append(math.nan)
            continue
        average, weight = (1 - alpha) * average + alpha * v, (1 - alpha) * weight + alpha
        out.append(average / weight)
    return out


def run_figure(run_dir: str | Path) -> Figure:
    """The run's figure: panels titled by quantity ("loss", each metric, "workers" when the count
    changed). Raises ``FileNotFoundError`` for a directory that is no run, ``ImportError`` without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("fabric-model plot needs matplotlib: pip install matplotlib") from exc
    summary = summarize(run_dir)
    series = read_series(run_dir, summary.steps_per_epoch)
    names = series.names or ["loss"]  # no step logged yet: one panel that says so
    workers = series.workers_changed and bool(summary.generations)
    rows = len(names) + workers
    # No pyplot: its global figure registry is not needed to write a file.
    fig = Figure(figsize=(9, 1.2 + 2.4 * rows), layout="constrained")
    axes = fig.subplots(rows, 1, squeeze=False)[:, 0]
    for i, name in enumerate(names):
        if i:
            axes[i].sharex(axes[0])
        _draw_quantity(axes[i], name, series, label_epochs=i == 0)
    axes[len(names) - 1].set_xlabel("step (iterations committed, all epochs)")
    if workers:
        _draw_workers(axes[-1], summary)
    fig.suptitle(_title(summary), fontsize=10)
    return fig


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the run's plot (default ``<run_dir>/plot.png``); returns its path."""
    fig = run_figure(run_dir)
    target = Path(out) if out is not None else RunDirectory(run_dir).path / "plot.png"
    fig.savefig(target, dpi=100)
    return target


def _title(summary: RunSummary) -> str:
    last = summary.last_train
    where = f", epoch {last['epoch'] + 1}/{summary.epochs or '?'} step {last['step'] + 1}" if last else ""
    return f"run {summary.path.name} ({summary.state}{where})"


def _draw_quantity(ax: Axes, name: str, series: RunSeries, *, label_epochs: bool) -> None:
    ax.set_title(name, fontsize=9, loc="left", pad=12 if label_epochs else None)  # above the epoch labels
    ax.grid(alpha=0.3)
    for _, start in series.epochs[1:]:
        ax.axvline(start - 0.5, color="grey", linestyle=":", linewidth=0.8)
    points = [(x, m[name]) for x, m in series.steps if name in m]
    if not points:
        ax.text(0.5, 0.5, "no step logged", transform=ax.transAxes, ha="center", va="center", color="grey")
    else:
        xs, ys = zip(*points)
        # The raw curve stays visible under the smoothed one: spikes are information too.
        smoothed = len(points) >= SMOOTH_MIN_STEPS
        ax.plot(xs, ys, color="C0", alpha=0.3 if smoothed else 1.0, linewidth=0.8, label="train (per step)")
        if smoothed:
            ax.plot(xs, smooth(ys, max(2, len(points) // 40)), color="C0", linewidth=1.6, label="train (smoothed)")
    means = [(x, m[name]) for x, m in series.epoch_means.values() if name in m]
    if means:
        ax.plot(*zip(*means), "o", color="C0", markeredgecolor="white", label="train (epoch mean)")
    val = [(x, m[name]) for x, m in series.validation.values() if name in m]
    if val:
        ax.plot(*zip(*val), "s--", color="C1", linewidth=1, label="validation")
    if label_epochs:
        transform = ax.get_xaxis_transform()  # x in data, y in axes fractions
        stride = max(1, math.ceil(len(series.epochs) / 10))  # more labels would overlap
        for epoch, start in series.epochs[::stride]:
            ax.text(start, 1.01, f"epoch {epoch + 1}", transform=transform, fontsize=7, color="grey", va="bottom")
    if points or val:
        ax.legend(fontsize=7, loc="best")


def _draw_workers(ax: Axes, summary: RunSummary) -> None:
    from matplotlib.ticker import MaxNLocator

    gens = summary.generations
    # The last count lasts until the run's last record.
    times = [g.time for g in gens] + [max(summary.duration, gens[-1].time)]
    counts = [g.workers for g in gens] + [gens[-1].workers]
    ax.step(times, counts, where="post", color="black", label="live workers")
    for kind, color, marker in (("fault", "red", "x"), ("join", "green", "^")):
        marked = [(g.time, g.workers) for g in gens if g.kind == kind]
        if marked:
            xs, ys = zip(*marked)
            ax.scatter(xs, ys, color=color, marker=marker, s=60, zorder=3, label=kind)
    ax.set_ylim(0, max(counts) + 1)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("workers", fontsize=9, loc="left")
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("workers")
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
