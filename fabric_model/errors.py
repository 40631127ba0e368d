"""Errors that cross from workers to the caller."""

from __future__ import annotations

import traceback
from pathlib import Path

import cloudpickle

_PACKAGE = str(Path(__file__).resolve().parent)


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


def user_traceback(exc: BaseException) -> str:
    """``exc``'s traceback from the user's first frame: the worker's own frames above it are
    dropped (the worker log keeps the full text), so what the user sees starts with their code."""
    te = traceback.TracebackException.from_exception(exc)
    frames = list(te.stack)
    outside = [i for i, f in enumerate(frames) if not f.filename.startswith(_PACKAGE)]
    # The user's own file rather than a library's (torch's Module.__call__ precedes a forward).
    own = [i for i in outside if "site-packages" not in frames[i].filename]
    first_user = (own or outside or [0])[0]
    te.stack = traceback.StackSummary.from_list(frames[first_user:])
    return "".join(te.format())


def rebuild_exception(data: bytes | None, traceback_text: str, worker: str) -> BaseException:
    """The exception to raise in the caller: the user's own type, caused by the worker traceback."""
    exc: BaseException | None = None
    if data is not None:
        try:
            exc = cloudpickle.loads(data)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        last = traceback_text.strip().splitlines()[-1] if traceback_text.strip() else "unknown error"
        exc = WorkerError(f"{worker} failed: {last}")
    else:  # the caller's traceback ends with the same "Type: message" lines: print them once
        tail = "".join(traceback.format_exception_only(type(exc), exc))
        if traceback_text.endswith(tail):
            traceback_text = traceback_text[: -len(tail)]
    exc.__cause__ = RemoteTraceback(f'"""\n{worker} failed:\n{traceback_text.rstrip()}\n"""')
    return exc
