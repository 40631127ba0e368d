"""Errors that cross from workers to the caller."""

from __future__ import annotations

import cloudpickle


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback; set as ``__cause__`` of the re-raised error."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text


class WorkerError(RuntimeError):
    """A worker failed in a way that has no user exception to re-raise (a crash, a lost link)."""


class JobError(RuntimeError):
    """The job could not start or could not go on (no worker left, a start that timed out)."""


def encode_exception(exc: BaseException) -> bytes | None:
    """The exception, pickled so the caller can re-raise its own type; None if it won't pickle."""
    try:
        data = cloudpickle.dumps(exc)
        cloudpickle.loads(data)  # some exceptions pickle but do not unpickle (required args)
        return data
    except Exception:
        return None


def rebuild_exception(data: bytes | None, traceback_text: str, worker: str) -> BaseException:
    """The exception to raise in the caller: the user's own type, caused by the worker traceback."""
    remote = RemoteTraceback(f'"""\n{worker} failed:\n{traceback_text}"""')
    exc: BaseException | None = None
    if data is not None:
        try:
            exc = cloudpickle.loads(data)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        last = traceback_text.strip().splitlines()[-1] if traceback_text.strip() else "unknown error"
        exc = WorkerError(f"{worker} failed: {last}")
    exc.__cause__ = remote
    return exc
