"""Replica checks in-process (docs/architecture.md, "Replica checks"): the per-tensor fingerprint
(``step/digest.py``), the adapter's default, the worker loop's reports, the driver's comparison
(``driver/replicas.py``), the end-of-run check (``driver/ledger.py``) and the driver's halt
(``driver/driver.py``, ``driver/halt.py``) over the fakes of tests/test_driver_events.py. The runs
with real processes are in tests/test_divergence.py.
"""

from __future__ import annotations

import queue
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fabric_model.driver import driver as driver_module
from fabric_model.driver.driver import EXIT_DRAIN
from fabric_model.driver.ledger import ReplicaDivergenceError
from fabric_model.driver.replicas import NAMED, Divergence, ReplicaChecks, compare
from fabric_model.frameworks.base import FrameworkAdapter
from fabric_model.frameworks.torch.adapter import TorchAdapter
from fabric_model.step.digest import (
    MODULUS,
    _bytes_fingerprint,
    _device_bytes_fingerprint,
    check_due,
    differing,
    state_fingerprint,
    tensor_fingerprint,
)
from fabric_model.transport import protocol as p
from fabric_model.worker.inbox import Inbox, TrainingHalted

from .test_driver_events import Clock, Harness
from .test_ledger import SCHEDULE, Ledger
from .test_worker_loop import entering, make_worker


# -- the fingerprint ------------------------------------------------------------------------------
def reference_sum(array: np.ndarray) -> int:
    """The definition, the slow way: little-endian 8-byte words (a shorter last one), summed modulo 2**64."""
    raw = np.ascontiguousarray(array).tobytes()
    return sum(int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8)) % MODULUS


DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (1,), (3,), (7, 5), (1000,)])
def test_the_fingerprint_is_the_sum_of_the_bytes_as_words_and_any_changed_value_changes_it(dtype, shape):
    g = torch.Generator().manual_seed(0)
    tensor = (torch.randn(shape, generator=g) * 100).to(dtype)
    raw = tensor.reshape(-1).view(torch.uint8).numpy()
    assert tensor_fingerprint(tensor) == reference_sum(raw)
    for index in {0, tensor.numel() // 2, tensor.numel() - 1}:
        changed = tensor.clone().reshape(-1)
        changed.view(torch.uint8)[index * tensor.element_size()] ^= 1  # the lowest bit of one value
        assert tensor_fingerprint(changed.reshape(shape)) != tensor_fingerprint(tensor), index


@pytest.mark.parametrize("size", [0, 5, 8, 4003, 1 << 16])
def test_the_device_path_sums_as_the_cpu_path_does_wrapping_modulo_2_64(size):
    """A GPU tensor is summed as int64 where it lives (torch's sum wraps); checked here on the CPU."""
    g = torch.Generator().manual_seed(size)
    raw = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
    raw[: size // 2] = 255  # words near 2**64: the int64 sum wraps below zero
    assert _device_bytes_fingerprint(raw) == _bytes_fingerprint(raw.numpy()) == reference_sum(raw.numpy())


def test_equal_values_fingerprint_alike_whatever_their_layout_or_container():
    g = torch.Generator().manual_seed(0)
    tensor = torch.randn(6, 9, generator=g)
    transposed_twice = tensor.t().contiguous().t()  # the same values, not contiguous
    assert not transposed_twice.is_contiguous()
    assert tensor_fingerprint(transposed_twice) == tensor_fingerprint(tensor) == tensor_fingerprint(tensor.numpy())
    values = tensor.numpy().copy()
    assert tensor_fingerprint(tensor.requires_grad_()) == tensor_fingerprint(values)  # a parameter's


def test_one_ulp_up_and_one_down_in_neighbours_is_seen_where_a_plain_sum_of_the_bits_is_not():
    values = np.linspace(0.5, 2.0, 10, dtype=np.float32)
    moved = values.copy()
    moved[0], moved[1] = np.nextafter(moved[0], np.float32(9)), np.nextafter(moved[1], np.float32(-9))
    plain = [int(a.view(np.int32).sum(dtype=np.int64)) for a in (values, moved)]
    assert plain[0] == plain[1]  # the cancellation a sum of the float32 bit patterns misses
    assert tensor_fingerprint(moved) != tensor_fingerprint(values)


def test_other_values_fingerprint_by_their_repr():
    assert tensor_fingerprint(0.1) == tensor_fingerprint(0.1) != tensor_fingerprint(0.1 + 1e-17 * 2)
    assert tensor_fingerprint([0, 1, 2]) != tensor_fingerprint([0, 1, 3])
    assert tensor_fingerprint(None) == tensor_fingerprint(None)


def model_and_optimizer() -> tuple[nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    F.cross_entropy(model(torch.randn(5, 4)), torch.tensor([0, 1, 2, 0, 1])).backward()
    optimizer.step()
    return model, optimizer


def test_a_state_fingerprint_names_every_tensor_by_its_path_and_each_setting_on_its_own():
    model, optimizer = model_and_optimizer()
    prints = {
        **state_fingerprint(model.state_dict(), "model"),
        **state_fingerprint(optimizer.state_dict(), "optimizer"),
    }
    assert [k for k in prints if k.startswith("model/")] == [f"model/{k}" for k in model.state_dict()]
    assert "model/1.running_mean" in prints and "model/1.num_batches_tracked" in prints  # buffers too
    assert "optimizer/state/0/momentum_buffer" in prints and "optimizer/state/3/momentum_buffer" in prints
    assert "optimizer/param_groups/0/lr" in prints
    assert "optimizer/param_groups/0/params" in prints  # a list of numbers is one entry
    assert not any(k.startswith("optimizer/param_groups/0/params/") for k in prints)


def test_the_adapter_default_fingerprints_the_model_and_optimizer_state_it_hands_over():
    model, optimizer = model_and_optimizer()
    adapter = TorchAdapter(model, optimizer, F.cross_entropy, metrics=[])
    prints = adapter.state_fingerprint()
    expected = {
        **state_fingerprint(adapter.model_state(), "model"),
        **state_fingerprint(adapter.optimizer_state(), "optimizer"),
    }
    assert prints == expected
    with torch.no_grad():
        model.get_buffer("1.running_var")[3] += 1e-6  # a buffer, not a parameter
    assert differing(prints, adapter.state_fingerprint()) == ["model/1.running_var"]


def test_the_adapter_default_works_on_keras_shaped_states():
    """Keras' adapter keys its variables by position and path (frameworks/keras/shipping.py)."""
    stub = types.SimpleNamespace(
        model_state=lambda: {"00000:dense/kernel": torch.ones(4, 2), "00001:dense/bias": torch.zeros(2)},
        optimizer_state=lambda: {"00000:adam/iteration": torch.tensor(3, dtype=torch.int64)},
    )
    prints = FrameworkAdapter.state_fingerprint(stub)  # type: ignore[arg-type]
    assert list(prints) == ["model/00000:dense/kernel", "model/00001:dense/bias", "optimizer/00000:adam/iteration"]


@pytest.mark.parametrize(
    ("every", "due"),
    [(3, [2, 5, 7, 8, 11, 14, 15]), (1, list(range(16))), (0, []), (100, [7, 15])],
)
def test_checks_fall_every_n_steps_and_after_each_epoch_s_last(every, due):
    steps_per_epoch = 8
    assert [s for s in range(16) if check_due(s, s % steps_per_epoch == steps_per_epoch - 1, every)] == due


# -- the worker's side -------------------------------------------------------------------------
def test_members_of_a_generation_of_several_report_fingerprints_at_the_due_units():
    """3 steps an epoch, a check every 2: after global step 1 and after the epoch's last (2)."""
    worker = make_worker(world_size=2)
    worker.loop.check_steps = 2
    worker.loop.enter(entering(0, 0, rank=1, world_size=2))
    worker.loop.run_joined()

    sent = [c.args[0] for c in worker.channel.send.call_args_list if isinstance(c.args[0], p.Fingerprint)]
    assert [(f.generation, f.unit, f.rank, f.world_size) for f in sent] == [(0, 2, 1, 2), (0, 3, 1, 2)]
    keys = list(sent[-1].tensors)
    assert keys[0] == "model/0.weight" and "model/1.running_mean" in keys
    assert "optimizer/state/0/momentum_buffer" in keys and "loop/epoch" in keys
    final = worker.loop.fingerprint()
    assert {k: v for k, v in final.items() if not k.startswith("loop/")} == {
        k: v for k, v in sent[-1].tensors.items() if not k.startswith("loop/")
    }


def test_a_lone_worker_sends_no_fingerprint():
    worker = make_worker()
    worker.loop.check_steps = 1
    worker.loop.enter(entering(0, 0))
    worker.loop.run_joined()
    assert not [c for c in worker.channel.mock_calls if c.args and isinstance(c.args[0], p.Fingerprint)]


def test_the_driver_asking_for_the_state_in_place_of_a_generation_halts_the_loop_at_a_step_boundary():
    """Aborted in step 1, the worker undoes it and, asked for its state, stops there: its weights
    are those after step 0."""
    worker = make_worker()
    after_step_0: dict[str, torch.Tensor] = {}

    def abort_in_step_1(step: int) -> None:
        if step == 1:
            after_step_0.update(worker.weights())
            worker.inbox.abort_generation = 0  # as the inbox thread does on Abort(0)

    worker.loop.hooks.on_batch_begin = abort_in_step_1  # type: ignore[method-assign]
    worker.inbox.expect.side_effect = TrainingHalted()
    worker.loop.enter(entering(0, 0))
    with pytest.raises(TrainingHalted):
        worker.loop.run_joined()
    assert worker.loop.next_unit == 1
    assert all(torch.equal(worker.weights()[k], after_step_0[k]) for k in after_step_0)


class QueueChannel:
    """A channel whose ``recv`` hands out what the test puts (blocking, as the real one does)."""

    def __init__(self) -> None:
        self.incoming: queue.Queue[Any] = queue.Queue()

    def recv(self) -> Any:
        return self.incoming.get()


def test_the_inbox_turns_a_request_for_the_state_where_another_message_was_due_into_a_halt():
    channel = QueueChannel()
    inbox = Inbox(channel)  # type: ignore[arg-type]
    channel.incoming.put(p.SendFinalState())
    with pytest.raises(TrainingHalted):
        inbox.expect(p.EnterGeneration, 5)
    channel.incoming.put(p.SendFinalState())
    assert inbox.expect(p.SendFinalState, 5) == p.SendFinalState()  # at the end, the request it waits for


# -- the driver's comparison ----------------------------------------------------------------------
def prints(changed: dict[str, int] | None = None) -> dict[str, int]:
    """A replica's fingerprint, with ``changed`` tensors' values."""
    base = {"model/fc1.weight": 1, "model/fc1.bias": 2, "model/bn.running_mean": 3, "optimizer/state/0/m": 4}
    return {**base, **(changed or {})}


def fingerprint(generation: int, unit: int, rank: int, world: int, tensors: dict[str, int]) -> p.Fingerprint:
    return p.Fingerprint(generation, unit, rank, world, tensors)


def where(generation: int, unit: int) -> str:
    return f"unit {unit} of generation {generation}"


def test_a_unit_is_compared_once_every_member_reported_it_and_equal_states_pass():
    checks = ReplicaChecks(where)
    assert checks.add(5, fingerprint(0, 4, 1, 2, prints())) is None
    assert checks.compared == 0
    assert checks.add(3, fingerprint(0, 4, 0, 2, prints())) is None
    assert checks.compared == 1


def test_a_difference_names_the_tensors_and_the_workers_compared_with_rank_0():
    checks = ReplicaChecks(where)
    checks.add(7, fingerprint(2, 10, 1, 3, prints({"model/bn.running_mean": 30})))
    checks.add(9, fingerprint(2, 10, 2, 3, prints({"model/bn.running_mean": 30})))
    divergence = checks.add(4, fingerprint(2, 10, 0, 3, prints()))
    assert divergence == Divergence(4, {7: ["model/bn.running_mean"], 9: ["model/bn.running_mean"]}, where(2, 10))
    assert divergence.describe() == "workers 7, 9 differ from worker 4 in 1 tensor(s): model/bn.running_mean"


def test_many_differing_tensors_are_named_up_to_a_few_then_counted():
    reference = {f"model/t{i}": i for i in range(NAMED + 3)}
    other = {k: v + 1 for k, v in reference.items()}
    divergence = compare({0: reference, 1: other}, "at the end")
    assert divergence is not None and len(divergence.tensors) == NAMED + 3
    text = divergence.describe()
    assert text.startswith(f"worker 1 differs from worker 0 in {NAMED + 3} tensor(s): model/t0, model/t1")
    assert text.endswith(f"model/t{NAMED - 1} and 3 more")


def test_a_tensor_only_one_replica_has_is_named():
    assert differing({"a": 1, "b": 2}, {"a": 1, "c": 2}) == ["b", "c"]


def test_units_of_older_generations_are_dropped_incomplete():
    checks = ReplicaChecks(where)
    checks.add(1, fingerprint(0, 4, 1, 2, prints({"model/fc1.bias": 0})))  # its peer was lost before sending
    assert checks.add(1, fingerprint(1, 4, 0, 1, prints())) is None  # a generation of one compares nothing
    assert checks.add(0, fingerprint(0, 4, 0, 2, prints())) is None  # generation 0's unit is gone
    assert checks.compared == 1


# -- the end of the run -------------------------------------------------------------------------
@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    ledger = Ledger(tmp_path)
    yield ledger
    ledger.log.close()


def test_replicas_that_end_apart_are_named_against_the_replica_whose_state_is_kept(ledger: Ledger):
    progress, total = ledger.progress, SCHEDULE.total_units
    progress.finished(0, p.Finished("aaaa", total, prints({"model/fc1.weight": 9})))
    progress.finished(1, p.Finished("bbbb", total, prints()))
    with pytest.raises(ReplicaDivergenceError, match="different states") as caught:
        progress.check_replicas(reference=1)
    assert caught.value.divergence == Divergence(1, {0: ["model/fc1.weight"]}, "at the end of training")
    assert "worker 0 differs from worker 1 in 1 tensor(s): model/fc1.weight" in str(caught.value)


def test_digests_that_differ_where_the_fingerprints_agree_still_fail_and_say_so(ledger: Ledger):
    progress, total = ledger.progress, SCHEDULE.total_units
    progress.finished(0, p.Finished("aaaa", total, prints()))
    progress.finished(1, p.Finished("bbbb", total, prints()))
    with pytest.raises(ReplicaDivergenceError, match="bytes the per-tensor fingerprints do not see"):
        progress.check_replicas()


# -- the driver halts ---------------------------------------------------------------------------
@pytest.fixture
def harness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    clock = Clock()
    monkeypatch.setattr(driver_module, "time", clock)
    harness = Harness(tmp_path, clock)
    harness.start()
    yield harness
    harness.driver.metrics.close()


def diverge(harness: Harness, unit: int = 3) -> None:
    harness.driver.handle(0, fingerprint(0, unit, 0, 2, prints()))
    harness.driver.handle(1, fingerprint(0, unit, 1, 2, prints({"model/fc1.bias": 7})))


def final_state(unit: int) -> p.FinalState:
    return p.FinalState({"w": torch.ones(2)}, {"state": {}}, unit)


def test_a_divergence_aborts_the_generation_and_asks_rank_0_for_its_state(harness: Harness):
    harness.step(0, 0)
    harness.step(1, 0)
    diverge(harness)

    assert harness.sent(p.Abort) == [(0, p.Abort(0)), (1, p.Abort(0))]
    harness.store.abort.assert_called_with(0)
    assert harness.sent(p.SendFinalState) == [(0, p.SendFinalState())]
    # Membership no longer acts: the members leave, but no generation forms; steps still commit.
    harness.step(0, 1)
    harness.step(1, 1)
    harness.driver.handle(1, p.LeftGeneration(0, 2, failed=True, reason="aborted"))
    harness.driver.handle(0, p.LeftGeneration(0, 2, failed=True, reason="aborted"))
    harness.driver.tick()
    assert [e.generation for _, e in harness.sent(p.EnterGeneration)] == [0, 0]
    assert harness.driver.progress.committed_unit == 2

    harness.driver.handle(0, final_state(2))
    final = harness.driver.final
    assert final is not None and (final.worker, final.unit) == (0, 2)
    assert final.divergence is not None and final.divergence.tensors == ["model/fc1.bias"]
    assert final.divergence.where == "after epoch 0, step 2 (generation 0)"
    assert final.source == "training stopped; worker 0's state (rank 0, after epoch 0, step 1)"


def test_when_rank_0_cannot_send_its_state_the_next_member_is_asked(harness: Harness):
    diverge(harness)
    harness.driver.handle(1, final_state(3))  # not asked: ignored
    assert harness.driver.final is None
    harness.driver.handle(0, p.WorkerFailed("Traceback ...\nOSError: gone", None, collective=True))
    assert harness.sent(p.SendFinalState) == [(0, p.SendFinalState()), (1, p.SendFinalState())]
    harness.driver.handle(1, final_state(3))
    final = harness.driver.final
    assert final is not None and final.worker == 1
    assert final.source == "training stopped; worker 1's state (after epoch 0, step 2)"


def test_a_silent_member_is_passed_over_and_with_no_state_at_all_the_error_says_no_model_was_written(
    harness: Harness,
):
    diverge(harness)
    harness.clock.now += harness.driver.setup.config.timeouts.recovery + 1
    harness.driver.tick()  # worker 0 sent nothing in time: worker 1 is asked
    assert [w for w, _ in harness.sent(p.SendFinalState)] == [0, 1]
    harness.launcher.exited.return_value = {1: -9}
    harness.driver.tick()  # its exit is seen; what it sent before may still be queued (Driver._drained)
    assert harness.driver.final is None
    harness.clock.now += EXIT_DRAIN * 1.1
    with pytest.raises(ReplicaDivergenceError, match="no model was written") as caught:
        harness.driver.tick()  # worker 1 died: no member left, and the driver holds no saved state
    assert caught.value.divergence is not None and caught.value.divergence.tensors == ["model/fc1.bias"]
