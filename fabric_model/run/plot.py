"""``fabric-model plot RUN_DIR``: a PNG of a run (matplotlib, the ``[plot]`` extra).

Three panels: the training loss and metrics per epoch, the validation per epoch, and the live
worker count over time with faults (red) and joins (green) marked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .status import RunSummary, summarize


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the run's plot (default ``<run_dir>/plot.png``); returns its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise ImportError("fabric-model plot needs matplotlib: pip install 'fabric-model[plot]'") from exc
    summary = summarize(run_dir)
    target = Path(out) if out is not None else summary.path / "plot.png"
    fig, (metrics_ax, workers_ax) = plt.subplots(2, 1, figsize=(8, 6.5), height_ratios=[3, 2])
    _draw_metrics(metrics_ax, summary, MaxNLocator)
    _draw_workers(workers_ax, summary, MaxNLocator)
    fig.suptitle(f"{summary.path.name} ({summary.state})", fontsize=10)
    fig.tight_layout()
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target


def _draw_metrics(ax: Any, summary: RunSummary, MaxNLocator: Any) -> None:
    axes = ax
    names = sorted(
        {k for m in summary.epochs_train.values() for k in m} | {k for m in summary.epochs_val.values() for k in m}
    )
    for name in names:
        train = sorted((e + 1, m[name]) for e, m in summary.epochs_train.items() if name in m)
        val = sorted((e + 1, m[name]) for e, m in summary.epochs_val.items() if name in m)
        if train:
            line = axes.plot(*zip(*train), marker="o", label=name)[0]
            color = line.get_color()
        else:
            color = None
        if val:
            axes.plot(*zip(*val), marker="s", linestyle="--", color=color, label=f"val_{name}")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("epoch")
    axes.set_title("per epoch: training (solid), validation (dashed)", fontsize=9)
    if names:
        axes.legend(fontsize=8)
    axes.grid(alpha=0.3)


def _draw_workers(ax: Any, summary: RunSummary, MaxNLocator: Any) -> None:
    axes = ax
    gens = summary.generations
    if gens:
        # The last count lasts until the run's last record.
        times = [g.time for g in gens] + [max(summary.duration, gens[-1].time)]
        counts = [g.workers for g in gens] + [gens[-1].workers]
        axes.step(times, counts, where="post", color="black", label="live workers")
        for kind, color, marker in (("fault", "red", "x"), ("join", "green", "^")):
            marked = [(g.time, g.workers) for g in gens if g.kind == kind]
            if marked:
                axes.scatter(*zip(*marked), color=color, marker=marker, s=60, zorder=3, label=kind)
        axes.set_ylim(0, max(counts) + 1)
        axes.yaxis.set_major_locator(MaxNLocator(integer=True))
        axes.legend(fontsize=8)
    axes.set_xlabel("seconds since the run started")
    axes.set_ylabel("workers")
    axes.grid(alpha=0.3)
