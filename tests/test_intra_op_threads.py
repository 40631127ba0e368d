"""The run's intra-op threads follow the step's size (docs/architecture.md, "Intra-op threads"): a
CPU step of a few million FLOPs, counted on the first batch in the caller, runs one thread a
worker, where a second one's fork and join cost more than it saves; a larger step takes its share
of the cores, ``deterministic=True`` its fixed count, and ``FABRIC_MODEL_SMALL_STEP_FLOPS=0``
turns the rule off."""

from __future__ import annotations

import json
import types

import pytest
import torch
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.frameworks.torch.flops import counted
from fabric_model.orchestrator.run_setup import micro_batch_flops, worker_threads

from .helpers import fresh_model_and_optimizer, make_data

FOUR_CORES = types.SimpleNamespace(threads=4)  # a Ray actor's CPUs: a share that does not depend on this host


def test_the_first_batch_s_forward_is_counted_as_torch_counts_it():
    layer = torch.nn.Linear(64, 32)
    output, flops = counted(lambda: layer(torch.randn(2, 64)))
    assert output.shape == (2, 32)
    assert flops == 2 * 2 * 64 * 32  # a multiply and an add per weight and sample


def test_an_error_of_the_model_s_own_is_raised_as_itself_under_the_count():
    calls = []

    def forward():
        calls.append(1)
        raise ValueError("the model's own mistake")

    with pytest.raises(ValueError, match="the model's own mistake"):
        counted(forward)
    assert len(calls) == 2  # counted, then called plainly: the plain call's error is the one raised


def test_a_micro_batch_s_step_is_three_forwards_of_its_items():
    assert micro_batch_flops(8192, 2, 16) == 3 * 8192 * 8
    assert micro_batch_flops(None, 2, 16) is None


@pytest.mark.parametrize(
    "deterministic,gpus,flops,setting,expected",
    [
        (False, 0, 1e6, None, 1),  # a small step: one thread
        (False, 0, 1e8, None, 4),  # a large one: the share
        (False, 0, None, None, 4),  # not counted: the share
        (False, 1, 1e6, None, 4),  # a GPU's worker: its CPU threads feed the device
        (False, 0, 1e6, "0", 4),  # the rule off
        (False, 0, 1e6, "1e5", 4),  # under a lower bound: not small
        (True, 0, 1e8, None, 1),  # deterministic: its fixed count, whatever the step
    ],
)
def test_the_run_s_threads_follow_the_step_s_size(monkeypatch, deterministic, gpus, flops, setting, expected):
    if setting is None:
        monkeypatch.delenv("FABRIC_MODEL_SMALL_STEP_FLOPS", raising=False)
    else:
        monkeypatch.setenv("FABRIC_MODEL_SMALL_STEP_FLOPS", setting)
    monkeypatch.delenv("FABRIC_MODEL_DETERMINISTIC_THREADS", raising=False)
    threads, why = worker_threads(deterministic, FOUR_CORES, gpus, 1, flops)
    assert threads == expected
    if expected == 1 and not deterministic:
        assert "FABRIC_MODEL_SMALL_STEP_FLOPS=4e+06" in why and "1e+06 FLOPs" in why, why


@pytest.mark.processes
def test_a_lone_worker_on_a_small_step_trains_on_one_thread_and_the_run_says_why(run_dir, monkeypatch):
    monkeypatch.delenv("FABRIC_MODEL_SMALL_STEP_FLOPS", raising=False)
    model, opt = fresh_model_and_optimizer()

    class Threads:
        def on_train_begin(self) -> None:
            (run_dir.parent / "threads").write_text(str(torch.get_num_threads()))

    data = make_data(64)
    FabricModel(model, lambda: (data, None), F.cross_entropy, opt, worker_logger_callback=Threads()).train(
        1, 16, 1, run_dir=run_dir, verbose=0
    )
    assert (run_dir.parent / "threads").read_text() == "1"
    note = json.loads((run_dir / "run.json").read_text())["startup"]["notes"]["intra-op threads"]
    # On one usable core the share is one thread already; on more, the step's size decides.
    assert note.startswith("1 per CPU worker: "), note
    assert f"intra-op threads: {note}" in (run_dir / "logs" / "driver.log").read_text()
