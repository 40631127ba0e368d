"""Which frozen parameters still hold the job's values (docs/architecture.md, "State that does not change").

A parameter with ``requires_grad=False`` (a LoRA base, a frozen encoder) is the same in every
worker and in the driver: each has it from the job. Snapshots, checkpoint uploads, joins and the
final state leave such a parameter out, and fingerprints read it once, while it *provably*
still holds the value it had when this worker set up (or last loaded the driver's): the same
tensor under its name, still not requiring a gradient, its version counter unchanged (every
in-place operation on it counts), and a sample of its elements unchanged (which catches
writes through ``.data``, which the version counter does not see). Any of these failing makes
the parameter travel like any trained one from then on.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch

from ...step.digest import state_fingerprint

#: Elements of each frozen tensor compared at every check (evenly spaced over the tensor).
SAMPLE = 64


class FrozenParameters:
    """The job's frozen parameters of ``model`` (by state_dict name) that are unchanged."""

    def __init__(self, model: torch.nn.Module, names: Collection[str]) -> None:
        self.model = model
        self._held: dict[str, tuple[torch.Tensor, int, int, torch.Tensor]] = {}
        self._prints: dict[str, int] = {}  # fingerprints of held names, read once
        self.baseline(names)

    def baseline(self, names: Iterable[str]) -> None:
        """``names`` hold the job's values now (set-up, or the driver's values just loaded)."""
        state = self.model.state_dict(keep_vars=True)
        for name in names:
            tensor = state.get(name)
            if isinstance(tensor, torch.nn.Parameter) and not tensor.requires_grad:
                self._held[name] = (tensor, tensor._version, tensor.data_ptr(), _sample(tensor))
                self._prints.pop(name, None)

    def unchanged(self) -> set[str]:
        """The names still holding the job's values; the others are dropped for good."""
        if not self._held:
            return set()
        state = self.model.state_dict(keep_vars=True)
        changed = [
            name
            for name, (tensor, version, pointer, sample) in self._held.items()
            if state.get(name) is not tensor
            or tensor.requires_grad
            or tensor._version != version
            or tensor.data_ptr() != pointer
            or not torch.equal(_sample(tensor), sample)
        ]
        for name in changed:
            del self._held[name]
            self._prints.pop(name, None)
        return set(self._held)

    def fingerprints(self) -> dict[str, int]:
        """``model/<name>`` fingerprints of the held names (as at the last check), each read once."""
        for name in self._held.keys() - self._prints.keys():
            self._prints[name] = state_fingerprint({name: self._held[name][0].detach()}, "model")[f"model/{name}"]
        return {f"model/{name}": self._prints[name] for name in self._held}

    def __contains__(self, name: object) -> bool:
        return name in self._held

    @property
    def names(self) -> set[str]:
        """The names held as unchanged at the last check (no new check)."""
        return set(self._held)


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    if flat.numel() <= SAMPLE:
        return flat.clone()
    step = flat.numel() // SAMPLE
    return flat[::step][:SAMPLE].clone()


def frozen_names(model: torch.nn.Module) -> tuple[str, ...]:
    """The state_dict names of ``model``'s parameters that do not require a gradient."""
    return tuple(
        name
        for name, tensor in model.state_dict(keep_vars=True).items()
        if isinstance(tensor, torch.nn.Parameter) and not tensor.requires_grad
    )
