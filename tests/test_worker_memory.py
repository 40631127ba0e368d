"""A worker keeps the memory its steps free for the next step, so steps do not fault pages in
(docs/architecture.md, "Worker memory")."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fabric_model import Callback, FabricModel
from fabric_model.settings.registry import KEEP_FREED_MEMORY

from .helpers import make_data, started_processes

pytestmark = pytest.mark.processes

KEEP_FREED_MEMORY_ENV = KEEP_FREED_MEMORY.name

#: A 64 MiB buffer: over glibc's largest dynamic mmap threshold (32 MiB), so by default each
#: one is mapped, faulted in page by page (16,384 pages) and unmapped.
BIG = 64 << 20
PAGES = BIG >> 12


class BigActivation(nn.Module):
    """A classifier whose forward also fills a 64 MiB temporary, as a conv net's activations do."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scratch = torch.empty(BIG // 4).fill_(1.0)  # every page written
        return self.linear(x) + scratch[0] * 0


class PageFaults(Callback):
    """Records the worker's minor page faults at the end of each step."""

    def __init__(self, out: Path) -> None:
        self.out, self.faults = str(out), []

    def on_batch_end(self, step: int) -> None:
        self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)

    def on_train_end(self) -> None:
        Path(self.out).write_text(json.dumps(self.faults))


def _train_and_count_faults(run_dir: Path, out: Path) -> list[int]:
    torch.manual_seed(0)
    model = BigActivation()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fm = FabricModel(model, lambda: (make_data(128), None), F.cross_entropy, opt, user_callback=[PageFaults(out)])
    fm.train(2, 16, 1, run_dir=run_dir)  # 16 steps of one worker
    faults = json.loads(out.read_text())
    assert len(faults) == 16
    return faults


@pytest.mark.parametrize("setting", [None, "0"], ids=["default", "off"])
def test_a_workers_steps_reuse_freed_memory_instead_of_faulting_it_in_again(setting, run_dir, tmp_path, monkeypatch):
    if setting is not None:
        monkeypatch.setenv(KEEP_FREED_MEMORY_ENV, setting)
    faults = _train_and_count_faults(run_dir, tmp_path / "faults.json")
    per_step = (faults[-1] - faults[5]) / 10
    if setting is None:  # after the first steps, far less than the temporary's pages
        assert per_step < PAGES / 4, faults
    else:  # glibc's defaults: all of them, every step
        assert per_step > PAGES * 0.9, faults


def test_a_bad_setting_fails_before_any_worker_starts(run_dir, monkeypatch):
    model = BigActivation()
    fm = FabricModel(model, lambda: (make_data(16), None), F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
    monkeypatch.setenv(KEEP_FREED_MEMORY_ENV, "yes")
    expected = f"{KEEP_FREED_MEMORY_ENV} to be 1 .* or 0 .*Received: {KEEP_FREED_MEMORY_ENV}='yes'"
    with pytest.raises(ValueError, match=expected):
        fm.train(1, 16, 1, run_dir=run_dir)
    assert started_processes() == []
