"""Where the time goes: train(profile=...) (the window's checks, the named ranges, the summary, a
profiled run's files) and the start-up's phases in run.json."""

from __future__ import annotations

import json
import time

import psutil
import pytest
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.profiling import phases as ph
from fabric_model.profiling.phases import Phases
from fabric_model.profiling.summary import render
from fabric_model.run.startup import CALLER_PHASES, DRIVER_PHASES, StartUp
from fabric_model.settings.profile_window import ProfileWindow, fit_to_run, parse_setting, profile_window
from fabric_model.settings.registry import PROFILE

from .helpers import fresh_model_and_optimizer, make_data

DATA = make_data(96)  # 12 steps an epoch at batch 8 on 1 engine


# -- the window (in-process) ---------------------------------------------------------------
def test_profile_accepts_true_a_count_a_pair_or_a_range_and_names_itself_otherwise():
    assert profile_window(None) is None and profile_window(False) is None
    assert (profile_window(True).start, profile_window(True).stop) == (10, 20)
    assert profile_window(5) == ProfileWindow(10, 15)
    assert profile_window((3, 7)) == profile_window(range(3, 7)) == ProfileWindow(3, 7)
    for bad in ("10:20", 2.5, (3,), (1, 2, 3), range(0, 10, 2)):
        with pytest.raises(TypeError, match=r"Expected `profile` to be True .* Received: profile="):
            profile_window(bad)
    for bad in (0, (5, 5), (-1, 3), (0, 5000)):
        with pytest.raises(ValueError, match=r"Expected `profile` .* at least 1 and at most 1000 steps"):
            profile_window(bad)


def test_a_window_is_fitted_to_the_run_and_one_past_its_end_is_refused():
    assert fit_to_run(ProfileWindow(3, 50), 12) == ProfileWindow(3, 12)
    with pytest.raises(ValueError, match=r"the run has 12 steps .* Received: steps 12-13"):
        fit_to_run(ProfileWindow(12, 14), 12)
    default = fit_to_run(profile_window(True), 12)  # profile=True on a short run: its second half
    assert (default.start, default.stop) == (6, 12)


def test_the_setting_reads_as_the_argument_does(monkeypatch):
    assert parse_setting("1") == profile_window(True) and parse_setting("0") is None
    assert parse_setting("4:9") == ProfileWindow(4, 9) and parse_setting("3") == ProfileWindow(10, 13)
    monkeypatch.setenv("FABRIC_MODEL_PROFILE", "20-30")
    with pytest.raises(ValueError, match=r"Expected FABRIC_MODEL_PROFILE to be .*FIRST:STOP.* Received"):
        PROFILE.get()


def test_phases_cost_nothing_when_off_and_time_exclusively_when_on():
    phases = Phases()
    assert phases(ph.STEP) is phases(ph.FORWARD)  # one shared no-op object while off
    phases.open()
    with phases(ph.STEP):
        time.sleep(0.02)
        with phases(ph.FORWARD):
            time.sleep(0.03)
    times = phases.close()
    assert 0.025 <= times[ph.FORWARD] and 0.015 <= times[ph.STEP] < times[ph.FORWARD]  # the step's own time only
    assert phases(ph.STEP) is phases(ph.DATA)


def test_a_followed_object_s_methods_run_in_their_ranges_only_while_a_window_is_open():
    class Part:
        def __init__(self) -> None:
            self.bound = len  # another object's method, held bound

        def work(self) -> int:
            time.sleep(0.01)
            return 1

    phases, part, other = Phases(), Part(), Part()
    phases.follow(part, {"work": ph.FORWARD, "bound": ph.DATA})
    assert vars(part) == {"bound": len}  # off: the object's own methods, nothing around them
    phases.open()
    phases.follow(other, {"work": ph.BACKWARD})  # followed while a window is open
    assert part.work() == 1 and part.bound("ab") == 2 and other.work() == 1
    times = phases.close()
    assert times[ph.FORWARD] >= 0.009 and times[ph.BACKWARD] >= 0.009 and ph.DATA in times
    assert vars(part) == {"bound": len} and vars(other) == {"bound": len}
    phases.open()
    phases.unfollow(part)  # its own methods again, and for good
    assert vars(part) == {"bound": len}
    phases.close()
    phases.open()
    part.work()
    assert ph.FORWARD not in phases.close()


def test_the_summary_splits_a_step_into_the_users_code_and_ours():
    figures = {
        "worker": 0,
        "where": "rank 0 of 1",
        "device": "cpu",
        "first": 10,
        "steps": 10,
        "partial": False,
        "wall": 0.020,
        "phases": {
            **{ph.FORWARD: 0.008, ph.BACKWARD: 0.006, ph.OPTIMIZER: 0.002, ph.SNAPSHOT: 0.001, ph.STEP: 0.001},
            ph.RESULTS: 0.001,  # the host waiting for the device: neither the user's code nor ours
        },
        "operators": [("aten::addmm", 0.004, 0.0)],
    }
    lines = render(figures, "profile/worker-0.pt.trace.json")
    assert lines[0] == "profile of steps 10-19 on worker 0, rank 0 of 1, cpu: 2.000 ms a step"
    row = {line.strip().rsplit(None, 2)[0]: line.split()[-2:] for line in lines[2:] if line.strip()[-1] == "%"}
    assert row["your code"] == ["1.600", "80%"] and row["fabric-model"] == ["0.200", "10%"]
    assert row["the step's results (waiting for the device)"] == ["0.100", "5%"]
    assert row["between the named ranges"] == ["0.100", "5%"]  # the wall time no range holds
    assert any("aten::addmm" in line for line in lines) and lines[-1].startswith("  trace: profile/worker-0")


def test_a_bad_profile_fails_before_any_worker_starts(run_dir):
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(TypeError, match=r"Received: profile='steps 3-5'"):
        fm.train(1, 8, 1, run_dir=run_dir, profile="steps 3-5")
    with pytest.raises(ValueError, match=r"the run has 12 steps"):
        fm.train(1, 8, 1, run_dir=run_dir, profile=(20, 30))
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


# -- a profiled run (real worker processes) -------------------------------------------------
def trace_names(path) -> set[str]:
    return {event.get("name", "") for event in json.loads(path.read_text())["traceEvents"]}


@pytest.mark.processes
def test_a_profiled_run_writes_a_trace_with_the_framework_s_ranges_and_a_summary(run_dir):
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(model, lambda: (DATA, DATA[:16]), F.cross_entropy, opt)
    fm.train(2, 8, 2, run_dir=run_dir, seed=0, profile=(4, 9), verbose=0)  # 6 steps an epoch: through its end
    traces = sorted((run_dir / "profile").glob("*.pt.trace.json"))
    assert len(traces) == 1, traces  # rank 0's only
    names = trace_names(traces[0])
    ours = {ph.STEP, ph.DATA, ph.REDUCE, ph.RESULTS, ph.REPORT, ph.VALIDATION, ph.CALLBACKS}
    theirs = {ph.FORWARD, ph.BACKWARD, ph.OPTIMIZER, ph.METRICS}
    assert ours | theirs <= names, sorted(ours | theirs - names)
    assert "aten::addmm" in names  # the operators, under the ranges
    summary = (run_dir / "profile" / "summary.txt").read_text()
    assert summary.startswith("profile of steps 4-8 on worker ") and ", rank 0 of 2, cpu: " in summary
    assert "your code" in summary and "fabric-model" in summary and f"profile/{traces[0].name}" in summary


@pytest.mark.processes
def test_a_run_records_its_start_up_in_phases_and_without_a_profile_writes_none(run_dir, monkeypatch):
    monkeypatch.delenv("FABRIC_MODEL_PROFILE", raising=False)
    monkeypatch.setenv("FABRIC_MODEL_WARM_START", "fresh")  # the start-up says how workers started, and why
    model, opt = fresh_model_and_optimizer()
    FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt).train(1, 8, 2, run_dir=run_dir, verbose=0)
    assert not (run_dir / "profile").exists()
    startup = json.loads((run_dir / "run.json").read_text())["startup"]
    names = [name for name, _ in startup["phases"]]
    top = [name for name in names if not name.startswith("  ")]
    assert top == [*CALLER_PHASES, *DRIVER_PHASES, "first step"], names  # train() to the first commit, in order
    assert {"  unpickling the job", "  datasets_function", "  group formed", "  state to the device"} <= set(names)
    seconds = dict(startup["phases"])
    assert sum(seconds[name] for name in top) == pytest.approx(startup["total"], abs=1e-3)
    assert all(value >= 0 for value in seconds.values()) and 0 < startup["total"] < 120
    how = "a fresh interpreter (FABRIC_MODEL_WARM_START=fresh)"
    assert startup["notes"]["warm process"] == how, startup
    assert startup["notes"]["intra-op threads"].startswith("1 per CPU worker: "), startup  # 2 workers of a small step
    assert f"local workers fork from the warm process: {how}" in (run_dir / "logs" / "driver.log").read_text()


def test_start_up_phases_nest_the_first_worker_s_parts_under_the_driver_s():
    clock = StartUp(began=0.0)
    clock._marks = {"argument checks": 0.5, "process start": 1.0, "worker set-up": 3.0, "first step": 3.5}
    clock.worker("worker set-up", {"unpickling the job": 0.5, "datasets_function": 1.0})
    clock.worker("worker set-up", {"unpickling the job": 9.0})  # a second worker's: the first stands
    assert clock.phases() == {
        "phases": [
            ["argument checks", 0.5],
            ["process start", 0.5],
            ["worker set-up", 2.0],
            ["  unpickling the job", 0.5],
            ["  datasets_function", 1.0],
            ["  the rest of worker set-up", 0.5],
            ["first step", 0.5],
        ],
        "total": 3.5,
    }
