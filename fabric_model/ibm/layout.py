"""Where a script under ``fabric-model run`` finds the runtime's modules, and why its own win.

IBM's runtime made three things importable from ``$FABRIC_HOME/libs/fabric.zip``:
``callbacks``, ``emetrics`` and (WMLA 4.8) ``pyedt``; ``fabric_model`` itself is the installed
package. The samples ship ``edtcallback.py`` and ``elog.py`` beside the script, and some ship
their own ``emetrics.py``. So:

- ``fabric.zip`` holds what IBM's held (``ibm/modules/``), nothing more;
- our ``edtcallback``, ``elog`` and ``pth_parameter_mgr`` (``ibm/fallback/``) sit in a folder
  at the *end* of ``sys.path``: used only when the script has none of its own;
- :class:`BesideScript` makes a file beside the script win over the runtime's module of that
  name whatever the script does to ``sys.path`` (the samples ``sys.path.insert(0, fabric.zip)``
  before ``from edtcallback import ...``). ``python SCRIPT`` puts the script's folder first, so
  IBM's runtime ran the user's copies; this keeps that true.

Workers import these modules again when they unpickle the user's objects: ``PYTHONPATH`` gets
the script's folder, then the zip, and ends with the fallback folder, in that order.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import shutil
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

ZIPPED = Path(__file__).resolve().parent / "modules"
FALLBACK = Path(__file__).resolve().parent / "fallback"


def runtime_module_names() -> frozenset[str]:
    """The top-level names the runtime provides (zipped or fallback)."""
    names = set()
    for folder in (ZIPPED, FALLBACK):
        for entry in folder.iterdir():
            if entry.suffix == ".py":
                names.add(entry.stem)
            elif (entry / "__init__.py").is_file():
                names.add(entry.name)
    return frozenset(names)


def build_zip(target: Path) -> Path:
    """Write IBM's runtime modules (``modules/**.py``, paths relative to it) to ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        for source in sorted(ZIPPED.rglob("*.py")):
            zf.write(source, source.relative_to(ZIPPED).as_posix())
    os.replace(tmp, target)  # a concurrent reader never sees half a zip
    return target


def build_fallback(target: Path) -> Path:
    """Copy our fallback modules into the folder ``target`` (replacing what was there)."""
    target.mkdir(parents=True, exist_ok=True)
    for source in sorted(FALLBACK.glob("*.py")):
        if source.name != "__init__.py":
            shutil.copyfile(source, target / source.name)
    return target


def _beside(folder: Path, name: str) -> bool:
    return (folder / f"{name}.py").is_file() or (folder / name / "__init__.py").is_file()


class BesideScript(importlib.abc.MetaPathFinder):
    """Finds a runtime-provided top-level module in the script's folder first, when a file is there."""

    def __init__(self, folder: Path, names: frozenset[str]) -> None:
        self.folder = folder
        self.names = names

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if path is not None or fullname not in self.names or not _beside(self.folder, fullname):
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [str(self.folder)])


def install(script_dir: Path, fabric_zip: Path, fallback: Path) -> None:
    """Set this process's ``sys.path`` and finders, and ``PYTHONPATH`` for the workers it starts."""
    sys.path[:0] = [str(script_dir), str(fabric_zip)]  # as `python SCRIPT`: the script's folder first
    sys.path.append(str(fallback))
    sys.meta_path.insert(0, BesideScript(script_dir, runtime_module_names()))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(script_dir), str(fabric_zip), *filter(None, [os.environ.get("PYTHONPATH")]), str(fallback)]
    )
