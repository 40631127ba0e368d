"""Which part of a job cannot be pickled: the innermost object that fails on its own, named as the
user knows it (``model.encoder.log``, ``loss_function's variable 'lock'``), for the error
:func:`~fabric_model.orchestrator.run_setup.serialize_job` raises. Run only after the job failed to pickle."""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
import types
from collections.abc import Iterator
from typing import Any

from ..frameworks.shipping import dump_object
from ..setup.job import Job

#: How deep the search descends; a real model's culprit is a few attributes down.
MAX_DEPTH = 32

#: The job's fields the user gave under another name; ``adapter`` and ``hooks`` are ours, left out.
_FIELD_NAMES = {"get_datasets": "datasets_function", "lr_scheduling": "lr_scheduler"}
_OURS = ("adapter.", "hooks.")
#: The dicts in which a torch module keeps its submodules, parameters and buffers: their keys
#: are shown as the module's attributes.
_MODULE_DICTS = ("_modules", "_parameters", "_buffers")


@dataclasses.dataclass(frozen=True)
class Unpicklable:
    """The innermost part of a job that fails to pickle on its own."""

    path: str  # as the user names it
    obj: Any
    error: Exception  # what pickling it alone raised
    owner: Any = None  # the object it is an attribute of, if it is one
    attribute: str | None = None  # its attribute name in ``owner``

    def hint(self) -> str:
        """What to do about it: a framework's advice for its own objects, else the general one."""
        if "torch" in sys.modules:
            from ..frameworks.torch.shipping import unpicklable_hint

            hint = unpicklable_hint(self.obj, self.owner, self.attribute)
            if hint:
                return hint
        return (
            "objects holding open files, locks, sockets or threads cannot be sent; create them inside "
            "datasets_function or the logger's methods instead."
        )


def find_unpicklable(job: Job) -> Unpicklable | None:
    """The innermost part of ``job`` that fails to pickle on its own; None if every part pickles alone."""
    found: Unpicklable | None = None
    parts = list(_parts(job, ""))
    seen = {id(job)}
    for _ in range(MAX_DEPTH):
        for path, child, owner, attribute in parts:
            if id(child) in seen:
                continue
            seen.add(id(child))
            error = _pickle_error(child)
            if error is not None:
                found = Unpicklable(_shown(path), child, error, owner, attribute)
                parts = list(_parts(child, path))
                break
        else:
            break  # no part of the last one fails alone: it is the culprit
    return found


def _pickle_error(obj: Any) -> Exception | None:
    try:
        dump_object(obj)
    except Exception as exc:
        return exc
    return None


def _parts(obj: Any, path: str) -> Iterator[tuple[str, Any, Any, str | None]]:
    """(path, part, owner, attribute name) of what pickling ``obj`` pickles."""
    if isinstance(obj, dict):
        holder, _, last = path.rpartition(".")
        for key, value in obj.items():
            if last in _MODULE_DICTS and isinstance(key, str):
                yield _join(holder, key), value, None, key
            else:
                yield f"{path}[{key!r}]", value, None, None
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, value in enumerate(obj):
            yield f"{path}[{i}]", value, None, None
    elif isinstance(obj, types.FunctionType):
        yield from _function_parts(obj, path)
    elif isinstance(obj, types.MethodType):
        yield f"{path}.__self__", obj.__self__, None, None
        yield path, obj.__func__, None, None
    elif isinstance(obj, functools.partial):
        yield from ((f"{path}'s argument {i}", arg, None, None) for i, arg in enumerate(obj.args))
        yield from ((f"{path}'s argument {k!r}", arg, None, None) for k, arg in obj.keywords.items())
        yield path, obj.func, None, None
    elif not isinstance(obj, type) and isinstance(getattr(obj, "__dict__", None), dict):
        for name, value in vars(obj).items():
            yield _join(path, name), value, obj, name


def _function_parts(fn: types.FunctionType, path: str) -> Iterator[tuple[str, Any, Any, str | None]]:
    """The variables a function sent by value carries: its closure, the globals it names, its defaults."""
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            yield f"{path}'s variable {name!r}", cell.cell_contents, None, None
        except ValueError:  # an empty cell
            continue
    for name in fn.__code__.co_names:
        if name in fn.__globals__:
            yield f"{path}'s global {name!r}", fn.__globals__[name], None, None
    for i, default in enumerate(fn.__defaults__ or ()):
        yield f"{path}'s default {i}", default, None, None


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _shown(path: str) -> str:
    """``path`` as the user names it: ``adapter.model.fc`` is ``model.fc``, ``get_datasets`` ``datasets_function``."""
    for ours in _OURS:
        path = path.removeprefix(ours)
    head = re.match(r"\w*", path).group()  # type: ignore[union-attr]  # \w* always matches
    return _FIELD_NAMES.get(head, head) + path[len(head) :]
