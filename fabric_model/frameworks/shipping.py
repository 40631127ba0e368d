"""How a job travels to the workers: cloudpickle, with each function's code keeping its file and
each loaded framework's own reductions (:mod:`.torch.shipping` for torch)."""

from __future__ import annotations

import io
import sys
import types
from collections import ChainMap
from collections.abc import Callable
from typing import Any

import cloudpickle

from ..setup.job import Job


def dumps(job: Job) -> bytes:
    """``job`` cloudpickled, its functions' code keeping the file it came from.

    cloudpickle >= 3.1.3 writes ``<dynamic-code>`` as the file of every function it sends by
    value (a script's ``__main__`` functions): a worker's traceback then shows neither the
    user's file nor the failing line. The worker reads the result with plain ``pickle``."""
    return dump_object(job)


def dump_object(obj: Any) -> bytes:
    """``obj`` pickled as a part of a job is."""
    buffer = io.BytesIO()
    JobPickler(buffer).dump(obj)
    return buffer.getvalue()


def _code_at(constructor: Callable[..., types.CodeType], args: tuple[Any, ...], filename: str) -> types.CodeType:
    """A code object rebuilt as cloudpickle rebuilds it, with its original file."""
    return constructor(*args).replace(co_filename=filename)


_cloudpickle_code_reduce = cloudpickle.Pickler.dispatch_table[types.CodeType]


def _code_reduce(code: types.CodeType) -> tuple[Any, ...]:
    constructor, args = _cloudpickle_code_reduce(code)
    return _code_at, (constructor, args, code.co_filename)


def _framework_reducers() -> list[Callable[[Any], Any]]:
    """The frameworks' own reductions, for the objects pickle refuses or loses (torch's parametrized
    and compiled modules). Only a loaded framework can have made such an object, so none is imported."""
    if "torch" not in sys.modules:
        return []
    from .torch.shipping import reduce

    return [reduce]


class JobPickler(cloudpickle.Pickler):
    """cloudpickle's pickler, with code objects keeping their file and the frameworks' own reductions."""

    # Read when the pickler is made; nested code objects (closures, comprehensions) come here too.
    dispatch_table = ChainMap({types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table)

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self._reducers = _framework_reducers()

    def reducer_override(self, obj: Any) -> Any:
        # Asked for every object but the atomic ones, before any other way of pickling it.
        for reducer in self._reducers:
            reduced = reducer(obj)
            if reduced is not NotImplemented:
                return reduced
        return super().reducer_override(obj)
