"""The job's frozen parameters as the driver holds them: what uploads leave out and the driver
fills back in (docs/architecture.md, "State that does not change").

A parameter that needs no gradient (a LoRA base, a frozen encoder) is in the job every worker
receives and in the user's model in the caller, and keeps those values while no step changes
it. Workers leave it out of snapshots, checkpoint uploads, joins and the final state
(``frameworks/torch/frozen.py`` says when they may); the driver puts its own copy back, a
reference to the user's tensor, so a checkpoint on disk, a rollback's state and ``model.pt``
stay complete, loadable without fabric_model.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: A record's key naming what its model state left out (a worker's upload) ...
OMITTED = "omitted"
#: ... and, once the driver filled them in, the names that hold the job's values: a worker that
#: still holds those values itself need not load them (``FrameworkAdapter.load_sent_state``).
BASE = "base"


class FrozenBase:
    """The job's frozen tensors by state_dict name (the user's own, not copies), in the model's order."""

    def __init__(self, tensors: Mapping[str, Any], order: list[str]) -> None:
        self._tensors = dict(tensors)
        self._order = order

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name in self._order if name in self._tensors)

    def __bool__(self) -> bool:
        return bool(self._tensors)

    def fill(self, record: dict[str, Any]) -> dict[str, Any]:
        """``record`` (a worker's upload) complete: its model state with the names it left out put
        back from the job's values, which :data:`BASE` then names."""
        omitted = record.pop(OMITTED, None)
        if not omitted:
            return record
        record["model"] = self.complete(record["model"], omitted)
        record[BASE] = sorted(omitted)
        return record

    def complete(self, model_state: dict[str, Any], omitted: Any) -> dict[str, Any]:
        """``model_state`` with the job's values of ``omitted``, in the model's order."""
        unknown = set(omitted) - self._tensors.keys()
        if unknown:
            raise ValueError(f"a state left out {sorted(unknown)[:5]}, which are not the job's frozen parameters")
        merged = {**model_state, **{name: _on_cpu(self._tensors[name]) for name in omitted}}
        ordered = {name: merged[name] for name in self._order if name in merged}
        return {**ordered, **{k: v for k, v in merged.items() if k not in ordered}}

    def without_changed(self, checkpoint: Path) -> FrozenBase:
        """A resumed run: only the names whose values in ``checkpoint`` are the job's (read once);
        a script that builds its frozen part anew each time (no seed) has its checkpoint's travel."""
        import torch

        if not self._tensors:
            return self
        saved = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)["model"]
        same = {
            name: tensor
            for name, tensor in self._tensors.items()
            if name in saved and torch.equal(saved[name], _on_cpu(tensor))
        }
        if len(same) < len(self._tensors):
            log.info(
                "%d frozen parameter(s) differ from %s (the model was built anew): they travel with every state",
                len(self._tensors) - len(same),
                checkpoint.name,
            )
        return FrozenBase(same, self._order)


def _on_cpu(tensor: Any) -> Any:
    return tensor if tensor.device.type == "cpu" else tensor.cpu()
