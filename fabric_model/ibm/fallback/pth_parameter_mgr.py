"""IBM's UI-generated ``pth_parameter_mgr``, answering from ``fabric-model run --param/--params``.

Importing it without such values fails, saying what to pass (fabric_model/ibm/ui_parameters.py).
"""

from __future__ import annotations

from typing import Any

from fabric_model.ibm.ui_parameters import UiParameters

_values = UiParameters.loaded()


def getTrainData(full_list: bool = True) -> Any:  # noqa: N802 (IBM's names, here and below)
    """The training data folder (``full_list=False``) or the sorted paths of every file in it."""
    return _values.data("train_data", full_list)


def getTestData(full_list: bool = True) -> Any:  # noqa: N802
    """The test data folder (``full_list=False``) or the sorted paths of every file in it."""
    return _values.data("test_data", full_list)


def getEpoch() -> int:  # noqa: N802
    return int(_values.require("epochs", "getEpoch"))


def getTrainBatchSize() -> int:  # noqa: N802
    return int(_values.require("train_batch_size", "getTrainBatchSize"))


def getTestBatchSize() -> int:  # noqa: N802
    if "test_batch_size" in _values.values:
        return int(_values.values["test_batch_size"])
    return int(_values.require("train_batch_size", "getTestBatchSize"))


def getOptimizer(model: Any) -> Any:  # noqa: N802
    """A torch optimizer over ``model``'s parameters: ``optimizer``, ``learning_rate``,
    ``momentum``, ``weight_decay``."""
    return _values.optimizer(model)


def getLearningRate(optimizer: Any) -> Any:  # noqa: N802
    """A torch LR scheduler for ``optimizer``: ``lr_policy`` (fixed, step, multistep, exp),
    ``step_size``, ``milestones``, ``gamma``."""
    return _values.scheduler(optimizer)
