"""The recipes of docs/clusters.md, run as the docs show them (network namespaces, root): each
ends with what the driver checked, its weights those of an undisturbed run, and nothing left
behind."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from . import netns
from .helpers import max_rel_diff, need
from .load import scaled
from .test_multihost import assert_exactly_once, undisturbed  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parent.parent


#: Workers started by hand connect before the driver's first generation forms (it takes them in)
#: or after (they join it): ``FM_RECIPE_JOIN`` forces one order, and each recipe must hold in both.
JOIN_ORDERS = ("first", "after")


def run_recipe(script: str, work: Path, tag: str, net: str, timeout: float, join: str = "") -> list[str]:
    """``bash examples/clusters/<script> WORK`` as the docs show it (its namespaces named by
    ``tag``, on ``net``; the join order ``join`` forced when given): the lines it printed, once it
    ended well and left no namespace."""
    env = dict(os.environ, FM_RECIPE_TAG=tag, FM_RECIPE_NET=net, FM_RECIPE_JOIN=join)
    out = subprocess.run(
        ["bash", f"examples/clusters/{script}", str(work)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(timeout),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert not {n for n in netns.namespaces() if n.startswith(tag)}
    return out.stdout.splitlines()


def assert_same_training(work: Path, reference: dict) -> None:
    """Every sample once an epoch (the committed steps' records), the weights of an undisturbed run."""
    assert_exactly_once(work / "run")
    assert max_rel_diff(torch.load(work / "final.pt")["state"], reference) <= 1e-5


@pytest.mark.multihost
@pytest.mark.processes
@pytest.mark.timeout(400)
@pytest.mark.parametrize("join", JOIN_ORDERS)
def test_workers_started_by_hand_survive_a_crash_a_partition_and_rejoin(tmp_path, undisturbed, join):  # noqa: F811
    netns.skip_unless_available()
    lines = run_recipe("hand_started.sh", tmp_path / "work", f"fmr{os.getpid() % 10000}", "10.233.0", 300.0, join)
    assert re.fullmatch(r"\[fabric-model\] done: 80 steps, every sample once an epoch, 2 replicas agree", lines[-2])
    reasons = [line.strip() for line in lines if line.startswith("           ")]
    # B's first worker (3) was in the first generation, or joined A's: then a crash, a join, a
    # partition, a join, and the driver killed and run again, which takes both workers back.
    first = ["start"] if join == "first" else ["start", "worker 3 joins"]
    assert reasons[: len(first)] == first, reasons
    rest = reasons[len(first) :]
    assert len(rest) == 5 and "worker 3 lost" in rest[0] and rest[1] == "worker 4 joins", reasons
    assert "worker 4 lost" in rest[2] and "EDT_HEARTBEAT_TIME_OUT" in rest[2] and rest[3] == "worker 5 joins", reasons
    assert rest[4] == "the driver restarted", reasons
    generations = [line for line in lines if re.match(r"\+\s*[\d.]+ s gen \d+: ", line)]
    assert "2 on 10.233.0.1, 10.233.0.2" in generations[0 if join == "first" else 1], generations  # hosts by address
    assert "2 on 10.233.0.1, 10.233.0.2" in generations[-1], generations
    b_log = (tmp_path / "work" / "b.log").read_text()
    assert "exiting (4): removed from the job" in b_log  # fenced at the heal
    assert b_log.count("re-attached to the driver") == 1, b_log  # worker 5 waited for the killed driver
    console = (tmp_path / "work" / "driver.out").read_text()  # what the user watched: our lines, hosts by address
    joined = re.findall(r"^now 2 workers \(worker (\d) on 10\.233\.0\.2 joins\)$", console, re.M)
    assert joined == (["4", "5"] if join == "first" else ["3", "4", "5"]), console
    assert "now 1 worker (worker 3 on 10.233.0.2 lost: connection lost)" in console
    assert "now 2 workers (the driver restarted)" in console
    started = "2 workers training" if join == "first" else "1 worker training"
    assert all(line.startswith(("[fabric-model] ", "epoch ", "now ", started)) for line in console.splitlines())
    assert_same_training(tmp_path / "work", undisturbed)


@pytest.mark.multihost
@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_ray_cluster_with_token_authentication_survives_a_crash_a_new_node_and_a_partition(tmp_path, undisturbed):  # noqa: F811
    netns.skip_unless_available()
    if importlib.util.find_spec("ray") is None:  # found without importing it (which sets RAY_* variables)
        need("ray")
    started = time.time()
    lines = run_recipe("ray_cluster.sh", tmp_path / "work", f"fmy{os.getpid() % 10000}", "10.234.0", 480.0)
    assert re.fullmatch(r"\[fabric-model\] done: 80 steps, every sample once an epoch", lines[-2]), lines[-3:]
    reasons = [line.strip() for line in lines if line.startswith("           ")]
    assert "lost" in reasons[1] and "joins" in reasons[2] and "EDT_HEARTBEAT_TIME_OUT" in reasons[3], reasons
    assert any("gen 2: 2 on 10.234.0.3, 10.234.0.4" in line for line in lines)  # hosts by address: C, D that joined
    console = (tmp_path / "work" / "driver.out").read_text()  # our lines only, Ray's reports in logs/ray.log
    assert re.search(r"^now 2 workers \(worker \d+ on 10\.234\.0\.4 joins\)$", console, re.M), console
    assert all(line.startswith(("[fabric-model] ", "epoch ", "now ", "2 workers ")) for line in console.splitlines())
    assert_same_training(tmp_path / "work", undisturbed)
    assert not list(Path("/tmp").glob("fmray.*")) or all(
        p.stat().st_mtime < started for p in Path("/tmp").glob("fmray.*")
    )


@pytest.mark.multihost
@pytest.mark.processes
@pytest.mark.timeout(400)
@pytest.mark.parametrize("join", JOIN_ORDERS)
def test_a_slurm_job_ended_by_its_time_limit_goes_on_from_its_checkpoint_on_other_hosts(tmp_path, undisturbed, join):  # noqa: F811
    """Slurm's time limit signals every process of the allocation: the driver saves, stops the
    workers and exits 143 within KillWait, the workers started by hand exit 0 told why (by the
    driver, or their own SIGTERM when it came first: they leave after their step); the
    requeued job, on 2 other hosts, goes on from the checkpoint to the undisturbed weights.
    B's and C's workers are in the first generation, or join it, whichever srun's order gives."""
    netns.skip_unless_available()
    work = tmp_path / "work"
    lines = run_recipe("slurm.sh", work, f"fms{os.getpid() % 10000}", "10.235.0", 300.0, join)
    assert re.fullmatch(r"allocation: every process ended [\d.]+ s after SIGTERM", lines[0]), lines  # no SIGKILL
    assert lines[1] == "allocation 1: tasks exited 143 0 0 (A's driver: 143 is SIGTERM)", lines
    # Where the time limit lands: within an epoch's steps, or in its validation (both as said on screen).
    where = r"(step \d+/10|its validation)"
    assert re.fullmatch(rf"SIGTERM: preempted at epoch \d, {where}; resume with train\(.*resume=True\)", lines[2])
    assert lines[3] == "allocation 2: tasks exited 0 0", lines
    for task in (1, 2):  # told by the driver, or (its SIGTERM first) left after its step: Slurm's order is none
        said = (work / f"task-1-{task}.log").read_text()
        assert re.search(r"exiting \(0\): (the job ended \(preempted\)|leaves \(SIGTERM\) after unit)", said), said
    assert 'resume="auto": the run in' in (work / "task-2-0.log").read_text()
    reasons = [line.strip() for line in lines if line.startswith("           ")]
    resumed = [i for i, r in enumerate(reasons) if r.startswith("start, resumed from ckpt-unit-")]
    assert len(resumed) == 1 and reasons[0] == "start", reasons
    before = reasons[1 : resumed[0]]  # joins (B and C together or one by one) and SIGTERM leaves only
    assert all(re.search(r"\b(joins?|leaves? \(SIGTERM\))$", r) for r in before), reasons
    assert any(re.search(r"\bjoins?$", r) for r in before) == (join == "after"), reasons
    generations = [line for line in lines if re.match(r"\+\s*[\d.]+ s gen \d+: ", line)]
    allocation_1 = generations[: resumed[0]]
    hosts = [set(re.findall(r"10\.235\.0\.\d", g)) for g in allocation_1]
    assert {"10.235.0.1", "10.235.0.2", "10.235.0.3"} in hosts, generations  # A, B and C trained together
    assert hosts[0] == ({"10.235.0.1", "10.235.0.2", "10.235.0.3"} if join == "first" else {"10.235.0.1"}), hosts
    assert re.search(r"gen \d+: 2 on 10\.235\.0\.4, 10\.235\.0\.5", lines[-4]), lines  # the requeued allocation: D, E
    screen = (work / "task-2-0.log").read_text()
    joined = re.findall(r"now 2 workers \(worker \d+ on ([\d.]+) joins\)", screen)
    assert joined in ([], ["10.235.0.5"]), joined  # E's join, by address (none when D's first generation had it)
    assert re.fullmatch(r"\[fabric-model\] done: 80 steps, every sample once an epoch, 2 replicas agree", lines[-2])
    assert_same_training(work, undisturbed)


def test_a_raylets_report_goes_to_the_run_directory_and_one_line_to_the_console(tmp_path, caplog):
    """Ray prints a dead raylet's report (its log's tail, a native stack trace) on the driver's
    console; while a job runs it goes to logs/ray.log instead, said in one line. Other output of
    Ray's (a worker's print) passes through, and the function is put back after."""
    from types import SimpleNamespace

    from fabric_model.launchers.ray_console import RayConsole

    printed = []
    ray_worker = SimpleNamespace(print_to_stdstream=lambda data, ignore_prefix: printed.append(data))
    original = ray_worker.print_to_stdstream
    console = RayConsole(tmp_path / "ray.log")
    console.install(ray_worker)
    report = "Raylet is terminated. Termination is unexpected. Last 20 lines of the Raylet logs:\n    *** SIGSEGV"
    ray_worker.print_to_stdstream({"lines": [report], "pid": "raylet", "is_err": False}, False)
    dead = "The node with node id: 6f1c and address: 10.234.0.3 and node name: 10.234.0.3 has been marked dead because"
    ray_worker.print_to_stdstream({"lines": [dead], "pid": "raylet", "is_err": False}, False)
    ray_worker.print_to_stdstream({"lines": ["hello"], "pid": 123, "is_err": False}, False)
    console.close()
    assert printed == [{"lines": ["hello"], "pid": 123, "is_err": False}]
    assert (tmp_path / "ray.log").read_text() == report + "\n" + dead + "\n"
    assert [r.getMessage() for r in caplog.records] == [
        "Ray: a raylet ended (logs/ray.log)",
        "Ray: node 10.234.0.3 marked dead (logs/ray.log)",
    ]
    assert all(len("[fabric-model] warning: " + r.getMessage()) <= 80 for r in caplog.records)  # 80 columns
    assert ray_worker.print_to_stdstream is original
