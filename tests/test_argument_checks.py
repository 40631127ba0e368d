"""Every argument of ``FabricModel()`` and ``train()`` has its check, named in one table
(``fabric_model.setup.checks.ARGUMENT_CHECKS``): a new argument without one fails here."""

from __future__ import annotations

import importlib
import inspect

import pytest

from fabric_model import FabricModel
from fabric_model.setup.checks import ARGUMENT_CHECKS

SIGNATURES = {"FabricModel": FabricModel.__init__, "train": FabricModel.train}


@pytest.mark.parametrize("function", sorted(SIGNATURES))
def test_the_table_names_every_argument_once(function):
    parameters = [name for name in inspect.signature(SIGNATURES[function]).parameters if name != "self"]
    assert sorted(ARGUMENT_CHECKS[function]) == sorted(parameters)


def resolve(reference: str):
    module, _, path = reference.partition(":")
    target = importlib.import_module(module)
    for name in path.split("."):
        target = getattr(target, name)
    return target


@pytest.mark.parametrize(
    ("function", "argument", "reference"),
    [(f, a, r) for f, table in ARGUMENT_CHECKS.items() for a, r in table.items() if r],
)
def test_each_check_named_exists(function, argument, reference):
    assert callable(resolve(reference)), f"{function}({argument}=...): {reference} is not a function"
