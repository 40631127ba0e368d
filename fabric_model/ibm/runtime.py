"""``fabric-model run [OPTIONS] SCRIPT [ARGS...]``: run an IBM EDT script unchanged.

The script runs as ``__main__`` in this process (it is the driver), with ``sys.argv ==
[SCRIPT, *ARGS]`` and its own directory first on ``sys.path``, as ``python SCRIPT`` would,
inside IBM's runtime environment. Variables the user already set win:

- ``RESULT_DIR``: a new ``./fabric_runs/<time>-<hex>`` (fabric_model's run directory);
- ``LOG_DIR``: ``$RESULT_DIR/logs``;
- ``DATA_DIR``: the script's directory (IBM scripts join data file names onto it);
- ``FABRIC_HOME``: ``$RESULT_DIR/fabric_home``, holding ``libs/fabric.zip`` with the modules
  IBM's runtime provided (:mod:`.layout` says which, and why the script's own files win);
- ``TRAINING_ID``: the run directory's name;
- ``TF_USE_LEGACY_KERAS=1`` for a TensorFlow script, unless ``--keras3`` (:mod:`.keras_choice`).

``--param NAME=VALUE`` and ``--params FILE`` give IBM's UI-generated ``pth_parameter_mgr`` its
values (:mod:`.ui_parameters`). The exit code is the script's: 0, its ``SystemExit`` code, or 1
with the traceback on stderr (and, for a data download that failed, which file it was:
:mod:`.downloads`). Options come before SCRIPT; everything after it is the script's.
"""

from __future__ import annotations

import builtins
import os
import sys
import traceback
import types
from pathlib import Path
from types import TracebackType

from ..run.rundir import RunDirectory
from ..settings.registry import DATA_DIR, FABRIC_HOME, LOG_DIR, RESULT_DIR, TRAINING_ID
from . import layout, ui_parameters
from .downloads import explain
from .keras_choice import choose_keras, honour_lr

USAGE = (
    "usage: fabric-model run [--keras3] [--param NAME=VALUE]... [--params FILE] SCRIPT [ARGS...]\n"
    "  --keras3            run a TensorFlow script with Keras 3 (default: Keras 2 through tf-keras)\n"
    "  --param NAME=VALUE  a value for IBM's UI-generated pth_parameter_mgr (epochs, train_batch_size, ...)\n"
    "  --params FILE       those values as a JSON object\n"
)


def prepare_environment(script: Path) -> Path:
    """Set IBM's variables in ``os.environ`` (keeping the user's), lay out the runtime's modules
    and put them on this process's ``sys.path`` and the workers' ``PYTHONPATH``; returns ``RESULT_DIR``."""
    result_dir = RESULT_DIR.get() or str(RunDirectory.resolve(None).path)
    ibm = {
        RESULT_DIR.name: result_dir,
        LOG_DIR.name: LOG_DIR.get() or str(Path(result_dir, "logs")),
        DATA_DIR.name: DATA_DIR.get() or str(script.parent),
        FABRIC_HOME.name: FABRIC_HOME.get() or str(Path(result_dir, "fabric_home")),
        TRAINING_ID.name: TRAINING_ID.get() or Path(result_dir).name,
    }
    os.environ.update(ibm)  # for the script and the workers it starts
    Path(ibm[LOG_DIR.name]).mkdir(parents=True, exist_ok=True)
    libs = Path(ibm[FABRIC_HOME.name]) / "libs"
    fabric_zip = libs / "fabric.zip"
    if not fabric_zip.exists():
        layout.build_zip(fabric_zip)
    # Our own modules live outside the zip, in a folder of this run's (a shared FABRIC_HOME may be IBM's).
    fallback = layout.build_fallback(Path(result_dir) / "ibm_runtime" / "fallback")
    layout.install(script.parent, fabric_zip, fallback)
    return Path(result_dir)


def _run_as_main(script: Path) -> None:
    """Run ``script`` as ``python SCRIPT`` does: a fresh ``__main__`` module (so the workers get its
    functions by value), ``__file__`` absolute, and ``sys.argv`` left exactly as the caller set it
    (``runpy.run_path`` would make ``sys.argv[0]`` the path it was given)."""
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    main.__dict__["__builtins__"] = builtins
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = main
    try:
        exec(compile(script.read_bytes(), str(script), "exec"), main.__dict__)  # noqa: S102 (running it is the point)
    finally:
        sys.modules["__main__"] = saved


def _from_script(tb: TracebackType | None, script: Path) -> TracebackType | None:
    """The traceback from the script's first frame on, as ``python SCRIPT`` shows it (the whole
    traceback if the script has no frame in it)."""
    first = tb
    while first is not None and first.tb_frame.f_code.co_filename != str(script):
        first = first.tb_next
    return first or tb


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    sys.stderr.write(f"{exc.code}\n")  # sys.exit("message") prints it and exits 1, as Python does
    return 1


def _fail(message: str) -> int:
    sys.stderr.write(f"fabric-model run: {message}\n")
    return 2


def main(argv: list[str]) -> int:
    """Run ``argv = [OPTIONS] SCRIPT ARGS...`` (see :data:`USAGE`); returns the exit code."""
    keras3 = False
    pairs: list[str] = []  # --param NAME=VALUE
    files: list[str] = []  # --params FILE
    while argv and argv[0].startswith("-"):
        option, argv = argv[0], argv[1:]
        if option in ("-h", "--help"):
            sys.stdout.write(USAGE)
            return 0
        if option == "--keras3":
            keras3 = True
        elif option == "--keras2-optimizers":  # the former opt-in, now what a TensorFlow script gets anyway
            sys.stderr.write("fabric-model run: note: --keras2-optimizers is the default now (Keras 2 via tf-keras)\n")
        elif option in ("--param", "--params") or option.startswith(("--param=", "--params=")):
            name, _, value = option.partition("=")
            if not value:
                if not argv:
                    return _fail(f"{name} needs a value\n{USAGE}")
                value, argv = argv[0], argv[1:]
            (pairs if name == "--param" else files).append(value)
        else:
            return _fail(f"unknown option {option}\n{USAGE}")
    if not argv:
        sys.stderr.write(USAGE)
        return 2
    script = Path(argv[0]).resolve()
    if not script.is_file():
        return _fail(f"no such script: {argv[0]}")
    try:
        values = ui_parameters.from_arguments(pairs, files)
    except ValueError as exc:
        return _fail(str(exc))
    note, error = choose_keras(script, keras3)
    if error:
        return _fail(error)
    if note:
        sys.stderr.write(f"fabric-model run: {note}\n")
        honour_lr()
    result_dir = prepare_environment(script)
    if values:
        ui_parameters.save(values, result_dir / "ibm_runtime" / "ui_parameters.json")
    sys.argv = [argv[0], *argv[1:]]
    try:
        _run_as_main(script)
    except SystemExit as exc:
        return _exit_code(exc)
    except BaseException as exc:  # noqa: B036 (the script's KeyboardInterrupt too: report, exit 1)
        traceback.print_exception(exc.with_traceback(_from_script(exc.__traceback__, script)))
        hint = explain(exc)
        if hint:
            sys.stderr.write(hint + "\n")
        return 1
    return 0
