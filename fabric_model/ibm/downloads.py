"""Say which file a script's failed data download or missing data set was, and where it goes.

IBM's samples read MNIST and CIFAR-10 through ``torchvision.datasets.*(download=True)`` and
Keras' ``load_data()``; offline, or with a data set not yet placed, they fail deep in those
libraries with a message that names neither the file nor the folder. Both libraries keep the
target in a local variable of the frame that failed (``fpath`` in ``torchvision``'s
``download_url`` and Keras' ``get_file``; ``self.raw_folder`` or ``self.root`` of a
``torchvision`` data set), so the traceback itself says where the file belongs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import Any

_DOWNLOADERS = frozenset(
    {"download", "download_url", "download_and_extract_archive", "_urlretrieve", "urlretrieve", "get_file"}
)
_MISSING = ("Dataset not found", "Dataset metadata file not found")
DOCS = 'docs/ibm-migration.md, "Data the scripts download"'


def _frames(tb: TracebackType | None) -> list[FrameType]:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _text(value: Any) -> str | None:
    return os.fspath(value) if isinstance(value, (str, os.PathLike)) else None


def _download_target(frames: list[FrameType]) -> tuple[str | None, str | None] | None:
    """``(url, file)`` from the innermost download frame, or None when no downloader was running."""
    if not any(f.f_code.co_name in _DOWNLOADERS for f in frames):
        return None
    url = path = None
    for frame in reversed(frames):  # innermost first
        local = frame.f_locals
        url = url or _text(local.get("url")) or _text(local.get("origin"))
        path = path or _text(local.get("fpath"))
        folder, filename = _text(getattr(local.get("self"), "raw_folder", None)), _text(local.get("filename"))
        if path is None and folder and filename:
            path = os.path.join(folder, filename)
    return url, path


def _missing_data_set(exc: BaseException, frames: list[FrameType]) -> str | None:
    """The folder a ``torchvision`` data set looked in, when it found nothing there."""
    if not any(marker in str(exc) for marker in _MISSING):
        return None
    for frame in reversed(frames):
        holder = frame.f_locals.get("self")
        folder, root = _text(getattr(holder, "raw_folder", None)), _text(getattr(holder, "root", None))
        if folder is None and root:
            folder = os.path.join(root, getattr(holder, "base_folder", "") or "")
        if folder:
            return f"{type(holder).__name__} found no data in {folder}"
    return None


def explain(exc: BaseException) -> str | None:
    """One line naming the file or folder a data failure was about, or None for any other error."""
    for error in _chain(exc):
        frames = _frames(error.__traceback__)
        target = _download_target(frames)
        if target is not None:
            url, path = target
            what = " -> ".join(part for part in (url, path) if part) or "a data file"
            where = f"place the file at {path}" if path else "place the file where the script reads it"
            return (
                f"fabric-model run: the script's data download failed ({what}): {error}. Without network "
                f"access, {where}, or point DATA_DIR (or KERAS_HOME, TORCH_HOME) at a copy ({DOCS})."
            )
        missing = _missing_data_set(error, frames)
        if missing is not None:
            return f"fabric-model run: {missing}; place the data set's files there, or set DATA_DIR ({DOCS})."
    return None
