"""A user error that every member raises at the same step fails the job at once, quietly; one
worker's error at one step is still a lost worker (docs/architecture.md, "User errors")."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from fabric_model import FabricModel

from .helpers import MLP, make_data, records

pytestmark = pytest.mark.processes

DATA = make_data(240)  # batch 8, 2 engines: 15 steps an epoch


class FailingAtStep5(MLP):
    """Its forward raises at global step 5: on every worker, or only on worker ``worker``."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker

    def forward(self, x):
        from fabric_model import worker_context

        ctx = worker_context()
        if ctx is not None and ctx.global_step == 5 and self.worker in (None, ctx.worker_id):
            raise ValueError("forward cannot take step 5")  # the user's line
        return super().forward(x)


def test_the_same_forward_error_on_every_worker_fails_at_once_without_a_rollback(run_dir, capfd, caplog):
    model = FailingAtStep5()
    fm = FabricModel(model, lambda: (DATA, None), F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
    began = time.monotonic()
    with pytest.raises(ValueError, match="forward cannot take step 5") as info:
        fm.train(2, 8, 2, seed=3, run_dir=run_dir)
    took = time.monotonic() - began
    cause = str(info.value.__cause__)
    assert 'raise ValueError("forward cannot take step 5")' in cause  # the user's line, in their traceback
    assert cause.count("forward cannot take step 5") == 1, cause  # once
    out, err = capfd.readouterr()
    for noise in ("rolling back", "no worker holds the state", "generation 1", "redoing"):
        assert noise not in out + err, (noise, out, err)
    assert "rolling back" not in caplog.text  # what the screen would show, were pytest not logging
    assert len(records(run_dir, "generation")) == 1  # no second generation
    driver_log = (run_dir / "logs" / "driver.log").read_text()
    assert "rolling back" not in driver_log and "generation 1:" not in driver_log
    assert took < 30, took  # set-up and 5 steps; no recovery waits


def test_an_error_on_one_worker_at_one_step_loses_that_worker_and_training_goes_on(run_dir, monkeypatch):
    monkeypatch.setenv("EDT_REPLACE_WORKERS", "0")  # the other worker finishes alone
    model = FailingAtStep5(worker=0)
    fm = FabricModel(model, lambda: (DATA, None), F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
    result = fm.train(2, 8, 2, seed=3, run_dir=run_dir)
    assert result is not None
    sizes = [g["workers"] for g in records(run_dir, "generation")]
    assert sizes[0] == 2 and sizes[-1] == 1, sizes  # worker 0 was lost; worker 1 went on
