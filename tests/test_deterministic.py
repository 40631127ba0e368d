"""``deterministic=True`` (docs/architecture.md, "Deterministic mode"): bitwise-identical weights,
optimizer state and BatchNorm buffers for any worker count, a kill and a join, and a resume."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.frameworks.torch.exact import ExactTorchAdapter
from fabric_model.frameworks.torch.ordered import MAX_TERMS, OrderedTorchAdapter
from fabric_model.orchestrator.run_setup import make_deterministic
from fabric_model.step.exact_sum import HEADROOM_BITS, ExactSum
from fabric_model.testing import FaultInjector, Hang, HoldForJoin, Kill

from .helpers import make_data, records, run_killed_job

SEED, EPOCHS, BATCH, GLOBAL = 5, 10, 8, 24  # 3 micro-batches a step (the ordered sum), 3 steps an epoch, 30 steps
DATA = make_data(72)
REPO = Path(__file__).resolve().parents[1]


class Net(torch.nn.Module):
    """Dropout and BatchNorm: randomness and forward-updated buffers (an integer one too)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(12, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.drop = torch.nn.Dropout(0.2)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def fresh() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(run_dir, workers, faults=(), marker_dir=None, driver_logger=None, epochs=EPOCHS, data=DATA, **kwargs):
    model, opt = fresh()
    injector = FaultInjector(list(faults), marker_dir) if faults else None
    fm = FabricModel(
        model,
        lambda: (data, None),
        F.cross_entropy,
        opt,
        worker_logger_callback=injector,
        driver_logger_callback=driver_logger,
    )
    kwargs.setdefault("effective_batch_size", GLOBAL)
    fm.train(epochs, BATCH, workers, seed=SEED, run_dir=run_dir, deterministic=True, **kwargs)
    return model, opt


def final_state(model, opt) -> dict[str, torch.Tensor]:
    """Weights, BatchNorm buffers and the momentum buffers, by name."""
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        state[f"momentum.{i}"] = opt.state[p]["momentum_buffer"]
    return state


def assert_bitwise_equal(state, reference) -> None:
    assert state.keys() == reference.keys()
    differ = [k for k in reference if not torch.equal(state[k], reference[k])]
    assert not differ, f"not bitwise equal: {differ}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    model, opt = train(tmp_path_factory.mktemp("reference") / "run", 1)
    return copy.deepcopy(final_state(model, opt))


# -- the fixed-point sum on its own ----------------------------------------------------------
def _terms(count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    scales = torch.tensor([1e-3] * 50 + [3e-7] * 20 + [0.4] * 30)  # three tensors of different magnitudes
    return [torch.randn(100, generator=g) * scales for _ in range(count)]


def _sum(groups: list[list[torch.Tensor]]) -> torch.Tensor:
    """Each group on its own accumulator (a worker), totals added as the allreduce does."""
    sums = [ExactSum([50, 20, 30], 16, torch.device("cpu")) for _ in groups]
    for exact, group in zip(sums, groups):
        exact.exponents = torch.tensor([-2, -14, 7])
        exact._set_scales()
        for term in group:
            exact.add(term)
    first = sums[0]
    for other in sums[1:]:
        first.total.add_(other.total)  # in place, as the allreduce
        torch.maximum(first.maxima, other.maxima, out=first.maxima)
    assert first.settle()
    out = torch.empty(100)
    first.write(out)
    return out


def test_exact_sum_does_not_depend_on_grouping_or_order():
    terms = _terms(12)
    one = _sum([terms])
    assert torch.equal(_sum([terms[::-1]]), one)
    assert torch.equal(_sum([terms[0::3], terms[1::3], terms[2::3]]), one)
    assert torch.equal(_sum([terms[5:], terms[:5]]), one)
    exact = torch.stack(terms).double().sum(0)
    assert torch.allclose(one.double(), exact, rtol=1e-6, atol=0)  # float32 rounding of the exact sum
    floats = [sum(terms[j] for j in order) for order in ([0, 1, 2, 3], [3, 2, 1, 0])]  # what it replaces
    assert not torch.equal(floats[0], floats[1])


def test_a_lone_term_rounded_in_place_is_bitwise_what_add_and_write_give():
    """A lone worker's only micro-batch skips the float64 round trip (ExactSum.round_in_place)."""
    term = _terms(1)[0]
    term[7] = float("inf")  # a non-finite tensor becomes NaN either way
    term[75] = 1e-13  # far below its tensor's grid quantum (2**-44): rounded
    results = []
    for in_place in (False, True):
        exact = ExactSum([50, 20, 30], 1, torch.device("cpu"))
        exact.exponents = torch.tensor([-2, -14, 7])
        exact._set_scales()
        region = term.clone()
        if in_place:  # the tensors where they are, in their own shapes (a lone worker's own gradients)
            exact.round_in_place([segment.view(-1, 10) for segment in region.split([50, 20, 30])])
        else:
            exact.add(region)
        assert exact.settle()
        exact.write(region)
        results.append(region)
    assert torch.equal(results[0][50:], results[1][50:]) and results[1][:50].isnan().all()
    assert results[1][75] != term[75] and results[1][75] == 2.0**-44 * round(1e-13 / 2.0**-44)


def test_overflow_asks_for_a_redo_on_a_wider_grid_and_zeros_stay_exact():
    exact = ExactSum([2, 3], 4, torch.device("cpu"))
    exact.add(torch.tensor([5.0, -0.25, 0.0, 0.0, 0.0]))  # 5 is beyond the first step's guess (below 1)
    assert not exact.settle()
    assert exact.exponents.tolist() == [3 + HEADROOM_BITS, 0]  # the zero tensor keeps its grid
    exact.zero()
    exact.add(torch.tensor([5.0, -0.25, 0.0, 0.0, 0.0]))
    assert exact.settle()
    out = torch.empty(5)
    exact.write(out)
    assert out.tolist() == [5.0, -0.25, 0.0, 0.0, 0.0]
    exact.zero()
    exact.add(torch.tensor([1.0, float("inf"), 0.0, 0.0, 0.0]))
    assert exact.settle()
    exact.write(out)
    assert out[:2].isnan().all()  # as a float sum would propagate it


@pytest.mark.processes
def test_bad_values_are_refused_in_the_caller(run_dir):
    model, opt = fresh()
    with pytest.raises(TypeError, match="deterministic"):
        FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt).train(1, BATCH, 1, deterministic="yes")


# -- whole runs ------------------------------------------------------------------------------
@pytest.mark.processes
@pytest.mark.parametrize("workers", [2, 3])
def test_bitwise_equal_for_any_worker_count(workers, reference, run_dir):
    model, opt = train(run_dir, workers)
    assert_bitwise_equal(final_state(model, opt), reference)
    assert {r["workers"] for r in records(run_dir, "train")} == {workers}


def test_fresh_terms_added_then_plus_zero_have_the_bits_of_terms_made_in_zeros():
    """A lone worker's backward writes its first gradient fresh (it may hold -0.0) and adds the
    rest to it; other workers make each term in zeros (0 + g, never -0.0). Adding +0.0 at the
    end makes the two bitwise alike, signs of zero included (torch.equal would not see them)."""
    g = torch.tensor([[-0.0, -0.0, 1.5, -0.0, 2.0], [-0.0, 0.0, -1.5, 3.0, -0.0], [-0.0, -0.0, 0.0, -0.0, -0.0]])
    fresh = g[0].clone()
    for term in g[1:]:
        fresh += term
    torch._foreach_add_([fresh], 0.0)
    zeros = torch.zeros(5)
    for term in g:
        zeros += torch.zeros(5) + term  # each term made in zeros, then added in order
    assert torch.equal(fresh.view(torch.int32), zeros.view(torch.int32))
    assert not (g[0].clone() + g[1] + g[2]).view(torch.int32).equal(zeros.view(torch.int32))  # without the +0


@pytest.mark.processes
def test_two_micro_batches_a_step_are_summed_by_the_plain_allreduce_bitwise_alike(run_dir, tmp_path):
    """2 micro-batches a step: a lone worker adds its two terms in order; 2 workers (one term each)
    sum them with the float32 allreduce. Each epoch ends with a step of 8 + 4 samples
    (76 = 4 * 16 + 12): terms weighted 2/3 and 1/3, whose rounding shows a fused multiply-add."""
    data = make_data(76)
    lone = final_state(*train(run_dir, 1, data=data, effective_batch_size=16))
    assert_bitwise_equal(final_state(*train(tmp_path / "two", 2, data=data, effective_batch_size=16)), lone)


@pytest.mark.processes
def test_the_sum_is_chosen_by_the_runs_configuration_never_its_size():
    """Up to MAX_TERMS micro-batches a step and no custom step: the ordered float32 sum; else fixed point."""
    model, opt = fresh()
    adapter = FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt)._make_adapter()
    assert isinstance(make_deterministic("torch", adapter, MAX_TERMS), OrderedTorchAdapter)
    assert isinstance(make_deterministic("torch", adapter, MAX_TERMS + 1), ExactTorchAdapter)
    adapter.step_fn = lambda *args: (0.0, 0.0)
    assert isinstance(make_deterministic("torch", adapter, 2), ExactTorchAdapter)


@pytest.mark.processes
def test_the_fixed_point_sum_is_bitwise_equal_through_a_kill_and_a_join(run_dir, tmp_path):
    """5 micro-batches a step (the fixed-point sum), and each epoch ends with a step of one
    (88 = 40 + 40 + 8), which a lone worker rounds where its fresh gradients are. A feature at
    1e-9 puts gradients far below their tensor's grid quantum: the rounding matters. 3 workers,
    then 2 after a kill (the micro-batches divided anew), then 3 again."""
    data = [(torch.cat([x[:-1], x[-1:] * 1e-9]), y) for x, y in make_data(88)]
    lone = final_state(*train(run_dir, 1, data=data, effective_batch_size=40))
    faults = [Kill(1, 4), HoldForJoin(7)]
    three = tmp_path / "three"
    state = final_state(*train(three, 3, faults, tmp_path, data=data, effective_batch_size=40))
    assert_bitwise_equal(state, lone)
    sizes = [g["workers"] for g in records(three, "generation")]
    assert sizes[:2] == [3, 2] and sizes[-1] == 3, sizes  # the kill happened, the replacement joined


@pytest.mark.processes
def test_bitwise_equal_after_a_kill_a_replacement_and_a_freeze(reference, run_dir, tmp_path, monkeypatch):
    """Killed just before the step's exchange (the terms are gathered: 3 micro-batches a step),
    replaced; later another worker freezes (SIGSTOP) there and is removed by its heartbeat."""
    monkeypatch.setenv("EDT_HEARTBEAT_TIME_OUT", "3")
    model, opt = train(run_dir, 3, [Kill(1, 6), HoldForJoin(9), Hang(2, 15)], tmp_path)
    assert_bitwise_equal(final_state(model, opt), reference)
    generations = records(run_dir, "generation")
    sizes = [g["workers"] for g in generations]
    assert sizes[:3] == [3, 2, 3], sizes  # the kill happened, the replacement joined
    assert any("heartbeat" in g["reason"] for g in generations), generations  # the freeze was seen


@pytest.mark.processes
def test_bitwise_equal_after_a_whole_job_kill_and_resume(reference, tmp_path):
    run_dir = tmp_path / "run"
    run_killed_job(tmp_path, "tests.test_deterministic", f"{str(run_dir)!r}, 2", kill_at=22, run_dir=run_dir)
    model, opt = train(run_dir, 3, resume=True)
    resumed = records(run_dir, "resume")[-1]
    killed_at = 22 // 3 * 4 + 22 % 3  # the unit of iteration 22: 3 steps and a validation slot an epoch
    assert 0 < resumed["resume_unit"] < killed_at, resumed  # from a checkpoint, not from the start
    assert_bitwise_equal(final_state(model, opt), reference)
