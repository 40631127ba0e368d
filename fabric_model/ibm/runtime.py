"""``fabric-model run [--keras2-optimizers] SCRIPT [ARGS...]``: run an IBM EDT script unchanged.

The script runs as ``__main__`` in this process (it is the driver), with ``sys.argv ==
[SCRIPT, *ARGS]`` and its own directory first on ``sys.path``, as ``python SCRIPT`` would,
inside IBM's runtime environment. Variables the user already set win:

- ``RESULT_DIR``: a new ``./fabric_runs/<time>-<hex>`` (fabric_model's run directory);
- ``LOG_DIR``: ``$RESULT_DIR/logs``;
- ``DATA_DIR``: the script's directory (IBM scripts join data file names onto it);
- ``FABRIC_HOME``: ``$RESULT_DIR/fabric_home``, holding ``libs/fabric.zip`` with the runtime
  modules ``callbacks``, ``emetrics``, ``elog``, ``edtcallback`` and ``pyedt``;
- ``TRAINING_ID``: the run directory's name.

Workers inherit this environment; ``PYTHONPATH`` gains the script's directory and the zip so
they import the same modules. The exit code is the script's: 0, its ``SystemExit`` code, or 1
with the traceback on stderr.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
import zipfile
from pathlib import Path

from ..run.rundir import RunDirectory
from ..setup.settings import DATA_DIR, FABRIC_HOME, KERAS2_OPTIMIZERS, LOG_DIR, RESULT_DIR, TRAINING_ID

USAGE = "usage: fabric-model run [--keras2-optimizers] SCRIPT [ARGS...]\n"
MODULES = Path(__file__).resolve().parent / "modules"


def build_zip(target: Path) -> Path:
    """Write the runtime modules (``modules/**.py``, paths relative to it) to ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        for source in sorted(MODULES.rglob("*.py")):
            zf.write(source, source.relative_to(MODULES).as_posix())
    os.replace(tmp, target)  # a concurrent reader never sees half a zip
    return target


def prepare_environment(script: Path) -> Path:
    """Set IBM's variables in ``os.environ`` (keeping the user's) and return the zip's path."""
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
    fabric_zip = Path(ibm[FABRIC_HOME.name]) / "libs" / "fabric.zip"
    if not fabric_zip.exists():
        build_zip(fabric_zip)
    # Workers are fresh interpreters: they find the script's modules and the runtime's here.
    paths = [str(script.parent), str(fabric_zip)]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [*paths, os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else paths
    )
    return fabric_zip


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    sys.stderr.write(f"{exc.code}\n")  # sys.exit("message") prints it and exits 1, as Python does
    return 1


def main(argv: list[str]) -> int:
    """Run ``argv = [--keras2-optimizers] SCRIPT ARGS...``; returns the exit code."""
    try:
        keras2 = KERAS2_OPTIMIZERS.get()
    except ValueError as exc:
        sys.stderr.write(f"fabric-model run: {exc}\n")
        return 2
    while argv and argv[0].startswith("-"):
        if argv[0] == "--keras2-optimizers":
            keras2 = True
        elif argv[0] in ("-h", "--help"):
            sys.stdout.write(USAGE)
            return 0
        else:
            sys.stderr.write(f"fabric-model run: unknown option {argv[0]}\n{USAGE}")
            return 2
        argv = argv[1:]
    if not argv:
        sys.stderr.write(USAGE)
        return 2
    script = Path(argv[0]).resolve()
    if not script.is_file():
        sys.stderr.write(f"fabric-model run: no such script: {argv[0]}\n")
        return 2
    fabric_zip = prepare_environment(script)
    sys.argv = [argv[0], *argv[1:]]
    # As `python SCRIPT`: the script's directory first (its own files win), then the runtime.
    sys.path[:0] = [str(script.parent), str(fabric_zip)]
    try:
        if keras2:
            from .keras2 import install

            install()
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        return _exit_code(exc)
    except BaseException:  # noqa: B036 (the script's KeyboardInterrupt too: report, exit 1)
        traceback.print_exc()
        return 1
    return 0
