"""What a person sees of a run in the caller: the driver's hooks, the start-up lines, Ctrl-C.

``train()`` builds the driver's hooks here (the user's loggers, then the progress display and
the run recorder), says before training starts where the run lives and what runs it, and turns
a Ctrl-C into how to resume. A leaf module: no torch.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..frameworks.keras.quiet import notices_for_workers
from ..run import console, screen
from ..run.hooks import Hooks
from ..run.progress_bar import ProgressBar
from ..run.recorder import RunRecorder
from ..state.checkpoint import checkpoint_due, list_checkpoints
from ..step.plan import Schedule

if TYPE_CHECKING:
    from ..run.rundir import RunDirectory
    from .driver import DriverSetup

log = logging.getLogger(__name__)
#: Exit status after Ctrl-C, as a shell reports a process ended by SIGINT.
INTERRUPTED_EXIT = 130
#: What a shell reports for a process ended by SIGTERM (128 + 15): a preempted run's status.
PREEMPTED_EXIT = 143


def check_verbose(verbose: Any) -> int:
    """``verbose`` as an int in 0..2, or an error naming it."""
    if isinstance(verbose, bool) or verbose not in (0, 1, 2):
        raise ValueError(f"Expected `verbose` to be 0 (quiet), 1 (progress) or 2 (epoch lines). Received: {verbose!r}")
    return int(verbose)


def samples_per_step(setup: DriverSetup) -> int:
    """Samples in a full step. Not ``plan.global_batch``: a batch-level dataset's plan counts its
    items, each a whole batch of ``batch_size`` samples (a Keras ``PyDataset``, ``flow()``)."""
    return setup.plan.micro_batches * setup.config.batch_size


def driver_hooks(user_loggers: Any, setup: DriverSetup, run: RunDirectory, verbose: int, tensorboard: bool) -> Hooks:
    """The user's driver logger(s), the progress display (unless ``verbose=0``) and the recorder."""
    plan, samples, config = setup.plan, samples_per_step(setup), setup.config
    schedule = Schedule(plan, config.epochs, config.validation_freq, setup.has_test)
    progress = ProgressBar(
        config.epochs,
        plan.steps_per_epoch,
        samples,
        verbose=verbose,
        validates=schedule.validation_due,
        saves=lambda e: checkpoint_due(
            schedule, config.checkpoint_freq, schedule.unit(e, plan.steps_per_epoch), config.checkpoint_steps
        ),
    )
    recorder = None
    if tensorboard:
        tb, csv = run.path / "tensorboard", run.logs / "metrics.csv"
        recorder = RunRecorder(tb, csv, setup.stat_names, samples, plan.steps_per_epoch)
    return Hooks.for_driver(user_loggers, progress if verbose else None, recorder)


def run_with_display(
    user_loggers: Any, setup: DriverSetup, run: RunDirectory, display: tuple[int, bool], start: Callable[[Hooks], Any]
) -> tuple[Any, Hooks]:
    """``start(hooks)`` (the driver's run) with the display around it: the log handlers, the
    start-up lines, Ctrl-C's message; every display closed however it ends."""
    verbose, tensorboard = display
    hooks = driver_hooks(user_loggers, setup, run, verbose, tensorboard)
    detach = console.attach(verbose, run.logs / "driver.log")
    try:
        startup_lines(setup, run, tensorboard)
        with notices_for_workers(verbose == 2):  # TensorFlow's start-up notices in the worker logs
            return start(hooks), hooks
    except KeyboardInterrupt:
        _stop_bars(hooks)
        run.record_end("interrupted")
        interrupted(run)
        raise
    except Exception as exc:
        from .preemption import Preempted

        if not isinstance(exc, Preempted):
            raise
        _stop_bars(hooks)
        checkpoint = exc.checkpoint.name if exc.checkpoint is not None else None
        run.record_end("preempted", signal=exc.signal_name, checkpoint=checkpoint, unit=exc.unit)
        preempted(run, exc)
        raise
    finally:
        for obj in hooks.loggers:  # ours only: a user's logger is theirs to close
            if isinstance(obj, (ProgressBar, RunRecorder)):
                obj.close()
        detach()


def _stop_bars(hooks: Hooks) -> None:
    for obj in hooks.loggers:  # nothing is drawn after the message
        if isinstance(obj, ProgressBar):
            obj.interrupt()


def _interactive() -> bool:
    """A REPL, ``python -i`` or an IPython/Jupyter shell; not a script that merely imported
    IPython (``import keras`` does), which must still exit with a status and no traceback."""
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return True
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    return get_ipython is not None and get_ipython() is not None


def preempted(run: RunDirectory, exc: Exception) -> None:
    """After a preemption signal (the state is saved, every worker stopped): one line that says
    where it stopped and how to come back (the checkpoint and its timing are in driver.log), then
    exit status 143 in a script; in an interactive session the
    :class:`~fabric_model.driver.preemption.Preempted` error is raised again."""
    from .preemption import Preempted

    assert isinstance(exc, Preempted)
    sys.stderr.write(
        f"\n{exc.signal_name}: preempted {exc.position}; "
        f"resume with train(..., run_dir={str(_shown(run.path))!r}, resume=True)\n"
    )
    sys.stderr.flush()
    if not _interactive():
        raise SystemExit(PREEMPTED_EXIT)


def startup_lines(setup: DriverSetup, run: RunDirectory, tensorboard: bool) -> None:
    """Where the run lives and what runs it, before the first worker starts (the resume point is
    said by the checkpoint book as it opens the checkpoint). Paths under the working directory
    are given relative to it: the lines fit a narrow terminal."""
    kinds = Counter(str(d) for d in setup.devices)
    devices = ", ".join(kinds) if len(kinds) > 1 or len(setup.devices) == 1 else next(iter(kinds), "")
    plan, config, workers = setup.plan, setup.config, len(setup.devices)
    log.info("run directory: %s", _shown(run.path))
    most = max(workers, setup.max_workers or 0)
    shape = (
        f"{screen.count(config.epochs, 'epoch')} of {screen.count(plan.steps_per_epoch, 'step')}, "
        f"global batch {samples_per_step(setup)}"
    )
    if setup.ray_actor:  # actors, placed where Ray has room (or pending until it has)
        log.info("asking Ray for %s of %s each: %s", screen.count(most, "worker"), setup.ray_actor, shape)
    elif workers == 0:  # FABRIC_MODEL_LOCAL_WORKERS=0: every worker joins from elsewhere
        log.info("waiting for up to %s started by hand (join.json): %s", screen.count(most, "worker"), shape)
    else:
        up_to = f" (up to {most})" if most > workers else ""
        log.info("starting %s on %s%s: %s", screen.count(workers, "worker"), devices, up_to, shape)
    if tensorboard:
        # The runs' folder when it is under the working directory: this run and the earlier ones.
        shown = _shown(run.path.parent)
        log.info("tensorboard --logdir %s", shown if not shown.is_absolute() else run.path / "tensorboard")


def _shown(path: Path) -> Path:
    """``path`` relative to the working directory when it is under it."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve())
    except (OSError, ValueError):
        return path


def interrupted(run: RunDirectory) -> None:
    """After Ctrl-C (the driver has stopped every worker): say how to resume, then leave.

    In a script: the message and exit status 130, no traceback. In an interactive session
    (a REPL, IPython, Jupyter) ``KeyboardInterrupt`` is raised again, which they show briefly.
    """
    saved = list_checkpoints(run.checkpoints)
    start = f"its newest checkpoint, {saved[-1][1].name}" if saved else "the beginning (no checkpoint yet)"
    sys.stderr.write(
        f"\nInterrupted. The run is in {run.path}; every worker was stopped.\n"
        f"Resume it with train(..., run_dir={str(run.path)!r}, resume=True)\n"
        f"from {start}.\n"
    )
    sys.stderr.flush()
    if _interactive():
        raise KeyboardInterrupt
    raise SystemExit(INTERRUPTED_EXIT)
