"""``fabric-model plot``: the figure's panels and curves (docs/training.md, "What you see: progress,
logs, TensorBoard, the command line").

The run directories are written with the recorder's own writer (``MetricsLog``), so the records
have the exact shape a run leaves; one test plots a real training run."""

from pathlib import Path

import pytest

from fabric_model.__main__ import main
from fabric_model.run.metrics_log import MetricsLog, read_records
from fabric_model.run.plot import plot_run, read_series, run_figure, smooth
from fabric_model.run.rundir import RunDirectory

pytest.importorskip("matplotlib")

STEPS = 5  # steps per epoch: run.json's plan has 40 samples in batches of 8


def write_run(
    run_dir: Path,
    steps: list[tuple[int, int]],
    *,
    metrics: tuple[str, ...] = ("accuracy",),
    validate: bool = True,
    workers: tuple[int, ...] = (2,),
    run_json: bool = True,
    append: bool = False,
    loss: float = 5.0,
) -> None:
    """The records of the (epoch, step) pairs ``steps`` and, at each epoch end, a validation; one
    generation per entry of ``workers``."""
    run = RunDirectory(run_dir)
    if run_json:
        plan = {"num_samples": 40, "batch_size": 8, "micro_batches": 1, "seed": 1}
        run.write_run_record({"framework": "torch", "config": {"epochs": 3}, "plan": plan, "started": 0})
    with MetricsLog(run.metrics, append=append) as log:
        for n, count in enumerate(workers):
            log.generation(generation=n, members=list(range(count)), reason="start", resume_unit=0, source_rank=-1)
        for epoch, step in steps:
            values = {"loss": loss - 0.1 * step, **{m: 0.1 * step for m in metrics}}
            log.train(
                epoch=epoch,
                step=step,
                iteration=epoch * STEPS + step + 1,
                generation=len(workers) - 1,
                workers=workers[-1],
                metrics=values,
                epoch_metrics=values,
                micro_batches={0: [0]},
            )
            if validate and step == STEPS - 1:
                log.test(epoch=epoch, iteration=epoch * STEPS + step + 1, workers=workers[-1], metrics=values)


def panels(fig) -> dict:
    return {ax.get_title(loc="left"): ax for ax in fig.axes}


def line(ax, label: str):
    found = [ln for ln in ax.lines if ln.get_label() == label]
    assert len(found) == 1, [ln.get_label() for ln in ax.lines]
    return found[0]


def test_a_panel_per_quantity_with_per_step_curves_and_validation_at_the_epoch_ends(tmp_path):
    steps = [(e, s) for e in range(2) for s in range(STEPS)]
    write_run(tmp_path, steps)
    fig = run_figure(tmp_path)
    axes = panels(fig)
    assert list(axes) == ["loss", "accuracy"]  # each its own scale, no workers panel
    assert axes["loss"].get_ylim()[0] > 4 and axes["accuracy"].get_ylim()[1] < 1
    for ax in axes.values():
        assert list(line(ax, "train (per step)").get_xdata()) == list(range(1, 2 * STEPS + 1))
        assert list(line(ax, "validation").get_xdata()) == [STEPS, 2 * STEPS]
        assert list(line(ax, "train (epoch mean)").get_xdata()) == [STEPS, 2 * STEPS]
    # The epoch boundary: one dotted line between the epochs.
    assert [v.get_xdata()[0] for v in axes["loss"].lines if v.get_linestyle() == ":"] == [STEPS + 0.5]
    assert "run " + tmp_path.name in fig.get_suptitle()
    png = plot_run(tmp_path)
    assert png == tmp_path / "plot.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_stopped_in_its_first_epoch_has_its_steps_drawn(tmp_path):
    write_run(tmp_path, [(0, s) for s in range(3)])
    for run_json in (True, False):  # without run.json the steps per epoch are unknown
        if not run_json:
            (tmp_path / "run.json").unlink()
        axes = panels(run_figure(tmp_path))
        assert len(line(axes["loss"], "train (per step)").get_xdata()) == 3
        assert not [ln for ln in axes["loss"].lines if ln.get_label() in ("validation", "train (epoch mean)")]


def test_a_run_without_validation_or_metrics_has_one_panel(tmp_path):
    write_run(tmp_path, [(e, s) for e in range(2) for s in range(STEPS)], metrics=(), validate=False)
    axes = panels(run_figure(tmp_path))
    assert list(axes) == ["loss"]
    assert [ln.get_label() for ln in axes["loss"].lines if not ln.get_label().startswith("_")] == [
        "train (per step)",
        "train (epoch mean)",
    ]


def test_a_run_with_no_step_yet_still_plots(tmp_path):
    write_run(tmp_path, [])
    fig = run_figure(tmp_path)
    assert list(panels(fig)) == ["loss"]
    plot_run(tmp_path, tmp_path / "out.png")
    assert (tmp_path / "out.png").stat().st_size > 0


def test_the_workers_panel_shows_when_the_count_changed(tmp_path):
    write_run(tmp_path, [(0, s) for s in range(STEPS)], workers=(2, 1, 2))
    axes = panels(run_figure(tmp_path))
    assert list(axes) == ["loss", "accuracy", "workers"]
    drawn = axes["workers"].lines[0].get_ydata()
    assert list(drawn) == [2, 1, 2, 2]


def test_a_redone_step_supersedes_the_earlier_record(tmp_path):
    """A resumed run appends the steps it redoes: the later record of an (epoch, step) is drawn."""
    write_run(tmp_path, [(0, s) for s in range(STEPS)] + [(1, 0), (1, 1)], loss=5.0)
    with MetricsLog(RunDirectory(tmp_path).metrics, append=True) as log:
        log.resume(checkpoint="ckpt-unit-00000006.pt", resume_unit=6, epoch=0, iteration=STEPS)
    # Not yet redone: the earlier attempt's steps after the checkpoint are no result.
    assert [x for x, _ in read_series(tmp_path, STEPS).steps] == list(range(1, STEPS + 1))
    write_run(tmp_path, [(1, s) for s in range(STEPS)], loss=3.0, append=True)
    series = read_series(tmp_path, STEPS)
    assert [x for x, _ in series.steps] == list(range(1, 2 * STEPS + 1))
    assert [m["loss"] for x, m in series.steps if x > STEPS] == [3.0 - 0.1 * s for s in range(STEPS)]
    loss = panels(run_figure(tmp_path))["loss"]
    assert len(line(loss, "train (per step)").get_xdata()) == 2 * STEPS


def test_smoothing_starts_at_the_first_value_and_skips_gaps():
    assert smooth([4.0, 4.0, 4.0], 5) == pytest.approx([4.0, 4.0, 4.0])
    out = smooth([1.0, float("nan"), 1.0], 3)
    assert out[0] == out[2] == 1.0 and out[1] != out[1]


@pytest.mark.processes
def test_the_plot_of_a_real_run(tmp_path, capsys):
    """A real training run (one worker, validation, a metric), plotted through the command line."""
    import torch
    import torch.nn.functional as F

    from fabric_model import FabricModel
    from tests.display_job import datasets
    from tests.helpers import MLP, accuracy

    torch.manual_seed(0)
    model = MLP()
    fm = FabricModel(model, datasets, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), metrics=[accuracy])
    run_dir = tmp_path / "run"
    fm.train(2, 16, 1, run_dir=run_dir, verbose=0, seed=1)
    axes = panels(run_figure(run_dir))
    assert list(axes) == ["loss", "accuracy"]
    logged = sum(r["type"] == "train" for r in read_records(run_dir / "logs" / "metrics.jsonl"))
    assert len(line(axes["loss"], "train (per step)").get_xdata()) == logged == 2 * 12
    assert len(line(axes["accuracy"], "validation").get_xdata()) == 2
    png = tmp_path / "plot.png"
    capsys.readouterr()
    assert main(["plot", str(run_dir), "-o", str(png)]) == 0
    assert capsys.readouterr().out.strip() == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
