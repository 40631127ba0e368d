"""A job's identity: one digest for each part of what the caller ships, so that a restarted
driver knows whether the workers that waited for it run the job its command built.

A worker keeps the identity of the job it received and says it when it comes back to a
restarted driver (:class:`~fabric_model.transport.protocol.Held`). The driver compares it with
its own: the parts that differ are named on the console, and the workers do not go on with
the old code (docs/elasticity.md, "A lost driver"; driver/take_back.py).

What a digest covers: everything pickled with the job (classes and functions by value or by
name, their code and the values they capture), but tensors and arrays only by shape, dtype and
whether they train, never their values: the model's initial weights differ from run to run
unless the script seeds them, and the state the workers hold replaces them anyway, under the
rule of a resume from a checkpoint (same names and shapes). Sets are taken in sorted order, so
the digest does not depend on the process's hash seed. Code counts by what it does (bytecode,
constants, names), not where it stands; Keras objects by class, config without names, and
variable shapes (their own pickling is an archive with the save's date and object ids).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import types
from collections import ChainMap
from collections.abc import Mapping
from typing import Any

import cloudpickle

from ..frameworks.shipping import JobPickler
from ..setup.job import Job
from ..state.layouts import layout_for

#: The parts of a job, as the console names them.
MODEL = "the model, loss, metrics and optimizer"
DATA = "datasets_function"
CALLBACKS = "the callbacks and loggers"
SCHEDULE = "the learning-rate schedule"
ARGUMENTS = "train()'s arguments"
PLAN = "the plan (samples, batch sizes, seed)"
#: Not a digest: the state layout in clear ("sharded" or "replicated": state/layouts.py), which
#: says whether one member can hand over the whole state.
LAYOUT = "state layout"

#: TrainConfig fields that say how a run is operated, not what it trains: left out of its digest.
_OPERATIONAL = (
    "timeouts",
    "snapshots",
    "preemption",
    "profile",
    "num_dataloader_threads",
    "num_dataloader_processes",
    "keep_freed_memory",
)

Identity = dict[str, str]


def _class_tracker_ids() -> Mapping[str, Any]:
    """The ids cloudpickle gave, in this process, the classes it pickles by value (its own
    registry, read live: a class gets its id as it is first pickled)."""
    tracker: Mapping[str, Any] = getattr(cloudpickle.cloudpickle, "_DYNAMIC_CLASS_TRACKER_BY_ID", {})
    return tracker


def _code_identity(code: types.CodeType) -> tuple[Any, ...]:
    """A code object by what it does, not where it stands: its bytecode, constants (nested code
    included) and names, without its file, line numbers or column positions, which moving the code
    in its file, or a test runner recompiling the module (pytest's assertion rewriting), changes."""
    what = (
        code.co_code,
        code.co_consts,
        code.co_names,
        code.co_varnames,
        code.co_freevars,
        code.co_cellvars,
        code.co_argcount,
        code.co_posonlyargcount,
        code.co_kwonlyargcount,
        code.co_flags,
        code.co_name,
    )
    return tuple, (what,)


class _DigestPickler(JobPickler):
    """Pickles as the job is shipped, with tensors, arrays and sets replaced by what identifies
    them (the module docstring)."""

    dispatch_table = ChainMap({types.CodeType: _code_identity}, JobPickler.dispatch_table)

    def reducer_override(self, obj: Any) -> Any:
        if _is_keras(obj):  # its own pickling is a saved archive: dates, object ids, the weights' bytes
            # Each as one new string: a pickle refers back to an object it has written once, and
            # whether two equal dtype strings are one object depends on what the process ran
            # before (a test runner that trained other models had them interned; a script not).
            return tuple, ((type(obj), _keras_config(obj), json.dumps(_variable_shapes(obj))),)
        return super().reducer_override(obj)

    def persistent_id(self, obj: Any) -> Any:  # noqa: PLR0911 - one return per kind
        kind = type(obj)
        if kind is str and obj in _class_tracker_ids():
            # cloudpickle names a class it sends by value (one a script defines) with a random id
            # per process, so that one process's copies unpickle as one class: not the class's.
            return ("class tracker id",)
        if isinstance(obj, (set, frozenset)):
            return ("set", tuple(sorted(repr(x) for x in obj)))
        module = kind.__module__
        if module.startswith("torch") and hasattr(obj, "shape") and hasattr(obj, "dtype"):
            return ("tensor", tuple(obj.shape), str(obj.dtype), bool(getattr(obj, "requires_grad", False)))
        if module == "numpy" and hasattr(obj, "shape") and hasattr(obj, "dtype") and getattr(obj, "ndim", 0) > 0:
            return ("array", tuple(obj.shape), str(obj.dtype))
        return None


def _is_keras(obj: Any) -> bool:
    """A Keras 3 or tf-keras object with a config (a model, layer, optimizer, loss, metric)."""
    if isinstance(obj, type) or not hasattr(obj, "get_config"):
        return False
    return any(c.__module__.startswith(("keras", "tf_keras")) for c in type(obj).__mro__)


def _keras_config(obj: Any) -> str:
    """A Keras object's config as canonical JSON, without what differs between two builds of the
    same script: names (``dense_4`` where another model was built first) and object ids."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("name", "shared_object_id")}
        if isinstance(value, (list, tuple)):
            return [strip(v) for v in value]
        return value

    try:
        config = obj.get_config()
    except Exception:  # a subclassed model without get_config: its class (by value) and variables say it
        config = {}
    return json.dumps(strip(config), sort_keys=True, default=lambda o: type(o).__qualname__)


def _variable_shapes(obj: Any) -> list[tuple[tuple[int, ...], str]]:
    """The shapes and dtypes of a Keras object's variables (a model's weights, an optimizer's slots)."""
    try:
        variables = list(getattr(obj, "variables", None) or getattr(obj, "weights", None) or [])
    except Exception:
        return []
    return [(tuple(int(d) for d in v.shape), str(v.dtype)) for v in variables]


def digest(obj: Any) -> str:
    """The digest of ``obj`` as a part of a job (the module docstring); "unknown" when it cannot
    be pickled that way (it differs from any other, so the job counts as changed)."""
    buffer = io.BytesIO()
    try:
        _DigestPickler(buffer).dump(obj)
    except Exception:  # the job itself pickled: only the digest's replacements can fail here
        return "unknown"
    return hashlib.sha256(buffer.getvalue()).hexdigest()[:32]


def identify(job: Job, config: Any, plan: Any) -> Identity:
    """The identity of ``job`` run with ``config`` (a TrainConfig) and ``plan``."""
    arguments = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in _OPERATIONAL}
    return {
        MODEL: digest(job.adapter.identity_view()),
        DATA: digest(job.get_datasets),
        CALLBACKS: digest(job.hooks),
        SCHEDULE: digest(job.lr_scheduling),
        ARGUMENTS: digest(arguments),
        PLAN: digest(dataclasses.asdict(plan)),
        LAYOUT: layout_for(config).name,
    }


def differences(ours: Identity, theirs: Identity) -> list[str]:
    """The parts of ``theirs`` (a returning worker's job) that differ from ``ours``; every part
    when ``theirs`` is empty (a worker of a release that did not say it)."""
    return [part for part in ours if theirs.get(part) != ours[part]]
