"""The run directory: where a run's files live and how they are written (docs/architecture.md, "Run directory").

Layout::

    <run_dir>/run.json               the call's framework, config and plan (the seed a resume reuses),
                                     and once it ended, how (``end``: :meth:`RunDirectory.record_end`)
    <run_dir>/join.json              while the run lasts: driver address and secret (mode 0600)
    <run_dir>/logs/metrics.jsonl     the metric record (:class:`~fabric_model.run.metrics_log.MetricsLog`)
    <run_dir>/logs/worker-<id>.log   each launched worker's output
    <run_dir>/logs/joined-<n>.log    workers started by hand through ``fabric_model.testing``
    <run_dir>/checkpoints/           ``ckpt-unit-<unit>.pt`` (:mod:`fabric_model.state.checkpoint`)
    <run_dir>/model/                 the final model
    <run_dir>/profile/               with ``train(profile=...)``: the profiler's trace and summary
    <run_dir>/ibm_runtime/           ``fabric-model run``'s own modules and values (fabric_model/ibm/runtime.py)

A leaf module: it imports nothing of the package but the settings registry, and no torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from ..settings.registry import RESULT_DIR

log = logging.getLogger(__name__)

#: Where runs go when neither ``run_dir`` nor ``$RESULT_DIR`` is given.
DEFAULT_PARENT = "fabric_runs"
#: How a run ended, as ``run.json``'s ``end.state`` says (docs/run-directory.md, "Resume").
END_STATES = ("finished", "failed", "interrupted", "preempted")


class RunDirectory:
    """One run's directory: its paths, and the files the run writes at its top level."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).resolve()

    def __repr__(self) -> str:
        return f"RunDirectory({str(self.path)!r})"

    @classmethod
    def resolve(cls, run_dir: str | os.PathLike[str] | None, *, for_resume: bool = False) -> RunDirectory:
        """The run directory: ``run_dir``, else ``$RESULT_DIR``, else a new ``./fabric_runs/<time>-<hex>``.

        Args:
            run_dir: the caller's ``run_dir`` argument.
            for_resume: ``resume=True`` continues an existing run, so a new directory is an error.

        Raises:
            ValueError: ``for_resume`` with neither ``run_dir`` nor ``$RESULT_DIR``.
        """
        named = cls.named(run_dir)
        if named is not None:
            return named
        if for_resume:
            raise ValueError(
                "Expected `run_dir` (or the RESULT_DIR environment variable) to name the run to continue with "
                "resume=True. Received: run_dir=None and no RESULT_DIR. HINT: without either, every run gets a new "
                "directory under ./fabric_runs/; pass run_dir=<that directory>."
            )
        return cls(Path(DEFAULT_PARENT) / f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}")

    @classmethod
    def named(cls, run_dir: str | os.PathLike[str] | None) -> RunDirectory | None:
        """The directory ``run_dir`` or ``$RESULT_DIR`` names; None when neither is given (a run
        then gets a new directory, so there is no earlier run to look at)."""
        if run_dir is not None:
            return cls(run_dir)
        result_dir = RESULT_DIR.get()
        return cls(result_dir) if result_dir is not None else None

    def create(self) -> RunDirectory:
        """Make the directory and its ``logs/``; returns itself."""
        self.logs.mkdir(parents=True, exist_ok=True)
        return self

    # -- paths ---------------------------------------------------------------------------
    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def metrics(self) -> Path:
        """``logs/metrics.jsonl``."""
        return self.logs / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def profile(self) -> Path:
        return self.path / "profile"

    @property
    def model(self) -> Path:
        return self.path / "model"

    @property
    def run_json(self) -> Path:
        return self.path / "run.json"

    @property
    def join_json(self) -> Path:
        return self.path / "join.json"

    def worker_log(self, worker_id: int) -> Path:
        """The output of a worker the launcher started."""
        return self.logs / f"worker-{worker_id}.log"

    def joined_log(self, n: int) -> Path:
        """The output of the ``n``-th worker started by hand (``fabric_model.testing.WorkerStarter``)."""
        return self.logs / f"joined-{n}.log"

    # -- run.json --------------------------------------------------------------------------
    def write_run_record(self, record: dict[str, Any]) -> None:
        """Write ``run.json`` (``framework``, ``config``, ``plan``, ``started``), atomically."""
        data = json.dumps(record, indent=2, default=str).encode()  # default: a Path among an end's details
        atomic_write(self.run_json, lambda f: f.write(data))

    def recorded_seed(self) -> int | None:
        """The seed ``run.json`` recorded, or None without a readable one."""
        try:
            return int(json.loads(self.run_json.read_text())["plan"]["seed"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def record_end(self, state: str, **details: Any) -> bool:
        """Add ``"end": {"state": state, "time": <ISO 8601, UTC>, **details}`` to ``run.json``, atomically.

        The first end recorded stands (returns False for a later one): the exception that a
        preemption or an interrupt raises through ``train()`` afterwards is not a failure of the
        run. Best effort: an unreadable ``run.json`` or a failed write is logged, never raised, so
        it cannot hide how the run ended. ``details`` must be JSON values (a path is written as text).

        Args:
            state: one of :data:`END_STATES`.
            details: what a reader needs besides (``error=`` the exception's type, ``checkpoint=``...).
        """
        if state not in END_STATES:
            raise ValueError(f"Expected an end state in {END_STATES}. Received: {state!r}")
        try:
            record = json.loads(self.run_json.read_text())
        except (OSError, ValueError) as exc:
            log.warning("run.json not updated with the run's end (%s): %s", state, exc)
            return False
        if not isinstance(record, dict) or record.get("end") is not None:
            return False
        record["end"] = {"state": state, "time": datetime.now(timezone.utc).isoformat(timespec="seconds"), **details}
        try:
            self.write_run_record(record)
        except (OSError, TypeError, ValueError) as exc:  # a full disk; a detail that is no JSON value
            log.warning("run.json not updated with the run's end (%s): %s", state, exc)
            return False
        return True

    @contextlib.contextmanager
    def recording_end(self) -> Iterator[None]:
        """Records ``finished`` when the block ends, ``failed`` (with the error's type) when it
        raises an ``Exception``; an interrupt or a preemption is recorded where it is handled
        (driver/display.py), and the first end recorded stands."""
        try:
            yield
        except Exception as exc:
            self.record_end("failed", error=type(exc).__name__)
            raise
        self.record_end("finished")

    def end_state(self) -> dict[str, Any] | None:
        """``run.json``'s ``end`` (``state``, ``time`` and the details), or None: the run has not
        ended, or it was killed (SIGKILL, a lost machine) before it could say so, or there is no
        readable ``run.json``."""
        try:
            end = json.loads(self.run_json.read_text()).get("end")
        except (OSError, ValueError, AttributeError):
            return None
        return end if isinstance(end, dict) and isinstance(end.get("state"), str) else None

    def record_background_failures(self, failures: list[dict[str, str]]) -> bool:
        """Append ``failures`` to ``run.json``'s ``background_failures`` (run/background.py), atomically.

        Best effort, like :meth:`record_end`: a failure to record is logged, never raised (the
        warning that reported the failure has been given already)."""
        try:
            record = json.loads(self.run_json.read_text())
            if not isinstance(record, dict):
                raise ValueError("run.json holds no JSON object")
            record["background_failures"] = [*record.get("background_failures", []), *failures]
            self.write_run_record(record)
        except (OSError, ValueError, TypeError) as exc:
            log.warning("run.json not updated with %d background failure(s): %s", len(failures), exc)
            return False
        return True

    # -- join.json -------------------------------------------------------------------------
    def write_join_info(self, address: tuple[str, int], secret: bytes) -> None:
        """Where a worker started by hand connects, readable by this user only (it holds the secret)."""
        info = {"driver": f"{address[0]}:{address[1]}", "secret": secret.hex()}
        write_private(self.join_json, json.dumps(info).encode())

    def remove_join_info(self) -> None:
        self.join_json.unlink(missing_ok=True)

    def read_join_info(self) -> tuple[tuple[str, int], bytes] | None:
        """The address and secret in ``join.json``, which only a driver that vanished leaves
        behind (its workers may wait there); None where there is none or it is unreadable."""
        try:
            info = json.loads(self.join_json.read_text())
            host, _, port = str(info["driver"]).rpartition(":")
            return (host, int(port)), bytes.fromhex(str(info["secret"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def atomic_write(path: Path, write: Callable[[IO[bytes]], Any], *, mode: int = 0o666) -> Path:
    """Write ``path`` so that a reader sees the old file or the whole new one, never a part.

    ``write`` fills a temporary file in the same directory (``.<name>.<pid>.tmp``, so the
    leftovers of a dead writer can be told from a live one's); it is fsynced, renamed over
    ``path``, and the directory fsynced so the rename survives a power loss. On an exception
    the temporary file is removed and the exception propagates; a killed writer leaves it.

    Args:
        path: the final file.
        write: called with the temporary file, opened for binary writing.
        mode: permissions of the new file (before the umask).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)
    return path


def write_private(path: Path, data: bytes) -> Path:
    """Write a file that holds a secret (``join.json``): mode 0600, whole or not at all.

    Unlike :func:`atomic_write`, whose temporary name is predictable, the temporary file has a
    random name and is created exclusively (``O_EXCL``, ``O_NOFOLLOW``): a file or symlink
    planted in the directory is never opened, so the secret neither lands in a file that keeps
    its planter's permissions nor is written through a link. It is fsynced and renamed over
    ``path`` (a symlink there is replaced, its target untouched).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # whatever the umask
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)
    return path


def atomic_write_path(path: Path, write: Callable[[Path], Any], *, suffix: str = "") -> Path:
    """:func:`atomic_write` for writers that want a file name, not a stream (``keras.Model.save``).

    ``write`` is given a temporary path in the same directory, ending in ``suffix`` (Keras
    insists on ``.keras``); it is fsynced and renamed over ``path``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{suffix}")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)
    return path


def fsync_directory(directory: Path) -> None:
    """Make the directory's entries (a rename into it) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
