"""What the driver ships to every worker: one object, cloudpickled once (by
:mod:`fabric_model.frameworks.shipping`, which knows the frameworks' own reductions)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..run.hooks import Hooks


@dataclasses.dataclass
class Job:
    """The user's training setup as a worker receives it (cloudpickled as one object, so the
    optimizer keeps pointing at the model's own parameters after unpickling)."""

    adapter: Any  # a frameworks.base.FrameworkAdapter; typed loosely so this module imports nothing heavy
    get_datasets: Callable[[], tuple[Any, Any]]
    hooks: Hooks = dataclasses.field(default_factory=Hooks)  # the worker logger and user callbacks
    lr_scheduling: Any = None  # a loop_state.LRScheduling (its scheduler holds the adapter's optimizer)
