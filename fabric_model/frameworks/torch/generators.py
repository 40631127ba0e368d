"""The ``torch.Generator`` objects a model owns, seeded per micro-batch as torch's global one is.

A model may draw its noise from a generator of its own (``torch.randn(..., generator=self.noise)``)
instead of torch's global one. Its state would then advance with every micro-batch the worker
ran, and the noise a micro-batch gets would depend on how many workers share the step. Before
every micro-batch each owned generator is seeded from the micro-batch's seed and its attribute
path (:func:`~fabric_model.step.plan.generator_seed`): the draws are a function of the micro-batch
alone (docs/architecture.md, "The step"). Found once, when the worker sets up: a generator the
model assigns later is not seeded.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ...step import sample_seeds
from ...step.plan import generator_seed


def _generators_in(value: Any, name: str) -> Iterator[tuple[str, torch.Generator]]:
    if isinstance(value, torch.Generator):
        yield name, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if isinstance(item, torch.Generator):
                yield f"{name}.{i}", item
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, torch.Generator):
                yield f"{name}.{key}", item


def owned_generators(model: torch.nn.Module) -> list[tuple[str, torch.Generator]]:
    """``(path, generator)`` for every generator held by the model's modules (as an attribute, or
    in a list, tuple or dict attribute), in module order; one shared by several modules once."""
    found: list[tuple[str, torch.Generator]] = []
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for attribute, value in vars(module).items():
            path = f"{module_name}.{attribute}" if module_name else attribute
            for name, generator in _generators_in(value, path):
                if id(generator) not in seen:
                    seen.add(id(generator))
                    found.append((name, generator))
    return found


class OwnedGenerators:
    """The model's own generators, each seeded before a micro-batch (:meth:`seed`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.generators = owned_generators(model)

    def __bool__(self) -> bool:
        return bool(self.generators)

    def seed(self, seed: int) -> None:
        for name, generator in self.generators:
            generator.manual_seed(generator_seed(seed, name))


def _global_state() -> bytes:
    return torch.default_generator.get_state().numpy().tobytes()


def read_generators(dataset: Any) -> list[sample_seeds.Generator]:
    """The torch generators a read of ``dataset`` may draw from (step/sample_seeds.py): torch's
    global one, contended (dropout draws from it on the training thread), and each
    ``torch.Generator`` the dataset holds, which only its reads use."""
    found = [sample_seeds.Generator("torch", torch.default_generator.manual_seed, _global_state, contended=True)]
    for path, generator in sample_seeds.held_by(dataset, (torch.Generator,)):
        found.append(sample_seeds.Generator(f"dataset.{path}", generator.manual_seed))
    return found
