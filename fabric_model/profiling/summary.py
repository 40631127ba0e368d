"""A profile's one-screen summary: where a step's wall time went, the user's code against the
framework's (docs/training.md, "Profiling"). Pure: figures in, lines out. Standard library only.

Each row is the exclusive time of named ranges (:mod:`.phases`) per profiled step. "Between the
named ranges" is the window's wall time less every range: the loop's own glue, and on a GPU the
time the host waited for the device outside a range. The step's one read of its results is a
row of its own: on a GPU the host waits there for the step's kernels, the user's mostly (a plain
loop waits in ``loss.item()``), so neither side's group is charged for it.
"""

from __future__ import annotations

from typing import Any

from . import phases as ph

#: The summary's rows: (label, the ranges it sums), by group.
YOURS = (
    ("forward and loss", (ph.FORWARD,)),
    ("backward", (ph.BACKWARD,)),
    ("optimizer step", (ph.OPTIMIZER,)),
    ("metrics", (ph.METRICS,)),
    ("callbacks and loggers", (ph.CALLBACKS,)),
    ("validation", (ph.VALIDATION,)),
)
DATA = (("reading data (your dataset, our loader)", (ph.DATA,)),)
OURS = (
    ("step set-up, seeding, buffers, sums", (ph.STEP, ph.SEED, ph.BUFFERS, ph.STATS)),
    ("allreduce (and waiting for peers)", (ph.REDUCE,)),
    ("step report to the driver", (ph.REPORT,)),
    ("snapshot and checkpoint copies", (ph.SNAPSHOT, ph.CHECKPOINT)),
    ("replica fingerprints", (ph.FINGERPRINT,)),
)


def render(figures: dict[str, Any], trace: str | None) -> list[str]:
    """The summary's lines for one profile's ``figures`` (session.StepProfiler.close), ``trace``
    the trace file's path as the user should open it (None: none was written)."""
    steps = max(1, int(figures["steps"]))
    wall = float(figures["wall"])
    times: dict[str, float] = figures["phases"]
    device_times: dict[str, float] = figures.get("device_phases") or {}
    per_step = wall / steps
    first = int(figures["first"])
    span = f"step {first}" if steps == 1 else f"steps {first}-{first + steps - 1}"
    partial = " (its generation ended there)" if figures.get("partial") else ""
    lines = [
        f"profile of {span}{partial} on worker {figures['worker']}, {figures['where']}, {figures['device']}: "
        f"{_ms(per_step)} ms a step",
        f"  {'':<44}{'ms/step':>8}{'share':>7}" + (f"{'device ms':>11}" if device_times else ""),
    ]
    named = 0.0

    def group(title: str, rows: tuple[tuple[str, tuple[str, ...]], ...]) -> None:
        nonlocal named
        total = sum(times.get(n, 0.0) for _, names in rows for n in names)
        named += total
        lines.append(_row(title, total, steps, wall, None, indent=2))
        for label, names in rows:
            seconds = sum(times.get(n, 0.0) for n in names)
            device = sum(device_times.get(n, 0.0) for n in names) if device_times else None
            lines.append(_row(label, seconds, steps, wall, device, indent=4))

    group("your code", YOURS)
    group("data", DATA)
    group("fabric-model", OURS)
    waiting = times.get(ph.RESULTS, 0.0)
    marking = times.get(ph.INSTRUMENTATION, 0.0)
    lines.append(_row("between the named ranges", max(0.0, wall - named - waiting - marking), steps, wall, None, 4))
    waited = device_times.get(ph.RESULTS, 0.0) if device_times else None
    lines.append(_row("the step's results (waiting for the device)", waiting, steps, wall, waited, indent=2))
    lines.append(_row("profiling: marking the ranges", marking, steps, wall, None, indent=2))
    operators = figures.get("operators") or []
    if operators:
        lines.append("  the profiler's busiest operators (self time, ms/step):")
        for name, cpu, device in operators:
            extra = f" cpu, {_ms(device / steps)} device" if device else ""
            lines.append(f"    {name[:52]:<52}{_ms(cpu / steps):>8}{extra}")
    lines.append("  (times include the torch profiler's own cost, a few microseconds an operator)")
    if trace is not None:
        lines.append(f"  trace: {trace} (ui.perfetto.dev, chrome://tracing, TensorBoard's profiler)")
    return lines


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}" if seconds < 0.01 else f"{seconds * 1e3:.2f}"


def _row(label: str, seconds: float, steps: int, wall: float, device: float | None, indent: int) -> str:
    share = f"{100 * seconds / wall:.0f}%" if wall > 0 else "-"
    line = f"{' ' * indent}{label:<{46 - indent}}{_ms(seconds / steps):>8}{share:>7}"
    if device is not None:
        line += f"{_ms(device / steps):>11}"
    return line
