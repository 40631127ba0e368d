"""IBM's ``pth_parameter_mgr``, from values given to ``fabric-model run --param/--params``.

WMLA's web UI wrote a ``pth_parameter_mgr.py`` beside the model folder from the form the user
filled in (data sets, optimizer, learning rate and its policy, epochs, batch sizes), and its
PyTorch samples ``import pth_parameter_mgr`` from ``<--train_dir>/../``. There is no UI here:
``fabric-model run --param epochs=2 --param train_batch_size=64 --param learning_rate=0.01
SCRIPT`` (or ``--params FILE.json``) gives the same values. The runtime checks them before the
script runs and passes them to every process in a JSON file; ``ibm/fallback/pth_parameter_mgr.py``
answers from it. A user's own ``pth_parameter_mgr.py`` wins (the fallback is last on
``sys.path``); with no values and no file of the user's, importing it fails with what to pass.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..settings.registry import DATA_DIR, UI_PARAMETERS

MODULE = "pth_parameter_mgr"
OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop", "adagrad", "adadelta")
LR_POLICIES = ("fixed", "step", "multistep", "exp")


def _positive_int(text: Any) -> int:
    value = int(text)
    if value < 1 or value != float(text):
        raise ValueError(text)
    return value


def _non_negative(text: Any) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise ValueError(text)
    return value


def _choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(text: Any) -> str:
        value = str(text).strip().lower()
        if value not in options:
            raise ValueError(text)
        return value

    return parse


def _milestones(text: Any) -> list[int]:
    items = text if isinstance(text, list) else [t for t in str(text).split(",") if t.strip()]
    return [_positive_int(t) for t in items]


# name -> (parser, what it accepts)
SPEC: dict[str, tuple[Callable[[Any], Any], str]] = {
    "train_data": (str, "a directory (default: $DATA_DIR)"),
    "test_data": (str, "a directory (default: train_data)"),
    "epochs": (_positive_int, "a positive integer"),
    "train_batch_size": (_positive_int, "a positive integer"),
    "test_batch_size": (_positive_int, "a positive integer (default: train_batch_size)"),
    "optimizer": (_choice(OPTIMIZERS), f"one of {', '.join(OPTIMIZERS)} (default: sgd)"),
    "learning_rate": (_non_negative, "a non-negative number"),
    "momentum": (_non_negative, "a non-negative number (default: 0)"),
    "weight_decay": (_non_negative, "a non-negative number (default: 0)"),
    "lr_policy": (_choice(LR_POLICIES), f"one of {', '.join(LR_POLICIES)} (default: fixed)"),
    "step_size": (_positive_int, "a positive integer, epochs between decays (lr_policy step)"),
    "milestones": (_milestones, "comma-separated epochs (lr_policy multistep)"),
    "gamma": (_non_negative, "a non-negative number, the decay factor (default: 0.1)"),
}
HOW = (
    "pass the values the WMLA UI held to fabric-model run, before the script: "
    "--param epochs=2 --param train_batch_size=64 --param learning_rate=0.01 ... "
    f'(or --params FILE.json); names: {", ".join(SPEC)} (docs/ibm-migration.md, "pth_parameter_mgr")'
)


def check(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` parsed and checked; raises ValueError naming the parameter, the value and what is accepted."""
    checked = {}
    for name, value in values.items():
        if name not in SPEC:
            raise ValueError(f"unknown {MODULE} parameter {name!r}; accepted: {', '.join(SPEC)}")
        parse, accepted = SPEC[name]
        try:
            checked[name] = parse(value)
        except (TypeError, ValueError):
            raise ValueError(f"{MODULE} parameter {name}: expected {accepted}, received {value!r}") from None
    return checked


def from_arguments(pairs: Iterable[str], files: Iterable[str]) -> dict[str, Any]:
    """The checked values of ``--params FILE`` (JSON objects, in order) then ``--param NAME=VALUE`` (later wins)."""
    values: dict[str, Any] = {}
    for file in files:
        try:
            loaded = json.loads(Path(file).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"--params {file}: expected a JSON object of {MODULE} values; {exc}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"--params {file}: expected a JSON object, received a {type(loaded).__name__}")
        values.update(loaded)
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--param: expected NAME=VALUE, received {pair!r}")
        values[name.strip()] = value
    return check(values)


def save(values: dict[str, Any], path: Path) -> Path:
    """Write ``values`` for the script's processes and point them at it (``_FABRIC_MODEL_UI_PARAMETERS``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(values, indent=1), encoding="utf-8")
    os.environ[UI_PARAMETERS.name] = str(path)
    return path


class UiParameters:
    """The values behind ``pth_parameter_mgr``'s functions (IBM's names, in the fallback module)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    @classmethod
    def loaded(cls) -> UiParameters:
        """The values ``fabric-model run`` saved; ModuleNotFoundError (naming the module) when none were given."""
        path = UI_PARAMETERS.get()
        if not path:
            raise ModuleNotFoundError(
                f"No module named {MODULE!r}: it is the module WMLA's web UI generated beside the model "
                f"folder, and no file of that name was found on sys.path; {HOW}",
                name=MODULE,
            )
        return cls(check(json.loads(Path(path).read_text(encoding="utf-8"))))

    def require(self, name: str, caller: str) -> Any:
        if name not in self.values:
            raise ValueError(f"{MODULE}.{caller}() needs {name!r}, which was not given: --param {name}=... ({HOW})")
        return self.values[name]

    def data(self, name: str, full_list: bool) -> Any:
        folder = self.values.get(name) or (self.values.get("train_data") if name == "test_data" else None)
        folder = folder or DATA_DIR.get() or os.getcwd()
        if not full_list:
            return folder
        return sorted(str(p) for p in Path(folder).rglob("*") if p.is_file())

    def optimizer(self, model: Any) -> Any:
        import torch

        lr = self.require("learning_rate", "getOptimizer")
        kind, decay = self.values.get("optimizer", "sgd"), self.values.get("weight_decay", 0.0)
        params = model.parameters()
        momentum = self.values.get("momentum", 0.0)
        if kind == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=decay)
        if kind == "rmsprop":
            return torch.optim.RMSprop(params, lr=lr, momentum=momentum, weight_decay=decay)
        classes = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "adagrad": torch.optim.Adagrad}
        classes["adadelta"] = torch.optim.Adadelta
        return classes[kind](params, lr=lr, weight_decay=decay)

    def scheduler(self, optimizer: Any) -> Any:
        import torch

        policy, gamma = self.values.get("lr_policy", "fixed"), self.values.get("gamma", 0.1)
        if policy == "step":
            return torch.optim.lr_scheduler.StepLR(optimizer, self.require("step_size", "getLearningRate"), gamma)
        if policy == "multistep":
            return torch.optim.lr_scheduler.MultiStepLR(optimizer, self.require("milestones", "getLearningRate"), gamma)
        if policy == "exp":
            return torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma)
        return torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)  # picklable, unlike a lambda
